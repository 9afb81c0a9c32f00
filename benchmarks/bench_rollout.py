"""GRPO's rollout on the CPU or XLA:CPU, its generation alone, in one process: each batch of prompts
rolled out in turn by every variant, so that a machine whose speed drifts (a shared one) moves them alike.

    python benchmarks/bench_rollout.py                  # 300 rollouts of 32 completions (4 prompts x 8)
    python benchmarks/bench_rollout.py --rollouts 100 --threads 1
    python benchmarks/bench_rollout.py --backend xla    # XLA:CPU: per-row and shared
    python benchmarks/bench_rollout.py --backend xla --devices 4 --width 256   # SPMD over 4 XLA:CPU devices

The model and prompts are bench_grpo.py's reversal task (its SFT model, trained there once and
reused), rolled out as `--problem grpo` rolls them out on the CPU (kernels/generate.py
`static_generate`: each token's log-probability kept, stopped once every row has ended) at
temperature 0.7, 8 completions of up to 8 tokens a prompt, the prompts left-padded to a multiple of
8 tokens (the run's bucket). The variants:

    per-row      every row makes its own prompt pass, without gradients (torch.no_grad)
    shared       a group's prompt passes once (`group`: kernels/generate.py `prefill`)
    shared+inf   that, in inference mode (tasks/grpo.py `Rollouts.generating`): what GRPO runs in one
                 process over a base in full precision
    generate     (the CPU) transformers' `generate` under torch.no_grad() with the same settings
                 (kernels/generate.py `eager_generate`): TRL 1.16's rollout without vLLM
                 (GRPOTrainer._generate_single_turn's "regular generation path"); it draws its own
                 tokens, so it is left out of the check below

With `--backend xla` the model runs on XLA:CPU as `--backend xla` prepares it (XlaAccelerator), each
token's graph cut (`torch_xla.sync`), every row taking all the tokens (XLA's fixed count), the
tokens copied to the host at the end (in the time): per-row and shared only (inference mode is
eager autograd's). Each variant's graphs compile in the first rollouts of each prompt width,
which the median leaves out. `--devices N`: SPMD over N XLA:CPU devices (they share this
machine's cores), the rows split over them as `--strategy spmd` splits a batch's and a group's
copies laid out the same way (Strategy.split_rows).

`--compile` (the CPU): besides, one of the rollout's one-token calls (transformers' forward into
its static cache) timed eagerly and under `torch.compile(dynamic=False)`, the route to a faster
decode step that is not built: the compilation's seconds, again for the next rollout's cache (a
new object), each call's milliseconds, and the rollouts a run would need before the compilation
paid for itself (each saving the decode calls' difference).

Every variant draws from the same seed each rollout, and their tokens (generate's apart) are
checked equal. Reports the median and the fastest milliseconds a rollout, and each variant's speed
against per-row's and, on the CPU, against generate's (the ratios of the medians); writes
benchmarks/out/rollout.json (rollout-xla.json for XLA).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

# name: (a group's rows a prompt pass, inference mode, the generator)
VARIANTS = {"per-row": (1, False, "static"), "shared": (None, False, "static"), "shared+inf": (None, True, "static"),
            "generate": (1, False, "generate")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="completions a rollout")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own, the cores)")
    p.add_argument("--backend", choices=("cpu", "xla"), default="cpu")
    p.add_argument("--devices", type=int, default=1, help="with --backend xla: SPMD over this many XLA:CPU devices")
    p.add_argument("--compile", action="store_true", help="the CPU: also a one-token call eager and compiled")
    p.add_argument("--width", type=int, default=0, help="left-pad every prompt to this many tokens (the length "
                   "bucket of longer prompts: the prompt's pass costs as much); default: a multiple of 8")
    args = p.parse_args()
    if args.compile and args.backend == "xla":
        p.error("--compile times the CPU's one-token call; XLA compiles its own graphs")

    import bench_grpo
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.kernels.generate import Sampling, eager_generate, static_generate
    from xla_train.tasks.grpo import left_pad

    if args.threads:
        torch.set_num_threads(args.threads)
    task = argparse.Namespace(sft_steps=120, eval_prompts=256)
    data = bench_grpo.reversal_task(bench_grpo.OUT / "grpo" / "task-120-256", task)
    model = AutoModelForCausalLM.from_pretrained(data["model"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    xla = args.backend == "xla"
    variants = {k: v for k, v in VARIANTS.items() if not (xla and (v[1] or v[2] == "generate"))}  # eager's
    split = None
    if xla:
        os.environ["CPU_NUM_DEVICES"] = str(args.devices)  # before torch_xla starts its runtime
        import torch_xla
        import torch_xla.core.xla_model as xm

        from xla_train.core.xla import XlaAccelerator
        from xla_train.parallel.xla_strategies import XlaSpmd

        if args.devices > 1:
            strategy = XlaSpmd(XlaAccelerator())
            strategy.setup()
            split = strategy.split_rows
        device, cut, seed = torch_xla.device(), torch_xla.sync, xm.set_rng_state
        model = XlaAccelerator().adapt_model(model).to(device)
    else:
        device, cut, seed = torch.device("cpu"), (lambda: None), torch.manual_seed
    texts = [json.loads(line)["prompt"] for line in Path(data["train"]).read_text().splitlines()]
    group = args.num_generations
    sampling = Sampling(args.max_completion_length, (tokenizer.eos_token_id,), tokenizer.pad_token_id, 0.7)
    per_batch = args.batch_size // group
    times: dict[str, list[float]] = {name: [] for name in variants}
    for n in range(args.rollouts):
        chosen = [texts[(n * per_batch + i) % len(texts)] for i in range(per_batch)]
        prompts = [tokenizer(t)["input_ids"] for t in chosen]
        width = args.width or -(-max(map(len, prompts)) // 8) * 8  # the run's length bucket (8 here)
        ids, mask = left_pad(prompts, width, tokenizer.pad_token_id)
        ids, mask = (x.repeat_interleave(group, 0).to(device) for x in (ids, mask))
        if split is not None:
            ids, mask = split(ids), split(mask)
        tokens = {}
        for name, (shared, inference, generator) in variants.items():
            seed(n)
            start = time.perf_counter()
            with torch.inference_mode() if inference else torch.no_grad():
                if generator == "generate":  # its own draws: not compared
                    eager_generate(model, ids, mask, sampling).cpu()
                else:
                    made, _ = static_generate(model, ids, mask, sampling, cut, logps=True, stop_when_done=not xla,
                                              group=shared or group, split_rows=split)
                    tokens[name] = made.cpu()
            times[name].append(time.perf_counter() - start)
        first = tokens["per-row"]
        assert all(torch.equal(first, t) for t in tokens.values()), "the variants drew other tokens"
    skip = min(10, args.rollouts // 10)  # warm-up
    medians = {k: statistics.median(v[skip:]) for k, v in times.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "settings": vars(args), "threads": torch.get_num_threads(),
              "variants": {k: {"median_ms": round(medians[k] * 1000, 2), "fastest_ms": round(min(v) * 1000, 2),
                               "speed_vs_per_row": round(medians["per-row"] / medians[k], 3),
                               **({"speed_vs_generate": round(medians["generate"] / medians[k], 3)}
                                  if "generate" in medians else {})}
                           for k, v in times.items()}}
    for name, row in result["variants"].items():
        against = f", {row['speed_vs_generate']:.2f}x generate's" if "speed_vs_generate" in row else ""
        print(f"{name:11s} median {row['median_ms']:7.2f} ms  fastest {row['fastest_ms']:7.2f} ms  "
              f"{row['speed_vs_per_row']:.2f}x per-row's{against}")
    if args.compile and not xla:
        result["compiled_decode"] = compiled_decode(model, ids, mask, sampling, group, medians, args.rollouts)
    out = bench_grpo.OUT / ("rollout.json" if not xla else "rollout-xla.json" if args.devices == 1 else
                            f"rollout-xla-{args.devices}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def compiled_decode(model, ids, mask, sampling, group, medians, calls):
    """A one-token call of the last batch's rollout (shared+inf's), eager and compiled, `calls` times
    each; the compilation timed on that rollout's cache, then on the next rollout's (a new cache)."""
    import torch

    from xla_train.kernels.generate import static_generate

    def one_token_call():
        seen, forward = [], model.forward
        model.forward = lambda **k: (seen.append(k) if k["input_ids"].shape[1] == 1 else None) or forward(**k)
        try:
            static_generate(model, ids, mask, sampling, lambda: None, logps=True, stop_when_done=True, group=group)
        finally:
            del model.forward
        return seen[0], len(seen)

    def timed(f, k):
        start = time.perf_counter()
        for _ in range(calls):
            f(**k)
        return (time.perf_counter() - start) / calls

    with torch.inference_mode():
        k, steps = one_token_call()
        for _ in range(10):
            model.forward(**k)
        eager = timed(model.forward, k)
        compiled = torch.compile(model.forward, dynamic=False)
        start = time.perf_counter()
        compiled(**k)
        first = time.perf_counter() - start
        fast = timed(compiled, k)
        again, _ = one_token_call()
        start = time.perf_counter()
        compiled(**again)
        second = time.perf_counter() - start
    saved = (eager - fast) * steps  # a rollout's one-token calls
    row = {"eager_ms": round(eager * 1000, 3), "compiled_ms": round(fast * 1000, 3), "one_token_calls": steps,
           "compile_s": round(first, 2), "next_cache_s": round(second, 2),
           "rollout_ms": round(medians["shared+inf"] * 1000, 2),
           "pays_back_after_rollouts": round(first / saved) if saved > 0 else None}
    print(f"one-token call eager {row['eager_ms']:.3f} ms, compiled {row['compiled_ms']:.3f} ms ({steps} a rollout); "
          f"compiling {first:.1f} s, again for the next rollout's cache {second:.1f} s; pays back after "
          f"{row['pays_back_after_rollouts']} rollouts of {row['rollout_ms']:.2f} ms")
    return row


if __name__ == "__main__":
    main()
