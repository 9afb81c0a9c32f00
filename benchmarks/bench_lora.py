"""Full fine-tuning against `--lora` on the MRPC job with the bundled MiniLM, on the CPU and on
XLA:CPU, all four runs in this one command (each `--max-steps` steps, batch 8, one 128-token
bucket, a checkpoint at the end, the dev set scored once).

    python benchmarks/bench_lora.py                  # 60 steps each
    python benchmarks/bench_lora.py --steps 200 --lr 5e-4

Reports trainable parameters, gradient and AdamW bytes (the memory plan), the last checkpoint's
size and the seconds checkpoints took, steady-state samples/s (after the first epoch's
compilations), compilations and dev accuracy / F1. Few steps score little either way: the
accuracy column says whether the run learned, not what a full job reaches. Prints and writes
OUT/lora.json and OUT/lora.md (OUT defaults to benchmarks/out/lora).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def run(name, backend, lora, args, out):
    folder, metrics = out / name, out / f"{name}.json"
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "-m", "xla_train", "train", "--backend", backend, "--max-steps", str(args.steps),
           "--save-every", str(args.steps), "--buckets", "128", "--log-every", "20", "--seed", "0",
           "--output-dir", str(folder), "--metrics-out", str(metrics)]
    cmd += ["--lora", "--lr", str(args.lr)] if lora else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    if proc.returncode:
        sys.exit(f"{name} failed: {proc.stderr.strip().splitlines()[-1]}")
    m = json.loads(metrics.read_text())
    checkpoint = Path(m["checkpoint"])
    return {"case": name, "trainable_params": m["trainable_params"], "total_params": m["total_params"],
            "grad_mib": m["memory"]["grad_bytes_per_device"] / MIB,
            "adamw_mib": m["memory"]["optimizer_bytes_per_device"] / MIB,
            "checkpoint_mib": sum(f.stat().st_size for f in checkpoint.iterdir()) / MIB,
            "checkpoint_s": m["checkpoint_seconds"], "steady_samples_per_s": m["steady_samples_per_s"],
            "compiles": (m["xla"] or {}).get("compiles"), "accuracy": m["eval"]["accuracy"], "f1": m["eval"]["f1"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-4, help="--lora's learning rate (full fine-tuning keeps 5e-5)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "lora"))
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run(f"{backend}-{'lora' if lora else 'full'}", backend, lora, args, out)
            for backend in ("cpu", "xla") for lora in (False, True)]
    md = [f"Command: `python benchmarks/bench_lora.py {' '.join(sys.argv[1:])}` ({args.steps} steps, MiniLM, batch 8, "
          "one 128-token bucket)\n",
          "| case | trained params (of total) | grads MiB | AdamW MiB | checkpoint MiB | checkpoint s "
          "| steady samples/s | compiles | dev accuracy / F1 |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['case']} | {r['trainable_params']:,} ({r['total_params']:,}) | {r['grad_mib']:.2f} | "
                  f"{r['adamw_mib']:.2f} | {r['checkpoint_mib']:.2f} | {r['checkpoint_s']:.2f} | "
                  f"{r['steady_samples_per_s']} | {r['compiles'] if r['compiles'] is not None else '-'} | "
                  f"{r['accuracy']:.4f} / {r['f1']:.4f} |")
    table = "\n".join(md)
    print(table)
    (out / "lora.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    (out / "lora.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
