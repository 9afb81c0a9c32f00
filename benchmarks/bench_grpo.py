"""`--problem grpo` against TRL 1.16's `GRPOTrainer` (transformers' `generate`, as it runs without
vLLM) on the same model, prompts, reward function, completions per prompt, completion length,
batch, learning rate and steps, on the CPU and on XLA:CPU, all runs in this one command; the table
goes to the console and benchmarks/out/grpo.json.

    python benchmarks/bench_grpo.py                        # 300 steps: ours cpu, xla; trl cpu
    python benchmarks/bench_grpo.py --max-steps 20         # a quick check
    python benchmarks/bench_grpo.py --cases cpu,trl-cpu --seeds 42,1,2

The task (tests/test_grpo.py's): a 2-layer, 64-wide Llama over the reversal task's 17 words, first
taught part of the task by this package's SFT (--sft-steps steps of `reverse c a b =` -> `b a c`
rows), then trained by each trainer from that same folder on 400 prompts with a partial-credit
reward (benchmarks/grpo_rewards.py: the share of the reversed letters in place). Both sample at
--temperature (0.7: at TRL's default of 1 this tiny model's samples are mostly noise, and neither
trainer raises its greedy reward much) with no top-p or top-k, DAPO's loss (TRL's default), beta 0,
one update per rollout, fp32, no clipping, the linear schedule without warm-up.

completions/s is optimizer steps x batch (completions) / training seconds (ours: the training
phase, compilations included; TRL: `train_runtime`). The eval reward is one measurement for every
trainer: each final model completes the --eval-prompts held-out prompts greedily with
transformers' `generate` in this process and the reward function scores them; `before` is the
SFT model's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
REWARD = ROOT / "benchmarks" / "grpo_rewards.py"


def task(folder, args):
    """The SFT model and the prompts (tests/test_grpo.py's task)."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import tiny_decoders as td
    from test_grpo import prompts

    folder.mkdir(parents=True, exist_ok=True)
    data = {"train": str(td.write_jsonl(folder / "train.jsonl", prompts(400, 1))),
            "validation": str(td.write_jsonl(folder / "validation.jsonl", prompts(args.eval_prompts, 2))),
            "model": str(folder / "sft")}
    if not (folder / "sft" / "config.json").is_file():
        base = td.save("llama", folder / "llama", chat=True, letters=True)
        sft = td.write_jsonl(folder / "sft.jsonl", td.reverse_rows(2000, 3))
        run([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--problem", "causal-lm", "--model",
             str(base), "--train-file", str(sft), "--max-steps", str(args.sft_steps), "--batch-size", "16", "--lr",
             "3e-3", "--max-length", "64", "--output-dir", data["model"], "--overwrite", "--no-data-cache"], {})
    return data


def run(cmd, env, timeout=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **ENV, **env},
                          timeout=timeout, check=False)


def failed(proc):
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}"}


def ours(backend, data, args, seed, out):
    folder, metrics = out / f"ours-{backend}-{seed}", out / f"ours-{backend}-{seed}.json"
    cmd = [sys.executable, "-m", "xla_train", "train", "--backend", backend, "--problem", "grpo", "--model",
           data["model"], "--train-file", data["train"], "--validation-file", data["validation"], "--reward",
           f"{REWARD}:reversed_letters", "--num-generations", str(args.num_generations), "--batch-size",
           str(args.batch_size), "--max-completion-length", str(args.max_completion_length), "--max-length", "16",
           "--lr", str(args.lr), "--max-steps", str(args.max_steps), "--seed", str(seed), "--log-every", "50",
           "--temperature", str(args.temperature),
           "--output-dir", str(folder), "--overwrite", "--metrics-out", str(metrics), "--no-data-cache"]
    start = time.perf_counter()
    proc = run(cmd, {"PJRT_DEVICE": "CPU"} if backend == "xla" else {"USE_TORCH_XLA": "0"})
    wall = time.perf_counter() - start
    if proc.returncode:
        return failed(proc)
    m = json.loads(metrics.read_text())
    xla = m.get("xla") or {}
    return {"completions_per_s": round(args.max_steps * args.batch_size / m["train_seconds"], 2),
            "train_seconds": m["train_seconds"], "wall_seconds": round(wall, 1), "own_eval_reward": m["eval"]["reward"],
            "compiles": xla.get("compiles"), "host_syncs_per_step": xla.get("host_syncs_per_step"),
            "aten_fallbacks": xla.get("aten_fallbacks"), "folder": str(folder)}


def trl(backend, data, args, seed, out):
    spec = {**data, **vars(args), "seed": seed, "reward": str(REWARD), "out": str(out / f"trl-{backend}-{seed}"),
            "result": str(out / f"trl-{backend}-{seed}.json")}
    start = time.perf_counter()
    proc = run([sys.executable, __file__, "--trl-worker", json.dumps(spec)],
               {"PJRT_DEVICE": "CPU"} if backend == "xla" else {"USE_TORCH_XLA": "0"}, args.trl_timeout)
    wall = time.perf_counter() - start
    if proc.returncode:
        return failed(proc)
    return {**json.loads(Path(spec["result"]).read_text()), "wall_seconds": round(wall, 1), "folder": spec["out"]}


def trl_worker(s):
    import importlib.util

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    loader = importlib.util.spec_from_file_location("grpo_rewards", s["reward"])
    rewards = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(rewards)
    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    train = datasets.load_dataset("json", data_files=s["train"], split="train")
    config = GRPOConfig(output_dir=s["out"], per_device_train_batch_size=s["batch_size"],
                        num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                        max_steps=s["max_steps"], learning_rate=s["lr"], lr_scheduler_type="linear", warmup_steps=0,
                        weight_decay=0.0, max_grad_norm=0.0, bf16=False, temperature=s["temperature"], top_p=1.0,
                        top_k=0, beta=0.0, logging_steps=50, save_strategy="no", report_to="none", seed=s["seed"],
                        data_seed=s["seed"], disable_tqdm=True, optim="adamw_torch")
    trainer = GRPOTrainer(model=model, reward_funcs=rewards.reversed_letters, args=config, train_dataset=train,
                          processing_class=tokenizer)
    result = trainer.train()
    trainer.save_model(s["out"])
    runtime = result.metrics["train_runtime"]
    Path(s["result"]).write_text(json.dumps({
        "completions_per_s": round(s["max_steps"] * s["batch_size"] / runtime, 2), "train_seconds": round(runtime, 3)}))


def greedy_reward(folder, validation, max_new_tokens):
    """The mean reward of `folder`'s greedy completions of the validation prompts (one measurement
    for every trainer: transformers' generate, left-padded batches of 32)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loader = importlib.util.spec_from_file_location("grpo_rewards", REWARD)
    rewards = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(rewards)
    rows = [json.loads(line) for line in Path(validation).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    for i in range(0, len(rows), 32):
        part = rows[i:i + 32]
        enc = tokenizer([r["prompt"] for r in part], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                                 pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores += rewards.reversed_letters(texts, [r["answer"] for r in part])
    return round(statistics.fmean(scores), 4)


CASES = {"cpu": ("cpu", ours), "xla": ("xla", ours), "trl-cpu": ("cpu", trl), "trl-xla": ("xla", trl)}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return trl_worker(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="cpu,xla,trl-cpu", help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="completions per step")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--seeds", default="42")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--trl-timeout", type=int, default=3600)
    p.add_argument("--out", default=str(OUT / "grpo.json"))
    args = p.parse_args()
    work = OUT / "grpo"
    data = task(work / f"task-{args.sft_steps}-{args.eval_prompts}", args)
    before = greedy_reward(data["model"], data["validation"], args.max_completion_length)
    print(f"before: eval reward {before} (the SFT model, greedy, {args.eval_prompts} prompts)")
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        for case in args.cases.split(","):
            backend, fn = CASES[case]
            result = fn(backend, data, args, seed, work)
            if "folder" in result:
                result["eval_reward"] = greedy_reward(result.pop("folder"), data["validation"],
                                                      args.max_completion_length)
            rows.append({"case": case, "seed": seed, **result})
            print(json.dumps(rows[-1]))
    summary = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        done = [r for r in rows if r["case"] == case and "eval_reward" in r]
        if done:
            summary[case] = {"eval_reward_mean": round(statistics.fmean(r["eval_reward"] for r in done), 4),
                             "completions_per_s_mean": round(statistics.fmean(r["completions_per_s"] for r in done), 2)}
    result = {"date": time.strftime("%Y-%m-%d"), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "eval_reward_before": before, "runs": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
