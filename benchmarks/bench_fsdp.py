"""`--strategy fsdp` against `--strategy spmd` on 4 XLA:CPU devices: the bundled MiniLM on the MRPC
job (one 128-token bucket, 2 rows per device, the global batch of 8), both runs in this one command.

    python benchmarks/bench_fsdp.py                     # 40 steps each
    python benchmarks/bench_fsdp.py --steps 80 --gradient-checkpointing

Reports the per-device memory plan, the largest loss difference, compilations, host syncs per
step, aten fallbacks, steady-state samples/s (after the first epoch's compilations; see the metrics
JSON), the wall time, and the checkpoints (one every 20 steps): their seconds in all (the metrics'
`checkpoint_seconds`) and the size of the last one (spmd: whole copies; fsdp: the host's shards).
XLA:CPU runs the 4 "devices" on this machine's cores, so the step times
say what sharding costs in collectives and partitioning here, not what a TPU would do. Prints and
writes OUT/fsdp.json and OUT/fsdp.md (OUT defaults to benchmarks/out/fsdp).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def run(strategy, args, out):
    metrics = out / f"run-{strategy}.json"  # the run's own metrics (fsdp.json is the summary)
    cmd = [sys.executable, "-m", "xla_train", "train", "--backend", "xla", "--strategy", strategy,
           "--batch-size", "2", "--max-steps", str(args.steps), "--buckets", "128", "--log-every", "10",
           "--seed", "0", "--metrics-out", str(metrics), "--save-every", "20", "--output-dir", str(out / strategy),
           "--overwrite"] + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{strategy} failed: {proc.stderr.strip().splitlines()[-1]}")
    last = sorted((out / strategy / "checkpoints").glob("step-*"))[-1]
    size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    return {**json.loads(metrics.read_text()), "wall_s": round(wall, 1), "checkpoint_mib": size / MIB}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "fsdp"))
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = {s: run(s, args, out) for s in ("spmd", "fsdp")}
    losses = [[loss for _, loss, _ in runs[s]["train_loss"]] for s in runs]
    diff = max(abs(a - b) for a, b in zip(*losses))
    rows = []
    for s, m in runs.items():
        mem, x = m["memory"], m["xla"]
        rows.append({"strategy": s, "param_mib_per_device": mem["param_bytes_per_device"] / MIB,
                     "optimizer_mib_per_device": mem["optimizer_bytes_per_device"] / MIB,
                     "param_mib_total": mem["param_bytes_total"] / MIB, "compiles": x["compiles"],
                     "compile_s": x["compile_seconds"], "host_syncs_per_step": x["host_syncs_per_step"],
                     "aten_fallbacks": x["aten_fallbacks"], "steady_samples_per_s": m["steady_samples_per_s"],
                     "wall_s": m["wall_s"], "checkpoint_s": m["checkpoint_seconds"],
                     "checkpoint_mib": m["checkpoint_mib"], "eval": m["eval"]})
    md = [f"Command: `python benchmarks/bench_fsdp.py {' '.join(sys.argv[1:])}` ({args.steps} steps, MiniLM, "
          f"4 XLA:CPU devices x 2 rows, one 128-token bucket); largest loss difference {diff:.2e}\n",
          "| strategy | params MiB/device (of total) | AdamW MiB/device | compiles (s) | host syncs/step "
          "| aten fallbacks | steady samples/s | wall s | checkpoints s | checkpoint MiB | dev accuracy |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['strategy']} | {r['param_mib_per_device']:.1f} ({r['param_mib_total']:.1f}) | "
                  f"{r['optimizer_mib_per_device']:.1f} | {r['compiles']} ({r['compile_s']:.0f}) | "
                  f"{r['host_syncs_per_step']} | {r['aten_fallbacks']} | {r['steady_samples_per_s']} | {r['wall_s']} | "
                  f"{r['checkpoint_s']:.2f} | {r['checkpoint_mib']:.1f} | {r['eval']['accuracy']:.4f} |")
    table = "\n".join(md)
    print(table)
    (out / "fsdp.json").write_text(json.dumps({"args": vars(args), "max_loss_difference": diff, "rows": rows},
                                              indent=1) + "\n")
    (out / "fsdp.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
