"""Generation speed, side by side in one invocation: `xla-train predict` on a causal LM's folder
against transformers' `generate` on the same model, prompts, batch size and `max_new_tokens`,
greedy, on XLA:CPU and on the CPU.

    python benchmarks/bench_generate.py                          # 24 prompts, batches of 4, 8 new tokens
    python benchmarks/bench_generate.py --cases xla,xla-generate  # XLA:CPU only
    python benchmarks/bench_generate.py --prompts 48 --max-new-tokens 16

On XLA, `xla-train predict` runs its static-shape loop (prompts left-padded to length buckets, a
key/value cache of fixed size, two graphs per bucket); the reference (`xla-generate`) is what a
torch_xla user writes first: the model on `torch_xla.device()` and `model.generate` with its
default dynamic key/value cache (no `cache_implementation="static"`), each batch left-padded to its
longest prompt, so every prompt length and every token of a growing cache is a new graph. On the
CPU (`cpu`, `cpu-generate`, `USE_TORCH_XLA=0`) both are transformers' `generate`, which predict
calls there. Prompts are tokenised as predict tokenises them (the tokenizer's special tokens, the
end-of-sequence token as padding where the tokenizer has none) and each row's tokens are counted
by the package's own rule (up to and with its first end-of-sequence token); `generate` stops a
batch once every row has ended, predict's loop always runs `--max-new-tokens` steps.

Without --model it first trains the tests' tiny Llama on the synthetic list-reversing task
(tests/tiny_decoders.py) with `xla-train train --problem causal-lm --backend cpu` (300 steps,
once, then reused), and prompts it with held-out rows of the task. Reports per case the whole
process's wall time, the generation's seconds (compilations included) and tokens/s, the tokens
generated, XLA's compilations and their seconds, device-to-host transfers and aten fallbacks
(torch_xla.debug.metrics), and how many completions equal predict's on the same backend. Writes
OUT/generate.json and OUT/generate.md (OUT defaults to benchmarks/out/generate).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"xla": {"PJRT_DEVICE": "CPU"}, "cpu": {"USE_TORCH_XLA": "0"}}


def xla_counters():
    """Compilations, their seconds, device-to-host transfers and aten fallbacks so far."""
    import torch_xla.debug.metrics as met

    compiles, ns = (met.metric_data("CompileTime") or (0, 0))[:2]
    transfers = (met.metric_data("TransferFromDeviceTime") or (0,))[0]
    fallbacks = sum(met.counter_value(c) for c in met.counter_names() if c.startswith("aten::"))
    return {"compiles": compiles, "compile_seconds": round(ns / 1e9, 2), "transfers": transfers,
            "aten_fallbacks": fallbacks}


def reference_worker(spec):
    """transformers' generate (greedy, its default dynamic cache) over the prompts in batches of
    `batch_size`, left-padded to each batch's longest; writes the completions and figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.completion import completions, end_ids

    s = argparse.Namespace(**spec)
    rows = [json.loads(line) for line in Path(s.input).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(s.model)
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32).eval()
    eos = end_ids(tokenizer, model)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.convert_ids_to_tokens(eos[0])
    if s.device == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cpu")
    model.to(device)
    tokens = []
    start = time.perf_counter()
    for i in range(0, len(rows), s.batch_size):
        batch = tokenizer([r["prompt"] for r in rows[i:i + s.batch_size]], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch.to(device), max_new_tokens=s.max_new_tokens, do_sample=False,
                                 eos_token_id=list(eos), pad_token_id=tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:].cpu()
        tokens.append(torch.nn.functional.pad(new, (0, s.max_new_tokens - new.shape[1]), value=eos[0]))
    seconds = time.perf_counter() - start
    texts, counts = completions(torch.cat(tokens), tokenizer, eos)
    Path(s.output).write_text("".join(json.dumps({**r, "completion": t}) + "\n" for r, t in zip(rows, texts)))
    Path(s.metrics).write_text(json.dumps({
        "rows": len(texts), "tokens_generated": sum(counts), "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(counts) / seconds, 2), **({"xla": xla_counters()} if s.device == "xla" else {})}))


def train_model(out, args):
    """The tests' tiny Llama trained on the synthetic task (once), and held-out prompts."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_decoders as td

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    prompts = td.write_jsonl(data / "prompts.jsonl", [{"prompt": r["prompt"], "expected": r["completion"].strip()}
                                                      for r in td.reverse_rows(args.prompts, 3)])
    if args.model:
        return args.model, prompts
    model = out / "model"
    if not (model / "config.json").exists():
        print("== training the tiny Llama on the synthetic task (300 steps, CPU)", flush=True)
        base = td.save("llama", data / "llama", chat=True, letters=True)
        subprocess.run([sys.executable, "-m", "xla_train", "train", "--problem", "causal-lm", "--backend", "cpu",
                        "--model", str(base), "--max-length", "64", "--lr", "3e-3", "--warmup-ratio", "0.05",
                        "--max-steps", "300", "--train-file", str(td.write_jsonl(data / "train.jsonl",
                                                                                 td.reverse_rows(4000, 1))),
                        "--validation-file", str(td.write_jsonl(data / "validation.jsonl", td.reverse_rows(64, 2))),
                        "--output-dir", str(model), "--overwrite"], cwd=ROOT, check=True,
                       env={**os.environ, **ENVS["cpu"]}, stdout=subprocess.DEVNULL)
    return str(model), prompts


def run_case(name, model, prompts, args, out):
    device = name.split("-")[0]
    output, metrics = out / f"{name}.jsonl", out / f"{name}-metrics.json"
    metrics.unlink(missing_ok=True)
    if name.endswith("-generate"):
        spec = {"model": model, "input": str(prompts), "output": str(output), "metrics": str(metrics),
                "device": device, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
        cmd = [sys.executable, __file__, "--reference-worker", json.dumps(spec)]
    else:
        cmd = [sys.executable, "-m", "xla_train", "predict", "--backend", device, "--model", model, "--input",
               str(prompts), "--output", str(output), "--metrics-out", str(metrics), "--batch-size",
               str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--buckets", args.buckets]
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **ENVS[device], "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - start
    (out / f"{name}.log").write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"{name} failed (see {out / name}.log): {proc.stderr.strip().splitlines()[-1]}")
    m = json.loads(metrics.read_text())
    return {"case": name, "wall_s": round(wall, 1), "seconds": m["seconds"], "tokens_per_s": m["tokens_per_s"],
            "tokens_generated": m["tokens_generated"], "rows": m["rows"], "buckets": m.get("buckets"),
            **(m.get("xla") or {}), "completions": [json.loads(line)["completion"]
                                                    for line in output.read_text().splitlines()]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="xla,xla-generate,cpu,cpu-generate")
    p.add_argument("--model", default=None, help="a causal LM's folder (default: train the tiny Llama)")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts of the synthetic task")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--buckets", default="auto", help="predict's --buckets")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "generate"))
    p.add_argument("--reference-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reference_worker:
        return reference_worker(json.loads(args.reference_worker))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, prompts = train_model(out, args)
    expected = [json.loads(line)["expected"] for line in prompts.read_text().splitlines()]
    rows = [run_case(name, model, prompts, args, out) for name in args.cases.split(",")]
    by = {r["case"]: r for r in rows}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    md = [f"Command: `python benchmarks/bench_generate.py {' '.join(sys.argv[1:])}` (commit {commit}, {date}; "
          f"{len(expected)} prompts, batch {args.batch_size}, --max-new-tokens {args.max_new_tokens}, greedy; "
          f"load average {os.getloadavg()[0]:.1f})\n",
          "| case | wall s | generation s | tokens | tokens/s | predict / generate (tokens/s) | compiles (s) "
          "| transfers | aten fallbacks | completions = predict's | right answers |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        device = r["case"].split("-")[0]
        ours, ref = by.get(device), by.get(f"{device}-generate")
        if ours and ref:
            r["speedup"] = round(ours["tokens_per_s"] / ref["tokens_per_s"], 2)
            r["same_as_predict"] = sum(a == b for a, b in zip(r["completions"], ours["completions"]))
        r["right"] = sum(c.strip() == e for c, e in zip(r["completions"], expected))
        compiles = f"{r['compiles']} ({r['compile_seconds']:.1f})" if "compiles" in r else "-"
        md.append(f"| {r['case']} | {r['wall_s']} | {r['seconds']:.2f} | {r['tokens_generated']} | "
                  f"{r['tokens_per_s']:,.1f} | {r['speedup'] if 'speedup' in r else '-'}x | {compiles} | "
                  f"{r.get('transfers', '-')} | {r.get('aten_fallbacks', '-')} | "
                  f"{r.get('same_as_predict', '-')} of {r['rows']} | {r['right']} |")
    table = "\n".join(md)
    print(table)
    (out / "generate.json").write_text(json.dumps({"commit": commit, "date": date, "command": sys.argv,
                                                   "load": os.getloadavg(), "args": vars(args), "rows": rows},
                                                  indent=1) + "\n")
    (out / "generate.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
