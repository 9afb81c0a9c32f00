"""Side by side, in one invocation: `xla-train predict` against transformers'
`pipeline("text-classification")` with the same fine-tuned model and batch size (8), on the same
device, over MRPC's test.tsv (1725 rows). Whole process wall time (start-up, loading, tokenising,
compiling, predicting, writing) decides; the predicted labels are compared row by row.

    python benchmarks/bench_predict.py                          # XLA:CPU and CPU, all 1725 rows
    python benchmarks/bench_predict.py --cases cpu,cpu-pipeline  # one device only
    python benchmarks/bench_predict.py --rows 400               # the first 400 rows

Without --model it first fine-tunes the bundled MiniLM for 200 steps with `xla-train train` (CPU).
Writes OUT/predict.json and OUT/predict.md (OUT defaults to benchmarks/out/predict).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = ROOT / "xla_train" / "data" / "mrpc" / "test.tsv"
XLA_ENV = {"PJRT_DEVICE": "CPU"}
CPU_ENV = {"USE_TORCH_XLA": "0"}

PIPELINE = r'''
import csv, json, sys, time
import torch
from transformers import pipeline
model, inp, out, device = sys.argv[1:5]
with open(inp, newline="", encoding="utf-8") as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
if device == "xla":
    import torch_xla
    import torch_xla.debug.metrics as met
    dev = torch_xla.device()
else:
    dev = torch.device("cpu")
clf = pipeline("text-classification", model=model, device=dev)
preds = clf([{"text": r[3], "text_pair": r[4]} for r in rows], batch_size=8, truncation=True, max_length=128)
label2id = clf.model.config.label2id
with open(out, "w") as f:
    f.write("index\tprediction\n")
    f.writelines(f"{r[0]}\t{label2id[p['label']]}\n" for r, p in zip(rows, preds))
compiles = met.metric_data("CompileTime")[0] if device == "xla" and met.metric_data("CompileTime") else None
print(json.dumps({"compiles": compiles}))
'''


def cases(model, inp, out):
    ours = [sys.executable, "-m", "xla_train", "predict", "--model", str(model), "--input", str(inp)]
    pipe = [sys.executable, "-c", PIPELINE, str(model), str(inp)]
    return {
        "xla": ("xla-train predict (xla)", ours + ["--backend", "xla", "--output", str(out / "xla.tsv")], XLA_ENV),
        "xla-pipeline": ("pipeline (xla)", pipe + [str(out / "xla-pipeline.tsv"), "xla"], XLA_ENV),
        "cpu": ("xla-train predict (cpu)", ours + ["--backend", "cpu", "--output", str(out / "cpu.tsv")], CPU_ENV),
        "cpu-pipeline": ("pipeline (cpu)", pipe + [str(out / "cpu-pipeline.tsv"), "cpu"], CPU_ENV),
    }


def labels(path):
    return [line.split("\t")[1] for line in Path(path).read_text().splitlines()[1:]]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="xla,xla-pipeline,cpu,cpu-pipeline")
    p.add_argument("--model", default=None, help="a folder written by xla-train train (default: fine-tune one)")
    p.add_argument("--rows", type=int, default=None, help="predict only the first N rows of test.tsv")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "predict"))
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = out / "model"
        if not (model / "config.json").exists():  # fine-tuned once, then reused
            print("== fine-tuning the bundled MiniLM for 200 steps (CPU)", flush=True)
            subprocess.run([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--max-steps", "200",
                            "--output-dir", str(model)], cwd=ROOT, check=True, env={**os.environ, **CPU_ENV},
                           stderr=subprocess.DEVNULL)
    inp = TEST
    if args.rows:
        lines = TEST.read_text(encoding="utf-8").splitlines(keepends=True)
        inp = out / "test.tsv"
        inp.write_text("".join(lines[: args.rows + 1]), encoding="utf-8")
    n = len(inp.read_text(encoding="utf-8").splitlines()) - 1
    table = cases(model, inp, out)
    results = {}
    for name in args.cases.split(","):
        label, cmd, env = table[name]
        print(f"== {name}: {label}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        row = {"label": label, "wall_seconds": round(wall, 1), "returncode": proc.returncode, "rows": n}
        text = proc.stdout + proc.stderr
        if "graphs compiled" in text:
            row["compiles"] = int(text.split("; ")[-1].split()[0])
        elif name.endswith("pipeline") and proc.returncode == 0:
            row["compiles"] = json.loads(proc.stdout.strip().splitlines()[-1])["compiles"]
        results[name] = row
        print(f"   {wall:.1f} s, exit {proc.returncode}", flush=True)
    md = [f"Command: `python benchmarks/bench_predict.py {' '.join(sys.argv[1:])}` ({n} rows, batch 8)\n",
          "| case | wall s | pipeline / xla-train | compilations | labels equal to the pipeline's |",
          "| --- | ---: | ---: | ---: | ---: |"]
    for name, row in results.items():
        ratio = agree = "-"
        ref = results.get(f"{name}-pipeline")
        if ref and ref["returncode"] == 0 and row["returncode"] == 0:
            ratio = f"{ref['wall_seconds'] / row['wall_seconds']:.2f}x"
            a, b = labels(out / f"{name}.tsv"), labels(out / f"{name}-pipeline.tsv")
            agree = f"{sum(x == y for x, y in zip(a, b)) / len(b):.4f}"
            row.update(speedup=ratio, label_agreement=float(agree))
        status = "" if row["returncode"] == 0 else f" (exit {row['returncode']})"
        compiles = row.get("compiles", "-")
        md.append(f"| {row['label']}{status} | {row['wall_seconds']} | {ratio} | {compiles} | {agree} |")
    (out / "predict.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "predict.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
