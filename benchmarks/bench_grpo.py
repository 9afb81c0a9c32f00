"""`--problem grpo` against TRL 1.16's `GRPOTrainer` (transformers' `generate`, as it runs without
vLLM) on the same model, prompts, reward function, completions per prompt, completion length,
batch, learning rate and steps, on the CPU and on XLA:CPU, all runs in this one command; the table
goes to the console and benchmarks/out/grpo.json (grpo-tools.json for --task tools).

    python benchmarks/bench_grpo.py                        # reversal, 300 steps: ours cpu, xla; trl cpu
    python benchmarks/bench_grpo.py --max-steps 20         # a quick check
    python benchmarks/bench_grpo.py --cases cpu,trl-cpu --seeds 42,1,2
    python benchmarks/bench_grpo.py --task tools           # the tool task, with and without the tool
    python benchmarks/bench_grpo.py --task tools --cases cpu-tools,trl-cpu-tools --max-steps 5

`--task reversal` (tests/test_grpo.py's): a 2-layer, 64-wide Llama over the reversal task's 17 words,
first taught part of the task by this package's SFT (--sft-steps steps of `reverse c a b =` ->
`b a c` rows), then trained by each trainer from that same folder on 400 prompts with a
partial-credit reward (benchmarks/grpo_rewards.py: the share of the reversed letters in place).
Both sample at --temperature (0.7: at TRL's default of 1 this tiny model's samples are mostly
noise, and neither trainer raises its greedy reward much) with no top-p or top-k, DAPO's loss
(TRL's default), beta 0, one update per rollout, fp32, no clipping, the linear schedule without
warm-up.

`--task tools` (tests/tool_task.py: multiply two two-digit numbers with `multiply`, then say the
product): a 2-layer, 128-wide Qwen2-shaped decoder with tests/tool_machine.py's chat template and
response template (its byte-level merges learnt from the task's traces), taught tool calling by
this package's SFT on 2,000 traces (--tool-sft-epochs epochs, batch 16, lr 3e-3), then trained by
each trainer on 400 chat prompts with `xla_train.rewards:number_match` (the final turn's last
number is the product), --max-completion-length tokens after the prompt with the tools' results
included (as TRL 1.16's `_tool_call_loop` counts them) and --max-tool-calling-iterations. Cases
ending in `-tools` run with the tool (ours `--tools tests/tool_task.py:multiply`, TRL's
`tools=[multiply]`); the others on the same prompts without it (the plain rollout; the model's
calls are then text and its reward stays near 0). Reported besides: `tools/call_frequency` and
`tools/failure_frequency` (the mean over the runs' log points), and on XLA:CPU the graphs
compiled and host transfers a step.

completions/s is optimizer steps x batch (completions) / training seconds (ours: the training
phase, compilations included; TRL: `train_runtime`). The eval reward is one measurement for every
trainer: each final model completes the --eval-prompts held-out prompts greedily with
transformers' `generate` in this process and the reward function scores them (`--task tools`:
with the tool loop, `tool_reward`); `before` is the SFT model's.
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
TOOL = ROOT / "tests" / "tool_task.py"
# each task's settings where the command line leaves them unset (None)
DEFAULTS = {"reversal": {"cases": "cpu,xla,trl-cpu", "max_steps": 300, "batch_size": 32, "num_generations": 8,
                         "max_completion_length": 8, "lr": 2e-4, "eval_prompts": 256},
            "tools": {"cases": "cpu-tools,trl-cpu-tools,cpu,trl-cpu,xla-tools", "max_steps": 30, "batch_size": 16,
                      "num_generations": 4, "max_completion_length": 96, "lr": 5e-5, "eval_prompts": 64}}


def sys_paths():
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def reversal_task(folder, args):
    """The SFT model and the prompts (tests/test_grpo.py's task)."""
    sys_paths()
    import tiny_decoders as td
    from test_grpo import prompts

    folder.mkdir(parents=True, exist_ok=True)
    data = {"train": str(td.write_jsonl(folder / "train.jsonl", prompts(400, 1))),
            "validation": str(td.write_jsonl(folder / "validation.jsonl", prompts(args.eval_prompts, 2))),
            "model": str(folder / "sft"), "reward": f"{REWARD}:reversed_letters", "max_length": 16}
    if not (folder / "sft" / "config.json").is_file():
        base = td.save("llama", folder / "llama", chat=True, letters=True)
        sft = td.write_jsonl(folder / "sft.jsonl", td.reverse_rows(2000, 3))
        sft_run(base, sft, data["model"], ["--max-steps", str(args.sft_steps), "--max-length", "64"])
    return data


def tool_model(path):
    """The tool task's base: a random 2-layer, 128-wide Qwen2 with tests/tool_machine.py's chat and
    response templates over a Qwen2-kind tokenizer whose merges are learnt from the task's traces
    (a trace is then about a third of its byte-level length); a generation config with its token
    ids only (no sampling settings for transformers' `generate` to take over)."""
    import tiny_decoders as td
    import tool_machine as tm
    import tool_task
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    render = td.family_tokenizer("qwen2")
    render.chat_template = tm.TOOL_TEMPLATE
    traces = [render.apply_chat_template(r["messages"], tools=json.loads(r["tools"]), tokenize=False)
              for r in tool_task.tool_rows(64, 100)]
    tok = td.family_tokenizer("qwen2", traces)
    tok.chat_template, tok.response_template = tm.TOOL_TEMPLATE, tm.RESPONSE_TEMPLATE
    torch.manual_seed(0)
    ids = tok.get_vocab()
    model = AutoModelForCausalLM.from_config(td.config("qwen2", len(tok), size=128, token_ids=ids))
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                                               eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tool_task(folder, args):
    """The tool task's SFT-taught model and its GRPO prompts (tests/tool_task.py)."""
    sys_paths()
    import tiny_decoders as td
    import tool_task as tt

    folder.mkdir(parents=True, exist_ok=True)
    held_out = tt.tool_rows(args.eval_prompts, 2, "prompts")
    data = {"train": str(td.write_jsonl(folder / "train.jsonl", tt.tool_rows(400, 1, "prompts"))),
            "validation": str(td.write_jsonl(folder / "validation.jsonl", held_out)),
            "model": str(folder / "sft"), "reward": "xla_train.rewards:number_match", "max_length": 64}
    if not (folder / "sft" / "config.json").is_file():
        base = tool_model(folder / "qwen2")
        sft = td.write_jsonl(folder / "traces.jsonl", tt.tool_rows(2000, 3))
        sft_run(base, sft, data["model"], ["--epochs", str(args.tool_sft_epochs), "--max-length", "256",
                                           "--warmup-ratio", "0.05"])
    return data


def sft_run(base, train, output, extra):
    """This package's SFT (causal LM) of `base` on `train` into `output`: batch 16, lr 3e-3."""
    proc = run([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--problem", "causal-lm", "--model",
                str(base), "--train-file", str(train), "--batch-size", "16", "--lr", "3e-3", *extra,
                "--output-dir", str(output), "--overwrite", "--no-data-cache"], {})
    if proc.returncode:
        sys.exit(f"the SFT run failed: {failed(proc)['error']}")


def run(cmd, env, timeout=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **ENV, **env},
                          timeout=timeout, check=False)


def failed(proc):
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}"}


def log_every(args):
    return str(max(1, args.max_steps // 6))


def tool_means(points):
    """The mean of each tool metric over a run's log points (None where the run logged none)."""
    return {k.split("/")[1]: round(statistics.fmean(v), 4) if (v := [p[k] for p in points if k in p]) else None
            for k in ("tools/call_frequency", "tools/failure_frequency")}


def ours(case, data, args, seed, out):
    backend, tools = case["backend"], case["tools"]
    name = f"ours-{case['name']}-{seed}"
    folder, metrics = out / name, out / f"{name}.json"
    cmd = [sys.executable, "-m", "xla_train", "train", "--backend", backend, "--problem", "grpo", "--model",
           data["model"], "--train-file", data["train"], "--validation-file", data["validation"], "--reward",
           data["reward"], "--num-generations", str(args.num_generations), "--batch-size",
           str(args.batch_size), "--max-completion-length", str(args.max_completion_length), "--max-length",
           str(data["max_length"]), "--lr", str(args.lr), "--max-steps", str(args.max_steps), "--seed", str(seed),
           "--log-every", log_every(args), "--temperature", str(args.temperature),
           "--output-dir", str(folder), "--overwrite", "--metrics-out", str(metrics), "--no-data-cache"]
    if tools:
        cmd += ["--tools", f"{TOOL}:multiply", "--max-tool-calling-iterations", str(args.max_tool_calling_iterations)]
    start = time.perf_counter()
    proc = run(cmd, {"PJRT_DEVICE": "CPU"} if backend == "xla" else {"USE_TORCH_XLA": "0"})
    wall = time.perf_counter() - start
    if proc.returncode:
        return failed(proc)
    m = json.loads(metrics.read_text())
    xla = m.get("xla") or {}
    result = {"completions_per_s": round(args.max_steps * args.batch_size / m["train_seconds"], 2),
              "train_seconds": m["train_seconds"], "wall_seconds": round(wall, 1),
              "own_eval_reward": m["eval"]["reward"], "folder": str(folder)}
    if tools:
        result.update(tool_means([point for _, point in m["train_metrics"]]))
    if backend == "xla":
        result.update({k: xla.get(k) for k in ("compiles", "compiles_after_first_epoch", "compile_seconds",
                                               "host_syncs_per_step", "aten_fallbacks")})
    return result


def trl(case, data, args, seed, out):
    name = f"{case['name']}-{seed}"  # trl-...
    spec = {**data, **vars(args), "seed": seed, "out": str(out / name), "result": str(out / f"{name}.json"),
            "tools": case["tools"], "log_every": int(log_every(args))}
    start = time.perf_counter()
    proc = run([sys.executable, __file__, "--trl-worker", json.dumps(spec)],
               {"PJRT_DEVICE": "CPU"} if case["backend"] == "xla" else {"USE_TORCH_XLA": "0"}, args.trl_timeout)
    wall = time.perf_counter() - start
    if proc.returncode:
        return failed(proc)
    return {**json.loads(Path(spec["result"]).read_text()), "wall_seconds": round(wall, 1), "folder": spec["out"]}


def reward_function(spec):
    """The task's reward function: module:function or path/file.py:function."""
    import importlib
    import importlib.util

    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        loader = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def trl_worker(s):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys_paths()
    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    train = datasets.load_dataset("json", data_files=s["train"], split="train")
    tools = {}
    if s["tools"]:
        tools = {"tools": [reward_function(f"{TOOL}:multiply")]}
        if s["max_tool_calling_iterations"] is not None:
            tools["max_tool_calling_iterations"] = s["max_tool_calling_iterations"]
    config = GRPOConfig(output_dir=s["out"], per_device_train_batch_size=s["batch_size"],
                        num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                        max_steps=s["max_steps"], learning_rate=s["lr"], lr_scheduler_type="linear", warmup_steps=0,
                        weight_decay=0.0, max_grad_norm=0.0, bf16=False, temperature=s["temperature"], top_p=1.0,
                        top_k=0, beta=0.0, logging_steps=s["log_every"], save_strategy="no", report_to="none",
                        seed=s["seed"], data_seed=s["seed"], disable_tqdm=True, optim="adamw_torch",
                        **{k: v for k, v in tools.items() if k != "tools"})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_function(s["reward"]), args=config, train_dataset=train,
                          processing_class=tokenizer, **{k: v for k, v in tools.items() if k == "tools"})
    result = trainer.train()
    trainer.save_model(s["out"])
    runtime = result.metrics["train_runtime"]
    out = {"completions_per_s": round(s["max_steps"] * s["batch_size"] / runtime, 2),
           "train_seconds": round(runtime, 3)}
    if s["tools"]:
        out.update(tool_means(trainer.state.log_history))
    Path(s["result"]).write_text(json.dumps(out))


def loaded(folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy(model, tokenizer, prompts, max_new_tokens):
    """transformers' `generate`, greedy, on left-padded token lists, with these settings only;
    each row's new tokens up to and with its first end-of-sequence token."""
    import torch
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                              pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def greedy_reward(folder, validation, max_new_tokens):
    """The mean reward of `folder`'s greedy completions of the reversal task's validation prompts
    (one measurement for every trainer: transformers' generate, left-padded batches of 32)."""
    rewards = reward_function(f"{REWARD}:reversed_letters")
    rows = [json.loads(line) for line in Path(validation).read_text().splitlines()]
    tokenizer, model = loaded(folder)
    scores = []
    for i in range(0, len(rows), 32):
        part = rows[i:i + 32]
        done = greedy(model, tokenizer, [tokenizer(r["prompt"])["input_ids"] for r in part], max_new_tokens)
        texts = tokenizer.batch_decode(done, skip_special_tokens=True)
        scores += rewards(texts, [r["answer"] for r in part])
    return round(statistics.fmean(scores), 4)


def tool_reward(folder, validation, budget, iterations):
    """The mean `number_match` of `folder`'s greedy completions of the tool task's validation
    prompts with the tool loop, one measurement for every trainer: transformers' `generate` on
    batches of 32 rendered with the tool, each turn parsed, its calls run and their results
    appended as the template's tool turn (the package's tasks/tools.py `parse`, `Calls`,
    `suffix_ids`: TRL's parse_response, tool running and _get_tool_suffix_ids), then generated
    again, up to `iterations` tool turns within `budget` tokens after the prompt (TRL's rule: a
    result that would not fit ends the row). Returns (reward, calls per completion)."""
    from xla_train.rewards import number_match
    from xla_train.tasks.tools import Calls, Toolbox, parse, suffix_ids

    box = Toolbox((f"{TOOL}:multiply",))
    rows = [json.loads(line) for line in Path(validation).read_text().splitlines()]
    tokenizer, model = loaded(folder)
    scores, calls = [], Calls()
    for i in range(0, len(rows), 32):
        part = rows[i:i + 32]
        prompts = [tokenizer.apply_chat_template(r["prompt"], tools=box.schemas, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for r in part]
        rows_so_far = [list(p) for p in prompts]
        completions = [[] for _ in part]
        active, taken = list(range(len(part))), 0
        while active:
            left = {r: budget - (len(rows_so_far[r]) - len(prompts[r])) for r in active}
            if max(left.values()) <= 0:  # the results took the last of the budget
                break
            made = greedy(model, tokenizer, [rows_so_far[r] for r in active], max(left.values()))
            following = []
            for r, turn_ids in zip(active, made):
                turn_ids = turn_ids[:left[r]]
                if not turn_ids:
                    continue
                turn = parse(tokenizer, turn_ids, rows_so_far[r], box.schemas)
                completions[r].append(turn)
                rows_so_far[r] += turn_ids
                if not turn.get("tool_calls") or taken >= iterations:
                    continue
                results = calls.run(turn["tool_calls"], box.functions)
                suffix = suffix_ids(tokenizer, results)
                if len(rows_so_far[r]) - len(prompts[r]) + len(suffix) > budget:
                    continue
                completions[r] += results
                rows_so_far[r] += suffix
                following.append(r)
            active, taken = following, taken + 1
        scores += number_match(completions, [r["answer"] for r in part])
    return round(statistics.fmean(scores), 4), round(calls.made / len(rows), 4)


def evaluate(task, folder, data, args):
    if task == "reversal":
        return {"eval_reward": greedy_reward(folder, data["validation"], args.max_completion_length)}
    reward, calls = tool_reward(folder, data["validation"], args.max_completion_length,
                                args.max_tool_calling_iterations)
    return {"eval_reward": reward, "eval_call_frequency": calls}


def case_of(name, task):
    """A case's name, e.g. trl-cpu-tools: the trainer (ours, or trl-), the backend, with the tool."""
    trainer, rest = (trl, name[4:]) if name.startswith("trl-") else (ours, name)
    backend, tools = rest.removesuffix("-tools"), rest.endswith("-tools")
    if backend not in ("cpu", "xla") or (tools and task != "tools"):
        sys.exit(f"unknown case {name} for --task {task}: [trl-]cpu|xla[-tools] (-tools with --task tools)")
    return {"name": name, "backend": backend, "tools": tools, "run": trainer}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return trl_worker(json.loads(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="reversal", choices=sorted(DEFAULTS))
    p.add_argument("--cases", help="comma-separated: [trl-]cpu|xla[-tools] (reversal: cpu,xla,trl-cpu; tools: "
                   "cpu-tools,trl-cpu-tools,cpu,trl-cpu,xla-tools)")
    p.add_argument("--max-steps", type=int, help="reversal 300, tools 30")
    p.add_argument("--batch-size", type=int, help="completions per step (reversal 32, tools 16)")
    p.add_argument("--num-generations", type=int, help="reversal 8, tools 4")
    p.add_argument("--max-completion-length", type=int, help="reversal 8, tools 96 (tool results included)")
    p.add_argument("--max-tool-calling-iterations", type=int, default=1)
    p.add_argument("--lr", type=float, help="reversal 2e-4, tools 5e-5")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--sft-steps", type=int, default=120, help="the reversal task's SFT")
    p.add_argument("--tool-sft-epochs", type=int, default=3, help="the tool task's SFT on 2,000 traces")
    p.add_argument("--seeds", default="42")
    p.add_argument("--eval-prompts", type=int, help="reversal 256, tools 64")
    p.add_argument("--trl-timeout", type=int, default=3600)
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run, both trainers (default: torch's "
                   "own, the cores); 1 steadies the figures on a machine others share")
    p.add_argument("--out", help="default benchmarks/out/grpo.json (reversal), grpo-tools.json (tools)")
    args = p.parse_args()
    for k, v in DEFAULTS[args.task].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.threads:
        ENV["OMP_NUM_THREADS"] = str(args.threads)
        import torch

        torch.set_num_threads(args.threads)  # the evaluations in this process
    out = Path(args.out or OUT / ("grpo.json" if args.task == "reversal" else "grpo-tools.json"))
    cases = [case_of(c, args.task) for c in args.cases.split(",")]
    work = OUT / "grpo"
    if args.task == "reversal":
        data = reversal_task(work / f"task-{args.sft_steps}-{args.eval_prompts}", args)
    else:
        data = tool_task(work / f"tools-{args.tool_sft_epochs}-{args.eval_prompts}", args)
    before = evaluate(args.task, data["model"], data, args)
    print(f"before: {before} (the SFT model, greedy, {args.eval_prompts} prompts)")
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        for case in cases:
            result = case["run"](case, data, args, seed, work)
            if "folder" in result:
                result.update(evaluate(args.task, result.pop("folder"), data, args))
            rows.append({"case": case["name"], "seed": seed, **result})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        done = [r for r in rows if r["case"] == case and "eval_reward" in r]
        if done:
            summary[case] = {"eval_reward_mean": round(statistics.fmean(r["eval_reward"] for r in done), 4),
                             "completions_per_s_mean": round(statistics.fmean(r["completions_per_s"] for r in done), 2)}
    result = {"date": time.strftime("%Y-%m-%d"), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "eval_before": before, "runs": rows, "summary": summary}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
