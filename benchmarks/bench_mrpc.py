"""Side by side, in one invocation on one machine: xla_train's MRPC job against the course's loop
under HF Accelerate, on XLA:CPU and on the plain CPU. Whole-job wall time (start-up,
tokenisation, compilation, training, evaluation) for the same number of steps decides.

    python benchmarks/bench_mrpc.py                        # full 3-epoch runs (3 h or more here)
    python benchmarks/bench_mrpc.py --max-steps 200        # a quick comparison
    python benchmarks/bench_mrpc.py --cases cpu,cpu-ref    # only the CPU fallback pair
    python benchmarks/bench_mrpc.py --pin                  # cases at once, one core and one thread each
    python benchmarks/bench_mrpc.py --cases xla,xla-bf16   # bf16 autocast against fp32, same seed
    python benchmarks/bench_mrpc.py --cases cuda,cuda-ref,cuda-bf16,cuda-ref-bf16   # on a GPU
    python benchmarks/bench_mrpc.py --cases cuda-b4,cuda-compile,cuda-ref --max-steps 300  # --compile (CUDA graphs)
    python benchmarks/bench_mrpc.py --cases cpu-b4,cpu-compile --max-steps 40            # --compile on the CPU

A `--compile` case keeps its graphs in OUT/compile-cache-CASE (`--compile-cache`, emptied first) and
runs a second time with that folder, as the row `CASE-cached`: the same job, its graphs loaded from
torch.compile's caches (the `cache hits` column; `compile s` is torch.compile's own seconds), compared
with the first run.

--pin runs the cases concurrently, each pinned to its own core with one thread (a case waits for
a free core); the speed drift of a shared machine then hits every case alike, and the wall-time
ratios compare one core against one core.

Writes OUT/results.json and OUT/results.md (OUT defaults to benchmarks/out).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = [sys.executable, str(ROOT / "benchmarks" / "reference_accelerate.py")]
OURS = [sys.executable, "-m", "xla_train", "train"]
XLA_ENV = {"PJRT_DEVICE": "CPU"}
CPU_ENV = {"USE_TORCH_XLA": "0"}  # otherwise Accelerate silently moves the job onto XLA:CPU

# --compile against eager with the same buckets, so both train on the same batches (auto picks
# fewer buckets when a graph costs a compilation)
BUCKETS4 = ["--buckets", "32,64,96,128"]
# name: (label, command, environment[, the row it is compared with]); "<backend>-..." rows are
# compared with the "<backend>" row unless they name another
CASES = {
    "xla": ("xla_train (xla, buckets auto)", OURS + ["--backend", "xla"], XLA_ENV),
    "xla-bf16": ("xla_train (xla, bf16)", OURS + ["--backend", "xla", "--precision", "bf16"], XLA_ENV),
    "xla-ref-static": ("accelerate (xla, max_length 128)", REF + ["--padding", "max_length"], XLA_ENV),
    "xla-ref-dynamic": ("accelerate (xla, dynamic)", REF + ["--padding", "dynamic"], XLA_ENV),
    "cpu": ("xla_train (cpu, buckets auto)", OURS + ["--backend", "cpu"], CPU_ENV),
    "cpu-ref": ("accelerate (cpu, dynamic)", REF + ["--padding", "dynamic"], CPU_ENV),
    "cpu-b4": ("xla_train (cpu, buckets 32,64,96,128)", OURS + ["--backend", "cpu", *BUCKETS4], CPU_ENV),
    "cpu-compile": ("xla_train (cpu, buckets 32,64,96,128, --compile)",
                    OURS + ["--backend", "cpu", *BUCKETS4, "--compile"], CPU_ENV, "cpu-b4"),
    # on a CUDA machine (Accelerate takes the GPU by itself there)
    "cuda": ("xla_train (cuda, buckets auto)", OURS + ["--backend", "cuda"], CPU_ENV),
    "cuda-bf16": ("xla_train (cuda, bf16)", OURS + ["--backend", "cuda", "--precision", "bf16"], CPU_ENV),
    "cuda-ref": ("accelerate (cuda, dynamic)", REF + ["--padding", "dynamic"], CPU_ENV),
    "cuda-ref-bf16": ("accelerate (cuda, dynamic, bf16)", REF + ["--padding", "dynamic", "--mixed-precision", "bf16"],
                      CPU_ENV),
    "cuda-b4": ("xla_train (cuda, buckets 32,64,96,128)", OURS + ["--backend", "cuda", *BUCKETS4], CPU_ENV),
    "cuda-compile": ("xla_train (cuda, buckets 32,64,96,128, --compile: CUDA graphs)",
                     OURS + ["--backend", "cuda", *BUCKETS4, "--compile"], CPU_ENV, "cuda-b4"),
}


def start(name, cmd, env, extra, metrics, core=None):
    print(f"== {name}: {' '.join(cmd[1:] + extra)}" + (f" (core {core})" if core is not None else ""),
          flush=True)
    if core is not None:
        env = {**env, "OMP_NUM_THREADS": "1"}
    log = metrics.with_suffix(".log")  # the case's stderr: progress bars, its summary, any error
    with log.open("w") as f:
        proc = subprocess.Popen(cmd + extra + ["--metrics-out", str(metrics)], cwd=ROOT,
                                env={**os.environ, **env}, stderr=f, preexec_fn=None if core is None
                                else lambda: os.sched_setaffinity(0, {core}))
    proc.t0, proc.name, proc.metrics, proc.log, proc.core = time.perf_counter(), name, metrics, log, core
    return proc


def finish(proc):
    proc.wait()
    wall = time.perf_counter() - proc.t0
    if proc.returncode != 0:  # a result too (the other cases go on): the table says how it ended
        print(proc.log.read_text()[-2000:], file=sys.stderr)
        print(f"   {proc.name}: FAILED with exit code {proc.returncode} after {wall:.1f} s "
              f"(log: {proc.log})", flush=True)
        return {"failed": proc.returncode, "wall_seconds": round(wall, 2), "log": str(proc.log)}
    m = json.loads(proc.metrics.read_text())
    m["wall_seconds"] = round(wall, 2)
    if proc.core is not None:
        m["pinned_core"] = proc.core
    print(f"   {proc.name}: wall {wall:.1f} s, accuracy {m['eval']['accuracy']:.4f}, "
          f"f1 {m['eval']['f1']:.4f}", flush=True)
    return m


def run_pinned(keys, extra, out_dir):
    """Each case on its own core, as many at once as there are cores."""
    free, running, results = sorted(os.sched_getaffinity(0)), {}, {}
    queue = list(keys)
    try:
        while queue or running:
            while queue and free:
                key = queue.pop(0)
                label, cmd, env = CASES[key][:3]
                running[key] = start(label, cmd, env, extra + cache_args(key, out_dir), out_dir / f"{key}.json",
                                     free.pop(0))
            done = next((k for k, pr in running.items() if pr.poll() is not None), None)
            if done is None:
                time.sleep(1)
                continue
            proc = running.pop(done)
            results[done] = finish(proc)
            free.append(proc.core)
    finally:  # Ctrl-C stops every case
        for proc in running.values():
            proc.kill()
    return {k: results[k] for k in keys}


CACHED = "-cached"  # a --compile case's second run, its graphs from the first run's --compile-cache


def compiled(key):
    return "--compile" in CASES[key][1]


def cache_args(key, out_dir):
    """A --compile case's --compile-cache folder (the same for its second run)."""
    return ["--compile-cache", str(out_dir / f"compile-cache-{key}")] if compiled(key) else []


def label_of(key):
    if key.endswith(CACHED):
        return CASES[key[:-len(CACHED)]][0] + ", second run: graphs from --compile-cache"
    return CASES[key][0]


def base_of(key):
    """The row a case is compared with."""
    if key.endswith(CACHED):
        return key[:-len(CACHED)]
    return CASES[key][3] if len(CASES[key]) > 3 else key.split("-")[0]


def loss_gap(m, base):
    """The largest difference of the logged training losses (the same steps) from the base row's."""
    theirs = {step: loss for step, loss, *_ in base.get("train_loss") or []}
    gaps = [abs(loss - theirs[step]) for step, loss, *_ in m.get("train_loss") or [] if step in theirs]
    return f"{max(gaps):.1e}" if gaps else "-"


def table(results):
    rows = ["| case | wall s | wall / base's | train samples/s | steady samples/s | steady / base's | "
            "max loss gap to base | compiles | compile s | cache hits | syncs/step | aten fallbacks | padding eff. "
            "| accuracy | F1 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, m in results.items():
        if "failed" in m:
            rows.append(f"| {label_of(key)} | failed (exit code {m['failed']}) after {m['wall_seconds']:.1f} s "
                        f"| - | - | - | - | - | - | - | - | - | - | - | - | - |")
            continue
        ours = results.get(base_of(key))
        ours = None if ours is None or "failed" in ours or ours is m else ours
        x = m.get("xla") or m.get("torch_compile") or {}
        rows.append(("| {} | {:.1f} | {} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.4f} "
                     "| {:.4f} |").format(
            label_of(key), m["wall_seconds"],
            f"{m['wall_seconds'] / ours['wall_seconds']:.2f}x" if ours else "-",
            m["train_samples_per_s"], m.get("steady_samples_per_s", "-"),
            f"{m['steady_samples_per_s'] / ours['steady_samples_per_s']:.2f}x"
            if ours and m.get("steady_samples_per_s") and ours.get("steady_samples_per_s") else "-",
            loss_gap(m, ours) if ours else "-", x.get("compiles", "-"), x.get("compile_seconds", "-"),
            x.get("cache_hits", "-"),
            x.get("host_syncs_per_step", "-"), x.get("aten_fallbacks", "-"),
            m.get("padding_efficiency", "-"), m["eval"]["accuracy"], m["eval"]["f1"]))
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--cases", default=",".join(k for k in CASES if k not in ("xla-bf16", "cpu-b4", "cpu-compile")
                                               and not k.startswith("cuda")),
                   help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--pin", action="store_true", help="run the cases at once, each on its own core")
    args = p.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    keys = args.cases.split(",")
    for key in filter(compiled, keys):  # the first run compiles every graph
        shutil.rmtree(out_dir / f"compile-cache-{key}", ignore_errors=True)
    if args.pin:
        results = run_pinned(keys, extra, out_dir)
    else:
        results = {}
        for key in keys:
            label, cmd, env = CASES[key][:3]
            results[key] = finish(start(label, cmd, env, extra + cache_args(key, out_dir), out_dir / f"{key}.json"))
    for key in filter(compiled, keys):  # the same job again, its graphs in the cache the first run filled
        label, cmd, env = CASES[key][:3]
        results[key + CACHED] = finish(start(label_of(key + CACHED), cmd, env, extra + cache_args(key, out_dir),
                                             out_dir / f"{key}{CACHED}.json"))
    md = f"Command: `python benchmarks/bench_mrpc.py {' '.join(sys.argv[1:])}`\n\n" + table(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(md)
    print(md)
    failed = [label_of(k) for k, m in results.items() if "failed" in m]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (logs in {out_dir})")


if __name__ == "__main__":
    main()
