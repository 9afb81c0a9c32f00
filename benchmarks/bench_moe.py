"""A mixture of experts' experts, dense against grouped, for layers shaped like Qwen3-30B-A3B's and
gpt-oss-20b's (issue 61): FLOPs and activation bytes per token, the CPU step time, and what a TPU
adds. One invocation; the table goes to the console and benchmarks/out/moe.json.

    python benchmarks/bench_moe.py                   # both layers, 512 tokens, 5 timed steps each
    python benchmarks/bench_moe.py --tokens 256 --steps 3 --shrink 8

Each layer is the published config's experts (tests/tiny_decoders.py's copies of Qwen3-30B-A3B's
and gpt-oss-20b's config.json: 128 experts of which 8 per token, 768 wide on a 2,048-wide model;
32 of which 4, 2,880 on 2,880, with biases and the clamped, interleaved gate), the widths divided by
--shrink (default 4) so that a step fits 2 CPU cores and 24 GiB in seconds; the numbers of experts
and per token, which set the ratios, are the published ones. The routing: each token's top-k of
random router logits (softmax weights), one fixed draw.

Measured per layer, for `xla_dense` (xla_train/kernels/experts.py: every expert on every token, what
XLA runs where no kernel serves) and transformers 5.24's `grouped_mm` (torch._grouped_mm over the
tokens sorted by expert: the active experts only; the arithmetic of the package's `xla_grouped`,
which runs torch_xla's megablox kernel on a TPU only):
- FLOPs per token of a training step (forward and backward), counted by torch's FlopCounterMode on
  the traced ops of a step (torch._grouped_mm has no FLOP formula in torch 2.9: grouped_mm's
  count is the plan's, 6 x rows x k x n per projection, beside the measured dense one, which must
  equal its own plan);
- the bytes autograd keeps for the backward pass (every tensor the step's graph saves, each storage
  once, the weights themselves left out), per token (the growth from the tokens to twice as many)
  and fixed (what does not grow: copies of the weights), beside the memory plan's per-token figure
  (xla_train/memory.py, _experts_bytes, in fp32);
- the step's time on this CPU (forward and backward, the median of --steps after one warm-up, the
  two implementations' steps alternating).
The TPU part is a plan: the tiles torch_xla 2.9 would pick for the grouped matmul at the published
widths (xla_train/kernels/megablox.py, gmm_tiling) and whether the kernel takes rows of 8 x 2,048
tokens, and what to time there.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tiny_decoders as td  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: E402

from xla_train.core.peaks import experts_of  # noqa: E402
from xla_train.kernels.experts import dense_experts_forward  # noqa: E402
from xla_train.kernels.megablox import gmm_serves, gmm_tiling  # noqa: E402
from xla_train.memory import _experts_bytes  # noqa: E402

LAYERS = {"Qwen3-30B-A3B": "qwen3moe", "gpt-oss-20b": "gptoss"}
IMPLEMENTATIONS = {"xla_dense": dense_experts_forward, "grouped_mm": grouped_mm_experts_forward}
TPU_ROWS = 8 * 2048  # tokens of a step the plan asks about (8 rows of 2,048)


def published(family):
    values = dict(td.ZOO[family]["config"])
    values.pop("quantization_config", None)
    return CONFIG_MAPPING[values["model_type"]](**values)


def experts_module(family, shrink):
    """The family's experts module at the published numbers of experts, widths divided by `shrink`."""
    from transformers import AutoModelForCausalLM

    config = published(family)
    width_key = "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) else "intermediate_size"
    small = {"hidden_size": config.hidden_size // shrink, width_key: getattr(config, width_key) // shrink,
             "num_hidden_layers": 1, "vocab_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 16, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gptoss":
        small["layer_types"] = ["full_attention"]
    values = {**config.to_dict(), **small}
    values.pop("quantization_config", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[values["model_type"]](**values), dtype=torch.float32)
    return next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")), model.config


def routing(tokens, experts, top_k):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, experts, generator=g)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    # the routing weights require their gradient, as the router's output does in a model
    return index, (weights / weights.sum(-1, keepdim=True)).requires_grad_()


def step(experts, forward, hidden, index, weights):
    experts.zero_grad(set_to_none=True)
    out = forward(experts, hidden, index, weights)
    out.square().mean().backward()


def flops_of(experts, forward, hidden, index, weights):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step(experts, forward, hidden, index, weights)
    return counter.get_total_flops()


def saved_bytes(experts, forward, hidden, index, weights):
    """Bytes of the tensors autograd saves for the backward pass, each storage once, weights left out."""
    params = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(experts, hidden, index, weights)
    del out
    return sum(seen.values())


def saved_per_token(experts, forward, hidden, index, weights):
    """What autograd keeps, split by a second run at twice the tokens (the same tokens twice): the
    bytes per token (the slope) and those that do not grow with the tokens (weight copies)."""
    tokens = hidden.size(0)
    once = saved_bytes(experts, forward, hidden, index, weights)
    twice = saved_bytes(experts, forward, torch.cat([hidden, hidden]), torch.cat([index, index]),
                        torch.cat([weights, weights]).detach().requires_grad_())
    per_token = (twice - once) / tokens
    return {"saved_bytes_per_token": per_token, "saved_bytes_fixed": once - per_token * tokens}


def planned_flops(config, tokens, implementation):
    """Training FLOPs of the experts' matmuls: 3 x 2 x (rows x hidden x (gate+up) + rows x width x hidden),
    rows = tokens x experts (dense) or tokens x top-k (grouped)."""
    experts, top_k, width, _ = experts_of(config)
    rows = tokens * (experts if implementation == "xla_dense" else top_k)
    return 6 * rows * (config.hidden_size * 2 * width + width * config.hidden_size)


def tpu_plan(family):
    config = published(family)
    experts, top_k, width, _ = experts_of(config)
    rows, h = TPU_ROWS * top_k, config.hidden_size
    return {"rows": rows, "experts": experts, "up_tiles": gmm_tiling(rows, h, 2 * width, experts),
            "down_tiles": gmm_tiling(rows, width, h, experts),
            "served": gmm_serves(rows, h, 2 * width, experts) and gmm_serves(rows, width, h, experts),
            "flops_ratio_dense_to_grouped": experts / top_k}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--shrink", type=int, default=4, help="divide the published widths by this")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "moe.json"))
    args = p.parse_args()
    rows = []
    for name, family in LAYERS.items():
        experts, config = experts_module(family, args.shrink)
        count, top_k, width, _ = experts_of(config)
        index, weights = routing(args.tokens, count, top_k)
        # the experts' input requires its gradient, as in a model (the rows' gradient is part of the step)
        hidden = torch.randn(args.tokens, config.hidden_size, generator=torch.Generator().manual_seed(2),
                             requires_grad=True)
        times: dict[str, list[float]] = {implementation: [] for implementation in IMPLEMENTATIONS}
        for forward in IMPLEMENTATIONS.values():
            step(experts, forward, hidden, index, weights)  # warm-up
        for _ in range(args.steps):  # the two alternate, so a shared machine's drift hits both alike
            for implementation, forward in IMPLEMENTATIONS.items():
                start = time.perf_counter()
                step(experts, forward, hidden, index, weights)
                times[implementation].append(time.perf_counter() - start)
        for implementation, forward in IMPLEMENTATIONS.items():
            counted = flops_of(experts, forward, hidden, index, weights)
            c = 4  # fp32
            rows.append({
                "layer": name, "shrink": args.shrink, "hidden": config.hidden_size,
                "width": width, "experts": count, "top_k": top_k, "tokens": args.tokens,
                "implementation": implementation,
                "flops_per_token_counted": counted / args.tokens if counted else None,
                "flops_per_token_planned": planned_flops(config, args.tokens, implementation) / args.tokens,
                **saved_per_token(experts, forward, hidden, index, weights),
                "planned_bytes_per_token": _experts_bytes(config, c, c, config.hidden_size,
                                                          "xla_dense" if implementation == "xla_dense" else
                                                          "xla_grouped"),
                "step_seconds": statistics.median(times[implementation]),
                "step_seconds_each": [round(t, 3) for t in times[implementation]],
            })
            r = rows[-1]
            counted_text = f"{r['flops_per_token_counted'] / 1e6:9.1f}" if r["flops_per_token_counted"] else "        -"
            print(f"{name:14} {implementation:10} FLOPs/token counted {counted_text} M, planned "
                  f"{r['flops_per_token_planned'] / 1e6:9.1f} M; saved "
                  f"{r['saved_bytes_per_token'] / 1024:8.1f} KiB/token + {r['saved_bytes_fixed'] / 2**20:6.1f} MiB"
                  f" (plan {r['planned_bytes_per_token'] / 1024:8.1f} KiB/token); "
                  f"step {r['step_seconds'] * 1e3:8.1f} ms",
                  flush=True)
    plans = {name: tpu_plan(family) for name, family in LAYERS.items()}
    for name, plan in plans.items():
        print(f"TPU plan, {name} at the published widths, {TPU_ROWS} tokens a step: {plan['rows']} rows over "
              f"{plan['experts']} experts, tiles up {plan['up_tiles']} down {plan['down_tiles']}, kernel takes them: "
              f"{plan['served']}; dense would do {plan['flops_ratio_dense_to_grouped']:.0f}x the experts' FLOPs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows,
                                          "tpu_plan": plans}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
