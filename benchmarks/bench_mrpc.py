"""Side by side, in one invocation on one machine: xla_train's MRPC job against the course's loop
under HF Accelerate, on XLA:CPU and on the plain CPU. Whole-job wall time (start-up,
tokenisation, compilation, training, evaluation) for the same number of steps decides.

    python benchmarks/bench_mrpc.py                        # full 3-epoch runs (about 1.5 h here)
    python benchmarks/bench_mrpc.py --max-steps 200        # a quick comparison
    python benchmarks/bench_mrpc.py --cases cpu,cpu-ref    # only the CPU fallback pair

Writes OUT/results.json and OUT/results.md (OUT defaults to benchmarks/out).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = [sys.executable, str(ROOT / "benchmarks" / "reference_accelerate.py")]
OURS = [sys.executable, "-m", "xla_train", "train"]
XLA_ENV = {"PJRT_DEVICE": "CPU"}
CPU_ENV = {"USE_TORCH_XLA": "0"}  # otherwise Accelerate silently moves the job onto XLA:CPU

# name: (label, command, environment); "<backend>-..." rows are compared with the "<backend>" row
CASES = {
    "xla": ("xla_train (xla, buckets auto)", OURS + ["--backend", "xla"], XLA_ENV),
    "xla-ref-static": ("accelerate (xla, max_length 128)", REF + ["--padding", "max_length"], XLA_ENV),
    "xla-ref-dynamic": ("accelerate (xla, dynamic)", REF + ["--padding", "dynamic"], XLA_ENV),
    "cpu": ("xla_train (cpu, buckets auto)", OURS + ["--backend", "cpu"], CPU_ENV),
    "cpu-ref": ("accelerate (cpu, dynamic)", REF + ["--padding", "dynamic"], CPU_ENV),
}


def run(name, cmd, env, extra, metrics):
    print(f"== {name}: {' '.join(cmd[1:] + extra)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + extra + ["--metrics-out", str(metrics)], cwd=ROOT,
                          env={**os.environ, **env}, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    m = json.loads(metrics.read_text())
    m["wall_seconds"] = round(wall, 2)
    print(f"   wall {wall:.1f} s, accuracy {m['eval']['accuracy']:.4f}, f1 {m['eval']['f1']:.4f}", flush=True)
    return m


def table(results):
    rows = ["| case | wall s | wall / xla_train's | train samples/s | steady samples/s | compiles | "
            "syncs/step | aten fallbacks | padding eff. | accuracy | F1 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, m in results.items():
        ours = results.get(key.split("-")[0])
        x = m.get("xla") or {}
        rows.append("| {} | {:.1f} | {} | {:.1f} | {} | {} | {} | {} | {} | {:.4f} | {:.4f} |".format(
            CASES[key][0], m["wall_seconds"],
            f"{m['wall_seconds'] / ours['wall_seconds']:.2f}x" if ours and ours is not m else "-",
            m["train_samples_per_s"], m.get("steady_samples_per_s", "-"), x.get("compiles", "-"),
            x.get("host_syncs_per_step", "-"), x.get("aten_fallbacks", "-"),
            m.get("padding_efficiency", "-"), m["eval"]["accuracy"], m["eval"]["f1"]))
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    args = p.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    results = {}
    for key in args.cases.split(","):
        label, cmd, env = CASES[key]
        results[key] = run(label, cmd, env, extra, out_dir / f"{key}.json")
    md = f"Command: `python benchmarks/bench_mrpc.py {' '.join(sys.argv[1:])}`\n\n" + table(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
