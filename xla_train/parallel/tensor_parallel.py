"""--tensor-parallel N: which parameters split over the mesh's `tensor` axis, and how, read from
transformers' own tensor-parallel plan (the config's `base_model_tp_plan`, as transformers'
`from_pretrained(tp_plan=...)` and `DistributedConfig` read it: integrations/tensor_parallel.py in
5.24). Megatron's layout: `colwise` projections (q, k, v, gate, up) split their outputs, `rowwise`
ones (o, down) their inputs, so a block's attention heads and MLP columns are split and its
residual stream and norms stay whole. This module names partition specs only (axis names per
dimension); the strategy lays them on its mesh (parallel.xla_strategies.XlaFsdp)."""

from __future__ import annotations

import re
from typing import Any

import torch

TENSOR = "tensor"  # the mesh axis; the other one is FSDPv2's `fsdp`
FSDP = "fsdp"

Spec = tuple[str | None, ...]


def plan_of(config: Any) -> dict[str, str]:
    """The config's tensor-parallel plan ({module pattern: style}), or {} for a family without one
    (the encoders, GPT-2). A decoder's text config carries it for a multimodal one (Gemma 3)."""
    text = getattr(config, "get_text_config", lambda: config)()
    return dict(getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {})


def _sizes(config: Any) -> dict[str, int | None]:
    text = getattr(config, "get_text_config", lambda: config)()
    return {"attention heads": getattr(text, "num_attention_heads", None),
            "key/value heads": getattr(text, "num_key_value_heads", None),
            "MLP width": getattr(text, "intermediate_size", None),
            "experts' MLP width": getattr(text, "moe_intermediate_size", None)}


# what XLA's SPMD keeps whole where N does not divide it (`planned_specs`): the key/value projections,
# as vLLM replicates them; and the experts, split by FSDPv2's rule (`default_spec`), not the plan's
KEPT_WHOLE = ("key/value heads", "experts' MLP width")


def refusal(config: Any, n: int, every_projection: bool = False) -> str | None:
    """Why a model of `config` does not split over `n` tensor-parallel devices, in one line, or None.
    Sizes of KEPT_WHOLE that `n` does not divide are no refusal on XLA; with `every_projection`
    (transformers' styles under FSDP2 on CUDA and the CPU, which split the key/value projections
    and the experts too) they are."""
    if n == 1:
        return None
    name = type(config).__name__
    if not plan_of(config):
        return f"`tensor_parallel` {n}: {name} has no tensor-parallel plan (transformers' base_model_tp_plan)"
    for what, size in _sizes(config).items():
        if (what not in KEPT_WHOLE or every_projection) and size and size % n:
            return f"`tensor_parallel` {n}: {name}'s {what} ({size}) cannot be split evenly over {n} devices"
    return None


def kv_heads_split(kv_heads: int, n: int) -> bool:
    """Whether the key/value heads split over `n` devices; where `n` does not divide them, their
    projections are kept whole on each device of a tensor group (`planned_specs`)."""
    return kv_heads % n == 0


def kv_heads_per_device(kv_heads: int, n: int) -> int:
    """Key/value heads each device of a tensor group holds: its share, or all of them."""
    return kv_heads // n if kv_heads_split(kv_heads, n) else kv_heads


def _plan_name(module_name: str) -> str:
    """A module's name as the plan names it: FSDPv2's wrapper attribute and a LoRA layer's
    `base_layer` aside, layer numbers as the plan's `*`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module_name.replace("_orig_module.", "").removesuffix(".base_layer"))


def _style(plan: dict[str, str], module_name: str) -> str | None:
    """The plan's style for a module named as the model names it, under any prefix (the base
    model's attribute, peft's `base_model.model.`)."""
    name = _plan_name(module_name)
    for pattern, style in plan.items():
        if name == pattern or name.endswith("." + pattern):
            return style
    return None


def default_spec(shape: tuple[int, ...] | torch.Size, tensor: bool) -> Spec:
    """A parameter outside the plan (embeddings, the head, norms, experts): FSDPv2's layout, its
    largest dimension over `fsdp` (torch_xla's _prepare_spmd_partition_spec, shard_maximal), and
    with a tensor axis its next largest over `tensor`, so that it is split over every device too."""
    spec: list[str | None] = [None] * len(shape)
    if not spec:
        return ()
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    spec[order[0]] = FSDP
    if tensor and len(order) > 1:
        spec[order[1]] = TENSOR
    return tuple(spec)


KV_PROJECTIONS = ("k_proj", "v_proj")  # the key and value projections, by transformers' names for them
# transformers' styles of a Linear by the split of its weight: its output (column-parallel) or its
# input (row-parallel). The `_gather_output` and `_split_input` variants (Phi-3's and Phi-4-mini's
# fused qkv_proj and gate_up_proj with their o_proj and down_proj, OLMo-2's q/k/v/o, GLM's MLP) split
# the weight the same way and differ only in where transformers' DTensor hooks move the
# activations: gathered whole after the projection (so a slice of the fused output, or a norm over
# every head, sees all of it), split again before the next (integrations/tensor_parallel.py). Under
# XLA's SPMD the compiler places those collectives itself from the weights' layout; left to
# `default_spec`, a fused projection was split along its input, an all-reduce at every projection.
COLUMN = ("colwise", "colwise_gather_output")
ROW = ("rowwise", "rowwise_split_input")


def planned_specs(model: torch.nn.Module, n: int) -> dict[str, Spec]:
    """{parameter name: spec} for the parameters of `model` that its config's plan names: a
    column-parallel Linear's weight [out, in] (COLUMN's styles) as (tensor, fsdp) and its bias over
    `tensor`; a row-parallel one's (ROW) as (fsdp, tensor), its bias whole. Where `n` does not
    divide the key/value heads, the key and value projections keep FSDPv2's layout alone (whole
    over `tensor`). Other styles
    (experts, replicated norms) keep `default_spec`."""
    kv_heads = _sizes(model.config)["key/value heads"]
    plan = plan_of(model.config)
    specs: dict[str, Spec] = {}
    for name, module in model.named_modules():
        style = _style(plan, name) if isinstance(module, torch.nn.Linear) else None
        if style not in COLUMN + ROW:
            continue
        column = style in COLUMN
        prefix = name + "." if name else ""
        # by the last part of the name: a fused `qkv_proj` (Phi-3) also ends in "v_proj", and splits as a column
        whole = (kv_heads is not None and not kv_heads_split(kv_heads, n)
                 and _plan_name(name).rsplit(".", 1)[-1] in KV_PROJECTIONS)
        if whole:
            specs[prefix + "weight"] = default_spec(module.weight.shape, tensor=False)
        else:
            specs[prefix + "weight"] = (TENSOR, FSDP) if column else (FSDP, TENSOR)
        if module.bias is not None:
            specs[prefix + "bias"] = (TENSOR,) if column and not whole else (FSDP,)
    return specs
