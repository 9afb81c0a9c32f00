"""Side by side, in one invocation on one machine: xla_train's MRPC job against the course's loop
under HF Accelerate, on XLA:CPU and on the plain CPU. Whole-job wall time (start-up,
tokenisation, compilation, training, evaluation) for the same number of steps decides.

    python benchmarks/bench_mrpc.py                        # full 3-epoch runs (about 1.5 h here)
    python benchmarks/bench_mrpc.py --max-steps 200        # a quick comparison
    python benchmarks/bench_mrpc.py --cases cpu            # only the CPU fallback pair

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

CASES = {
    "xla": [("xla_train (xla, buckets auto)", OURS + ["--backend", "xla"], XLA_ENV),
            ("accelerate (xla, max_length 128)", REF + ["--padding", "max_length"], XLA_ENV),
            ("accelerate (xla, dynamic)", REF + ["--padding", "dynamic"], XLA_ENV)],
    "cpu": [("xla_train (cpu, buckets auto)", OURS + ["--backend", "cpu"], CPU_ENV),
            ("accelerate (cpu, dynamic)", REF + ["--padding", "dynamic"], CPU_ENV)],
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
    rows = ["| case | wall s | speed-up vs this case | train samples/s | steady samples/s | compiles | "
            "syncs/step | aten fallbacks | padding eff. | accuracy | F1 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for group in results.values():
        ours = group[0]["metrics"]["wall_seconds"]
        for r in group:
            m, x = r["metrics"], r["metrics"].get("xla") or {}
            rows.append("| {} | {:.1f} | {} | {:.1f} | {} | {} | {} | {} | {} | {:.4f} | {:.4f} |".format(
                r["name"], m["wall_seconds"],
                "-" if r is group[0] else f"{m['wall_seconds'] / ours:.2f}x",
                m["train_samples_per_s"], m.get("steady_samples_per_s", "-"), x.get("compiles", "-"),
                x.get("host_syncs_per_step", "-"), x.get("aten_fallbacks", "-"),
                m.get("padding_efficiency", "-"), m["eval"]["accuracy"], m["eval"]["f1"]))
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--cases", default="xla,cpu", help="comma-separated: xla, cpu")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    results = {}
    for case in args.cases.split(","):
        results[case] = [{"name": n, "metrics": run(n, cmd, env, extra, out_dir / f"{case}-{i}.json")}
                         for i, (n, cmd, env) in enumerate(CASES[case])]
    md = f"Command: `python benchmarks/bench_mrpc.py {' '.join(sys.argv[1:])}`\n\n" + table(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
