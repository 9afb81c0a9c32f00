"""Time to the first training step, the package beside the references, on the same data.

    python benchmarks/bench_startup.py                 # every case, 3 rounds
    python benchmarks/bench_startup.py --runs 5 --cases mrpc-warm,mrpc-accelerate

Cases, each a fresh process (`--max-steps 1`; start-up ends where the first step begins, so the
step and what follows do not count):
- mrpc-cold / mrpc-warm: `xla-train train --backend cpu` (the default job: the bundled MiniLM on
  the bundled MRPC) with an empty data cache, and with the entry an earlier run wrote;
- mrpc-accelerate: the course's loop under Accelerate on the same model and data
  (benchmarks/reference_accelerate.py);
- decoder-cold / decoder-warm: `--problem causal-lm`, packed rows of 64 tokens, on a 2-layer Llama
  and the tests' synthetic rows (4,000 documents), as benchmarks/bench_sft.py makes them;
- decoder-trl: TRL's SFTTrainer on the same model and data (packing, max_length 64, the CPU).

The time is measured from this script's launch of the process to the Unix time at which the
process began its first step (the package: goodput's `started_at` + `startup`; the references:
stamped before their first batch), so the interpreter's start and every import count alike.
Cases alternate round by round, so a busy machine slows each alike; the medians are compared.
The package's rows also give start-up's split (imports, data, model, device).

Writes OUT/startup.json (OUT defaults to benchmarks/out).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("imports", "data", "model", "device")
CASES = ("mrpc-cold", "mrpc-warm", "mrpc-accelerate", "decoder-cold", "decoder-warm", "decoder-trl")
ENV = {"PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false", "USE_TORCH_XLA": "0"}
DECODER = ["--max-length", "64", "--batch-size", "8", "--lr", "3e-3"]


def decoder_inputs(folder):
    """The tiny Llama and its rows (tests/tiny_decoders.py), made once in `folder`."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_decoders as td

    model = folder / "llama"
    if not (model / "config.json").exists():
        td.save("llama", model, chat=True, letters=True)
        td.write_jsonl(folder / "train.jsonl", td.reverse_rows(4000, 1))
        td.write_jsonl(folder / "validation.jsonl", td.reverse_rows(64, 2))
    return {"model": str(model), "train": str(folder / "train.jsonl"), "validation": str(folder / "validation.jsonl")}


def command(case, tmp, data):
    """(argv, environment additions, metrics file) of one run of `case`."""
    metrics = tmp / f"{case}-{time.monotonic_ns()}.json"
    cache = {"HF_DATASETS_CACHE": str(tmp / ("warm" if case.endswith("warm") else f"cold-{metrics.stem}"))}
    package = [sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--max-steps", "1", "--metrics-out",
               str(metrics)]
    if case.startswith("mrpc-") and case != "mrpc-accelerate":
        return package, cache, metrics
    if case == "mrpc-accelerate":
        return [sys.executable, str(ROOT / "benchmarks" / "reference_accelerate.py"), "--max-steps", "1",
                "--metrics-out", str(metrics)], {}, metrics
    if case == "decoder-trl":
        return [sys.executable, __file__, "--trl-child", json.dumps({**data, "out": str(metrics)})], {}, metrics
    return [*package, "--problem", "causal-lm", "--model", data["model"], "--train-file", data["train"],
            "--validation-file", data["validation"], *DECODER], cache, metrics


def run_once(case, tmp, data):
    argv, env, metrics = command(case, tmp, data)
    launched = time.time()
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **ENV, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case}: exit code {proc.returncode}\n{proc.stderr[-3000:]}")
    m = json.loads(metrics.read_text())
    if "goodput" in m:
        goodput = m["goodput"]
        first_step = goodput["started_at"] + goodput["seconds"]["startup"]
        split = goodput["startup"]
    else:
        first_step, split = m["first_step_at"], {}
    return {"first_step": round(first_step - launched, 3), **split}


def trl_child(spec):
    """TRL's SFTTrainer, as bench_sft.py's case runs it, stamping the Unix time its first step begins."""
    started = time.time()
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    s = argparse.Namespace(**spec)
    stamp = {}

    class FirstStep(TrainerCallback):
        def on_step_begin(self, *_, **__):
            stamp.setdefault("first_step_at", time.time())

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    train = datasets.load_dataset("json", data_files=s.train, split="train")
    validation = datasets.load_dataset("json", data_files=s.validation, split="train")
    config = SFTConfig(output_dir=s.out + "-model", max_length=64, packing=True, per_device_train_batch_size=8,
                       learning_rate=3e-3, max_steps=1, report_to=[], save_strategy="no", eval_strategy="no",
                       use_cpu=True, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=validation,
                         processing_class=tokenizer, callbacks=[FirstStep()])
    trainer.train()
    Path(s.out).write_text(json.dumps({**stamp, "started_at": started}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="rounds: each case once per round")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        return trl_child(json.loads(args.trl_child))
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases: {', '.join(sorted(unknown))}")
    runs = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        data = decoder_inputs(tmp / "decoder")
        for case in cases:  # the warm cases' entries, and every file read once, before any timing
            if case.endswith("warm"):
                run_once(case, tmp, data)
        for i in range(args.runs):
            for case in cases:
                r = run_once(case, tmp, data)
                runs[case].append(r)
                print(f"round {i + 1} {case}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    medians = {c: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for c, rs in runs.items()}
    print(f"\nmedians of {args.runs} runs, seconds from the process's launch to its first training step "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end):")
    print("| case | first step | " + " | ".join(PARTS) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in PARTS) + " |")
    for c, m in medians.items():
        print(f"| {c} | {m['first_step']:.2f} | " + " | ".join(f"{m[k]:.2f}" if k in m else "" for k in PARTS) + " |")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    (out / "startup.json").write_text(json.dumps({"command": sys.argv, "commit": commit.stdout.strip(),
                                                  "date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(),
                                                  "load_average": os.getloadavg(), "runs": runs,
                                                  "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
