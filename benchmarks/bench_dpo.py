"""`--problem dpo` against TRL 1.16's `DPOTrainer` on the same tiny random Llama, pairs, steps,
learning rate, beta and batch, on the CPU and on XLA:CPU, all runs in this one command, one after
the other; the table goes to the console and benchmarks/out/dpo.json.

    python benchmarks/bench_dpo.py                          # 300 steps of 16 pairs: ours cpu, xla; trl cpu
    python benchmarks/bench_dpo.py --max-steps 50           # a quick check
    python benchmarks/bench_dpo.py --cases cpu,trl-cpu --seeds 42,1,2
    python benchmarks/bench_dpo.py --cases xla,trl-xla      # TRL on XLA:CPU (PJRT_DEVICE=CPU), where it runs

The task is the tests' (tests/test_dpo.py): a 2-layer, 64-wide random Llama over the reversal
task's 17 words, prompts `reverse c a b =`, chosen the letters reversed, rejected another order of
them; 2,000 training pairs, --eval-pairs held-out pairs (512; the tests hold out 64, where one
pair moves the accuracy by 0.016).

Ours: no LoRA, so the reference log-probabilities are computed once before training (the time is
part of the run's wall time, not of the training's pairs/s); --max-length 32 holds both sequences
of a pair in one row (the longest pair is 26 tokens), padded to --buckets 32. TRL: its defaults
for the reference (a frozen copy of the model, run in every step), `max_length` 16 per sequence
(the same cut: none), fp32, no gradient checkpointing, no clipping, no weight decay, the linear
schedule without warm-up, the same seed; its batches padded to their own longest pair. pairs/s is
optimizer steps x batch / training seconds (ours: `train_samples_per_s`, compilations included;
TRL: `train_runtime`); the eval columns are each trainer's own evaluation of the held-out
pairs at the end (TRL: `trainer.evaluate()`, a mean over batches of 16, the same as a mean over
pairs where --eval-pairs is a multiple of 16; ours: every pair once).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def task(folder, eval_pairs):
    """The model and pairs (tests/test_dpo.py's; `eval_pairs` held-out pairs)."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import tiny_decoders as td
    from test_dpo import pairs

    folder.mkdir(parents=True, exist_ok=True)
    return {"model": str(td.save("llama", folder / "llama", chat=True, letters=True)),
            "train": str(td.write_jsonl(folder / "train.jsonl", pairs(2000, 1))),
            "validation": str(td.write_jsonl(folder / "validation.jsonl", pairs(eval_pairs, 2)))}


def ours(backend, data, args, seed, out):
    metrics = out / f"ours-{backend}-{seed}.json"
    cmd = [sys.executable, "-m", "xla_train", "train", "--backend", backend, "--problem", "dpo", "--model",
           data["model"], "--train-file", data["train"], "--validation-file", data["validation"], "--max-length", "32",
           "--buckets", "32", "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--beta", str(args.beta),
           "--max-steps", str(args.max_steps), "--seed", str(seed), "--log-every", "50", "--metrics-out", str(metrics)]
    env = {"PJRT_DEVICE": "CPU"} if backend == "xla" else {"USE_TORCH_XLA": "0"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **ENV, **env})
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    m = json.loads(metrics.read_text())
    xla = m.get("xla") or {}
    return {"pairs_per_s": m["train_samples_per_s"], "steady_pairs_per_s": m["steady_samples_per_s"],
            "train_seconds": m["train_seconds"], "wall_seconds": round(wall, 1),
            "eval_accuracy": m["eval"]["rewards/accuracies"], "eval_margins": m["eval"]["rewards/margins"],
            "eval_loss": m["eval"]["loss"], "compiles": xla.get("compiles"),
            "compiles_after_first_epoch": xla.get("compiles_after_first_epoch"),
            "host_syncs_per_step": xla.get("host_syncs_per_step"), "aten_fallbacks": xla.get("aten_fallbacks")}


def trl(backend, data, args, seed, out):
    spec = {**data, "steps": args.max_steps, "batch": args.batch_size, "lr": args.lr, "beta": args.beta,
            "seed": seed, "out": str(out / f"trl-{backend}-{seed}"), "result": str(out / f"trl-{backend}-{seed}.json")}
    env = {"PJRT_DEVICE": "CPU"} if backend == "xla" else {"USE_TORCH_XLA": "0"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **ENV, **env}, timeout=args.trl_timeout)
    wall = time.perf_counter() - start
    if proc.returncode:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}"}
    return {**json.loads(Path(spec["result"]).read_text()), "wall_seconds": round(wall, 1)}


def trl_worker(spec):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    s = spec
    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    train = datasets.load_dataset("json", data_files=s["train"], split="train")
    validation = datasets.load_dataset("json", data_files=s["validation"], split="train")
    config = DPOConfig(output_dir=s["out"], per_device_train_batch_size=s["batch"], per_device_eval_batch_size=16,
                       max_steps=s["steps"], learning_rate=s["lr"], beta=s["beta"], lr_scheduler_type="linear",
                       warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, bf16=False, gradient_checkpointing=False,
                       max_length=16, logging_steps=50, save_strategy="no", report_to="none", seed=s["seed"],
                       data_seed=s["seed"], disable_tqdm=True, optim="adamw_torch", dataloader_drop_last=True)
    trainer = DPOTrainer(model=model, args=config, train_dataset=train, eval_dataset=validation,
                         processing_class=tokenizer)
    result = trainer.train()
    metrics = trainer.evaluate()
    runtime = result.metrics["train_runtime"]
    Path(s["result"]).write_text(json.dumps({
        "pairs_per_s": round(s["steps"] * s["batch"] / runtime, 3), "train_seconds": round(runtime, 3),
        "eval_accuracy": metrics["eval_rewards/accuracies"], "eval_margins": metrics["eval_rewards/margins"],
        "eval_loss": metrics["eval_loss"]}))


CASES = {"cpu": ("cpu", ours), "xla": ("xla", ours), "trl-cpu": ("cpu", trl), "trl-xla": ("xla", trl)}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return trl_worker(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="cpu,xla,trl-cpu", help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seeds", default="42")
    p.add_argument("--eval-pairs", type=int, default=512, help="held-out pairs (one is 1/N of the accuracy)")
    p.add_argument("--trl-timeout", type=int, default=3600)
    p.add_argument("--out", default=str(OUT / "dpo.json"))
    args = p.parse_args()
    work = OUT / "dpo"
    data = task(work / f"task-{args.eval_pairs}", args.eval_pairs)
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        for case in args.cases.split(","):
            backend, fn = CASES[case]
            try:
                result = fn(backend, data, args, seed, work)
            except subprocess.TimeoutExpired:
                result = {"error": f"timed out after {args.trl_timeout} s"}
            rows.append({"case": case, "seed": seed, **result})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'case':8} {'seed':>4} {'pairs/s':>8} {'train s':>8} {'wall s':>7} {'eval acc':>8} {'margins':>8} "
          f"{'compiles':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:8} {r['seed']:>4} error: {r['error']}")
            continue
        print(f"{r['case']:8} {r['seed']:>4} {r['pairs_per_s']:>8.1f} {r['train_seconds']:>8.1f} "
              f"{r['wall_seconds']:>7.1f} {r['eval_accuracy']:>8.3f} {r['eval_margins']:>8.3f} "
              f"{r.get('compiles') if r.get('compiles') is not None else '-':>8}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows},
                                         indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
