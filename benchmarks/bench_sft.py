"""`--problem causal-lm` packed (`--packing`, the default) against bucket-padded (`--no-packing`,
`--buckets`) on the same model, data, steps and learning rate, on the CPU and on XLA:CPU, all runs
in this one command, one after the other.

    python benchmarks/bench_sft.py                         # 150 steps each, cpu and xla, packed and padded
    python benchmarks/bench_sft.py --max-steps 20          # a quick check
    python benchmarks/bench_sft.py --backends cpu --same-documents
    python benchmarks/bench_sft.py --model DIR --train-file T.jsonl --validation-file V.jsonl --max-length 512

The default model and data are the tests' synthetic task (tests/tiny_decoders.py): a tiny random
Llama over the task's 17 words, 4,000 training rows reversing a list of letters, 64 validation
rows. Both modes run the same optimizer steps of the same number of rows, but a packed row holds
several documents, so packing trains on more documents (and trained tokens) per step: the table
shows both. With --same-documents the padded runs take as many more steps as a packed row holds
documents on average, so both see about the same documents. The validation loss is scored once,
at the last step.

Reports, from each run's metrics JSON: the whole command's wall time, train_seconds, tokens/s
(padding included), trained tokens/s (tokens in the loss), the padding share, the trained tokens
(in all and per step), documents per step (mean), compilations and their seconds (XLA) and the
final validation loss; train_seconds, and so the token rates, include XLA's compilations. Prints
and writes OUT/sft.json and OUT/sft.md (OUT defaults to benchmarks/out/sft); each run's output is
kept in OUT/CASE.log.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("packed", "padded")


def synthetic(out, args):
    """The tests' synthetic task where --model, --train-file or --validation-file is not given."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_decoders as td

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not args.model:
        args.model = str(td.save("llama", data / "llama", chat=True, letters=True))
    if not args.train_file:
        args.train_file = str(td.write_jsonl(data / "train.jsonl", td.reverse_rows(4000, 1)))
        if not args.validation_file:
            args.validation_file = str(td.write_jsonl(data / "validation.jsonl", td.reverse_rows(64, 2)))


def run(backend, mode, steps, args, out):
    name = f"{backend}-{mode}"
    metrics, log = out / f"{name}.json", out / f"{name}.log"
    cmd = [sys.executable, "-m", "xla_train", "train", "--problem", "causal-lm", "--backend", backend,
           "--model", args.model, "--train-file", args.train_file, "--max-length", str(args.max_length),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--warmup-ratio", str(args.warmup_ratio),
           "--max-steps", str(steps), "--eval-every", str(steps), "--metrics-out", str(metrics)]
    cmd += ["--validation-file", args.validation_file] if args.validation_file else []
    cmd += ["--packing"] if mode == "packed" else ["--no-packing", "--buckets", args.buckets]
    print(f"== {name}: {steps} steps", flush=True)
    metrics.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - start
    log.write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"{name} failed (see {log}): {proc.stderr.strip().splitlines()[-1]}")
    m = json.loads(metrics.read_text())
    packed = re.search(r"packed (\d+) train documents into (\d+) rows", proc.stdout)
    docs_per_row = int(packed[1]) / int(packed[2]) if packed else 1.0  # --no-packing: a row per document
    tokens = m["tokens"]
    return {"case": name, "backend": backend, "mode": mode, "steps": m["steps"], "wall_s": round(wall, 1),
            "train_s": m["train_seconds"], "tokens_per_s": tokens["per_s"], "trained_per_s": tokens["trained_per_s"],
            "padding_share": tokens["padding_share"], "tokens_padded": tokens["padded"], "tokens_real": tokens["real"],
            "tokens_trained": tokens["trained"], "trained_per_step": round(tokens["trained"] / m["steps"], 1),
            "docs_per_row": round(docs_per_row, 3),
            "docs_per_step": round(m["train_samples"] / m["steps"] * docs_per_row, 1), "buckets": m["buckets"],
            "compiles": (m["xla"] or {}).get("compiles"),
            "compile_s": (m["xla"] or {}).get("compile_seconds"), "eval_loss": m["eval"]["loss"]}


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=150, help="optimizer steps of every run")
    p.add_argument("--backends", default="cpu,xla", help="comma-separated: cpu, xla (XLA:CPU)")
    p.add_argument("--same-documents", action="store_true",
                   help="padded runs take --max-steps x the packed rows' mean documents per row steps")
    p.add_argument("--buckets", default="auto", help="the padded runs' --buckets")
    p.add_argument("--model", default=None, help="a causal LM's folder or hub name (default: the tiny Llama)")
    p.add_argument("--train-file", default=None, help="default: the synthetic task's 4,000 rows")
    p.add_argument("--validation-file", default=None, help="default: the synthetic task's 64 rows with the "
                   "synthetic training rows, else the CLI's held-out share of --train-file")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "sft"))
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, data = args.model or "the tests' tiny Llama", args.train_file or "the synthetic reverse task"
    synthetic(out, args)
    rows = []
    for backend in args.backends.split(","):
        packed = run(backend, "packed", args.max_steps, args, out)
        steps = round(args.max_steps * packed["docs_per_row"]) if args.same_documents else args.max_steps
        rows += [packed, run(backend, "padded", steps, args, out)]
    dirty = git("status", "--porcelain", "--untracked-files=no")
    commit = git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    md = [f"Command: `python benchmarks/bench_sft.py {' '.join(sys.argv[1:])}` (commit {commit}, {date}; "
          f"{model} on {data}, --max-length {args.max_length}, batch {args.batch_size}, lr {args.lr:g}, padded "
          f"--buckets {args.buckets})\n",
          "| case | steps | wall s | train s | tokens/s | trained tokens/s | padding share | trained tokens "
          "| trained tokens/step | docs/step | buckets | compiles (s) | eval loss |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        compiles = f"{r['compiles']} ({r['compile_s']:.1f})" if r["compiles"] is not None else "-"
        md.append(f"| {r['case']} | {r['steps']} | {r['wall_s']} | {r['train_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['trained_per_s']:,.0f} | {r['padding_share']:.3f} | {r['tokens_trained']:,} | "
                  f"{r['trained_per_step']:,.1f} | {r['docs_per_step']} | "
                  f"{','.join(map(str, r['buckets'])) if r['buckets'] else '-'} | "
                  f"{compiles} | {r['eval_loss']:.4f} |")
    table = "\n".join(md)
    print(table)
    (out / "sft.json").write_text(json.dumps({"commit": commit, "date": date, "command": sys.argv,
                                              "args": vars(args), "rows": rows}, indent=1) + "\n")
    (out / "sft.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
