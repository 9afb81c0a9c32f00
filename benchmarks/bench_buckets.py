"""How `--buckets auto` moves with job length and compile cost, on a task's data (MRPC by default)
with the bundled tokenizer.

For each job length (optimizer steps of batch 8) and each cost of one compilation, it prints the
bucket lengths the chooser picks, the time its cost model expects, and the padding efficiency,
beside the same model's estimate for the two usual fixed recipes: one bucket at max_length 128,
and 32/64/96/128. Nothing is trained: this shows the chooser's decisions; whole-job timings of the
choices it makes are in bench_mrpc.py's runs (benchmarks/RESULTS.md).

    python benchmarks/bench_buckets.py                             # XLA:CPU's per-token cost
    python benchmarks/bench_buckets.py --token-seconds 2e-6        # a TPU chip's (rough)
    python benchmarks/bench_buckets.py --train-file T.tsv --validation-file D.tsv --text-columns sentence
                                                                   # own data, as xla-train train reads it

Writes OUT/buckets.json and OUT/buckets.md (OUT defaults to benchmarks/out).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from xla_train.core.shapes import CostModel, auto_buckets, job_rows
from xla_train.core.xla import XlaAccelerator
from xla_train.models import bundled_model_path
from xla_train.tasks import Source, load_task
from xla_train.tasks.sequence import tokenize

STEPS = (20, 100, 459, 1377, 4590)  # 459 steps of batch 8 = one MRPC epoch
COMPILE_SECONDS = (0.0, 3.0, 6.0, 12.0, 40.0, 120.0)  # 12 s: XLA:CPU here; 6 s: the TPU estimate (XlaAccelerator)
FIXED = {"128": [128], "32,64,96,128": [32, 64, 96, 128]}


def fixed_estimate(buckets, train_len, eval_len, steps, batch, epochs, cost):
    """The cost model's time for a fixed bucket list (the rows and weights auto_buckets uses)."""
    lengths, weights = job_rows(train_len, eval_len, steps, batch, epochs)
    padded = np.asarray(buckets)[np.searchsorted(buckets, lengths)]
    return cost.total(len(buckets), float((padded * weights).sum()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--token-seconds", type=float, default=XlaAccelerator.token_seconds,
                   help="seconds per padded token of a training step (default: XLA:CPU's, measured here)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    for option in ("task", "data-dir", "train-file", "validation-file", "text-columns"):
        p.add_argument(f"--{option}", default=None, help="as for xla-train train")
    p.add_argument("--label-column", default="label")
    args = p.parse_args()

    task, splits = load_task(Source(args.task, args.data_dir, args.train_file, args.validation_file,
                                    args.text_columns, args.label_column))
    data, _ = tokenize(splits, AutoTokenizer.from_pretrained(bundled_model_path()), 128)
    train_len = np.asarray(data["train"]["length"])
    eval_len = np.concatenate([data[split]["length"] for split in task.eval_splits])
    epochs = 3
    rows, md = [], [f"Command: `python benchmarks/bench_buckets.py {' '.join(sys.argv[1:])}`\n",
                    f"Per-token cost {args.token_seconds:g} s; batch {args.batch_size}; {task.describe()}; "
                    f"train rows average {train_len.mean():.1f} tokens (max {train_len.max()}).\n",
                    "| steps | compile s | auto buckets | auto est. s | auto padding eff. | "
                    + " | ".join(f"[{k}] est. s" for k in FIXED) + " |",
                    "| ---: | ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in FIXED) + " |"]
    for steps in STEPS:
        for compile_s in COMPILE_SECONDS:
            cost = CostModel(compile_seconds=compile_s, token_seconds=args.token_seconds)
            buckets, est = auto_buckets(train_len, eval_len, steps, args.batch_size, epochs, 128, cost)
            fixed = {k: round(fixed_estimate(b, train_len, eval_len, steps, args.batch_size, epochs, cost), 1)
                     for k, b in FIXED.items()}
            rows.append({"steps": steps, "compile_seconds": compile_s, "buckets": buckets,
                         "estimated_seconds": est["estimated_seconds"],
                         "padding_efficiency": est["padding_efficiency"], "fixed_estimated_seconds": fixed})
            md.append(f"| {steps} | {compile_s:g} | {','.join(map(str, buckets))} | {est['estimated_seconds']} | "
                      f"{est['padding_efficiency']} | " + " | ".join(str(v) for v in fixed.values()) + " |")
            # the exact search can never lose to a fixed recipe under its own cost model
            assert all(est["estimated_seconds"] <= v + 0.1 for v in fixed.values()), (steps, compile_s)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "buckets.json").write_text(json.dumps({"token_seconds": args.token_seconds, "rows": rows}, indent=2) + "\n")
    (out / "buckets.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
