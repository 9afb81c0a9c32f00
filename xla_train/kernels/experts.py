"""Mixture-of-experts layers with static shapes, for XLA (issue 51).

transformers 5.24 runs a MoE family's experts (Qwen3-MoE, Mixtral, gpt-oss: the classes decorated
with `use_experts_implementation`, transformers/integrations/moe.py) through the function that
`config._experts_implementation` names in `ALL_EXPERTS_FUNCTIONS` (an `ExpertsInterface`); a model
made without a choice gets "grouped_mm" (modeling_utils.PreTrainedModel.
get_correct_experts_implementation). None of the three stock ones suits XLA:

  eager       (e.g. Qwen3MoeExperts.forward) loops over `nonzero()` of the routing and gathers each
              expert's tokens with `torch.where`: shapes that depend on the routing, so on XLA a
              host sync per layer (aten::nonzero, aten::_local_scalar_dense run on the CPU) and new
              graphs at every step (measured on XLA:CPU, tiny Qwen3-MoE: 42 transfers and 6
              compilations a step, after the first step's 19).
  grouped_mm  (grouped_mm_experts_forward) counts tokens per expert with `torch.histc` on int32,
              which torch_xla hands back to the CPU, where it fails: `NotImplementedError:
              "histogram_cpu" not implemented for 'Int'`; its matmul, `torch._grouped_mm`, has no
              XLA lowering either.
  batched_mm  (batched_mm_experts_forward) is static, but gathers a copy of its experts' weights
              for every (token, expert) pair, `gate_up_proj[expert_ids]` and `down_proj[...]`:
              tokens x top-k x 3 x intermediate x hidden numbers per layer, kept for the backward
              pass (Mixtral-8x7B in bf16: 0.7 GB per token per layer; Qwen3-30B-A3B: 75 MB).

`dense_experts_forward`, registered here as XLA_EXPERTS, runs every expert on every token and
weights each output by the token's routing weight, which is zero outside its top-k (the router's
own weights, scattered into a tokens x experts matrix): two plain matmuls over all experts at once,
the same numbers as eager up to the order of additions (fp32: within 1e-5, outputs and gradients),
static for any routing. Its cost: experts / top-k times the experts' FLOPs (Mixtral 4x, gpt-oss-20b
8x, Qwen3-30B-A3B 16x), tokens x experts x 3 x intermediate activations per layer (about 1/(top-k x
hidden / experts) of batched_mm's gathered weights: Qwen3-30B-A3B 128x less, Mixtral 1024x less).

On a TPU, `grouped_experts_forward` (XLA_GROUPED) runs each expert on its own tokens only, through
torch_xla's Pallas grouped matmul (kernels/megablox.py), dropless and with static shapes: the tokens x
top-k (token, expert) pairs sorted by expert (a stable argsort), each expert's count as int32 (a
one-hot sum: no nonzero, no histogram), the gate/up and down projections as two grouped matmuls,
the results weighted by the router and summed back per token. FLOPs: the active experts' (1x);
activations: tokens x top-k x (3 x intermediate + 2 x hidden). Where the kernel refuses the rows
(`megablox.gmm_serves`) the layer takes the dense path, at trace time (shapes are static). Under
SPMD each device sorts its own tokens and runs the kernel on them (torch_xla's manual sharding).
XLA:CPU and XLA on a GPU cannot run the kernel and keep the dense path.
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.mesh import tokens_entry
from .megablox import Kernels, gmm_serves, grouped_matmul, grouped_refusal, row_shards, torch_xla_kernels

EXPERT = "expert"  # the mesh's axis the experts are split over (parallel.mesh)
XLA_EXPERTS = "xla_dense"
XLA_GROUPED = "xla_grouped"  # a TPU's: torch_xla's megablox grouped matmul
# the stock implementations XLA cannot run statically (see above); others (CUDA kernels, FP8) are left alone
REPLACED = ("eager", "grouped_mm", "batched_mm")


def dense_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward (`self`: a class decorated by transformers'
    `use_experts_implementation`, with its flags has_gate, has_bias, is_transposed and
    has_post_expert_norm) over every expert: hidden_states (tokens, hidden), top_k_index and
    top_k_weights (tokens, top-k) -> (tokens, hidden), as batched_mm_experts_forward computes it."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{XLA_EXPERTS} experts do not shard experts over devices (expert parallelism)")
    tokens, hidden = hidden_states.shape
    experts = self.num_experts
    # (tokens, experts): each token's routing weight of every expert, zero outside its top-k
    routing = torch.zeros(tokens, experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    routing = routing.scatter(1, top_k_index, top_k_weights)

    # --- up (and gate) projection of every expert: one (tokens, hidden) x (hidden, experts * out) matmul
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    # (experts, hidden, out) where transposed, else (experts, out, hidden)
    up_t = up if self.is_transposed else up.transpose(1, 2)
    out_dim = up_t.size(2)
    proj = torch.matmul(hidden_states, up_t.permute(1, 0, 2).reshape(hidden, experts * out_dim))
    if up_bias is not None:
        proj = proj + up_bias.reshape(experts * out_dim)
    proj = proj.view(tokens, experts, out_dim)
    _split_by_expert(proj, (0, 1))
    # the module's own gate (gpt-oss: interleaved halves, clamped) or activation, on the last dimension
    act = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)  # (tokens, experts, intermediate)
    inner = act.size(2)

    # --- down projection, weighted by the routing
    down_t = self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2)  # (experts, inner, hidden)
    down_bias = self.down_proj_bias if self.has_bias else None
    if self.has_post_expert_norm:
        # the norm comes between an expert's output and its weight: each expert's output is kept
        out = torch.matmul(act.transpose(0, 1), down_t)  # (experts, tokens, hidden)
        _split_by_expert(out, (1, 0))
        if down_bias is not None:
            out = out + down_bias[:, None, :]
        out = self.post_expert_norm(out)
        final = (out * routing.t().to(out.dtype)[:, :, None]).sum(0)
    else:
        # weight first, then one matmul that sums over experts and the intermediate dimension together
        weighted = act * routing.to(act.dtype)[:, :, None]
        final = torch.matmul(weighted.reshape(tokens, experts * inner), down_t.reshape(experts * inner, hidden))
        if down_bias is not None:
            final = final + torch.matmul(routing.to(down_bias.dtype), down_bias)
    return final.to(hidden_states.dtype)


def _split_by_expert(t: torch.Tensor, dims: tuple[int, int]) -> None:
    """Under SPMD with an `expert` axis (parallel.mesh), `t`'s experts dimension (`dims[1]`) split
    over it and its tokens (`dims[0]`) over the other axes that split tokens: each device computes
    its own experts (their weights split so too, XlaFsdp._plan) on the tokens of its expert group,
    which the partitioner gathers there; the sum over experts that follows is reduced over the
    axis. Tokens travel to their experts' devices and back (all-gather and reduce-scatter); no
    device holds another's experts."""
    if t.device.type != "xla":
        return
    from .megablox import spmd_mesh

    mesh = spmd_mesh()
    if mesh is None or EXPERT not in mesh.axis_names:
        return
    import torch_xla.distributed.spmd as xs

    spec: list[Any] = [None] * t.dim()
    spec[dims[0]], spec[dims[1]] = tokens_entry(mesh.axis_names, but=EXPERT), EXPERT
    xs.mark_sharding(t, mesh, tuple(spec))


def expert_weights(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s experts' stacked parameters (first dimension: the expert): those of
    each experts module (transformers' `use_experts_implementation` classes: `num_experts` and a
    `down_proj`), not the router's."""
    names = []
    for prefix, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or not hasattr(module, "down_proj"):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == count:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def expert_refusal(config: Any, n: int) -> str | None:
    """Why a model of `config` does not split its experts over `n` devices, in one line, or None."""
    if n == 1:
        return None
    text = getattr(config, "get_text_config", lambda: config)()
    name = type(config).__name__
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts:
        return f"`expert_parallel` {n}: {name} is not a mixture of experts"
    if experts % n:
        return f"`expert_parallel` {n}: {name}'s {experts} experts cannot be split evenly over {n} devices"
    return None


def grouped_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
    """`dense_experts_forward`'s contract through the grouped matmul: each (token, expert) pair
    once, each expert over its own rows. `kernels`: torch_xla's gmm and tgmm unless given (the
    tests hand jax's kernels interpreted on the CPU). Rows the kernel refuses go the dense way.
    Under SPMD each device sorts and multiplies the tokens it holds (megablox.row_shards: the
    strategy splits the tokens by rows over the mesh's first axis), as MaxText's dropless MoE does
    under shard_map: no token crosses devices, the experts' weights are gathered whole."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{XLA_GROUPED} experts do not shard experts over devices (expert parallelism)")
    tokens, hidden = hidden_states.shape
    top_k, experts = top_k_index.size(1), self.num_experts
    up = self.gate_up_proj if self.has_gate else self.up_proj  # [experts, hidden, out], else [experts, out, hidden]
    out_dim = up.size(2) if self.is_transposed else up.size(1)
    inner = self.down_proj.size(1) if self.is_transposed else self.down_proj.size(2)
    layout = row_shards(hidden_states)
    shards = layout.devices if layout else 1
    rows = tokens // shards * top_k  # a device's (token, expert) pairs
    if tokens % shards or not (gmm_serves(rows, hidden, out_dim, experts) and gmm_serves(rows, inner, hidden, experts)):
        return dense_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    kernels = kernels or torch_xla_kernels()

    # --- each shard's pairs sorted by expert: static shapes ([shards, rows]); a stable sort keeps
    # each expert's tokens in order; sorts, gathers and sums along dimension 1 stay on their device
    expert_of_pair = top_k_index.reshape(shards, rows)
    order = torch.argsort(expert_of_pair, dim=1, stable=True)
    expert_sorted = expert_of_pair.gather(1, order)
    token_sorted = (order // top_k)[:, :, None]  # pair p is the shard's token p // top_k's
    # rows per expert, int32 as the kernel takes them: a one-hot sum ([shards, rows, experts]),
    # which XLA keeps on the device (torch.bincount and histc come back to the host on XLA)
    group_sizes = (expert_of_pair[:, :, None] == torch.arange(experts, device=hidden_states.device)).sum(1)
    group_sizes = group_sizes.to(torch.int32)
    local = hidden_states.reshape(shards, tokens // shards, hidden)

    # --- up (and gate) projection: [rows, hidden] x each expert's weights
    gathered = local.gather(1, token_sorted.expand(shards, rows, hidden))
    proj = grouped_matmul(gathered, up, group_sizes, not self.is_transposed, kernels, layout)
    if self.has_bias:
        proj = proj + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert_sorted]
    act = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)  # the module's own (gpt-oss: clamped)

    # --- down projection, the router's weight, each token's pairs summed
    out = grouped_matmul(act, self.down_proj, group_sizes, not self.is_transposed, kernels, layout)
    if self.has_bias:
        out = out + self.down_proj_bias[expert_sorted]
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)  # per row: each pair's expert output, before its weight
    out = out * top_k_weights.reshape(shards, rows).gather(1, order).to(out.dtype)[:, :, None]
    final = torch.zeros_like(local, dtype=out.dtype).scatter_add(1, token_sorted.expand(shards, rows, hidden), out)
    return final.reshape(tokens, hidden).to(hidden_states.dtype)


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(XLA_EXPERTS, dense_experts_forward)
    ExpertsInterface.register(XLA_GROUPED, grouped_experts_forward)


def has_experts(model: torch.nn.Module) -> bool:
    """Whether `model` holds an experts module that transformers dispatches through
    `ExpertsInterface` (decorated by `use_experts_implementation`, which gives it `has_gate`)."""
    return any(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())


def static_experts(model: torch.nn.Module, grouped: bool | None = None) -> bool:
    """Sets the experts of a transformers MoE model (Qwen3-MoE, Mixtral, gpt-oss, ...) to
    `dense_experts_forward` (XLA_EXPERTS), or `grouped` (None: where this process runs the kernel,
    a TPU with jax and torchax: megablox.grouped_refusal) to `grouped_experts_forward`
    (XLA_GROUPED), whose shapes do not depend on the routing, where they
    run one of transformers' own implementations (eager, grouped_mm, batched_mm: see the module's
    docstring; transformers/integrations/moe.py); through the model's `set_experts_implementation`
    (transformers/modeling_utils.py), which sets its sub-models' too. Does nothing to any other
    model. Returns whether it set them."""
    hf: Any = model  # a transformers model, or a peft model that forwards attributes to it
    if not (hasattr(hf, "set_experts_implementation") and has_experts(model)):
        return False
    if getattr(hf.config, "_experts_implementation", None) not in REPLACED:
        return False
    _register()
    hf.set_experts_implementation(_xla_choice() if grouped is None else XLA_GROUPED if grouped else XLA_EXPERTS)
    return True


def _xla_choice() -> str:
    """The package's experts on XLA in this process: grouped where the kernel runs, else dense."""
    return XLA_GROUPED if grouped_refusal() is None else XLA_EXPERTS


def planned_experts(model: torch.nn.Module, device_kind: str, tokens: int | None = None) -> str | None:
    """The implementation `model`'s experts will run once prepared for a device of `device_kind`
    (kernels.attention.kind_of: "xla", "xla-tpu", "cuda", "cpu"), as `static_experts` will set it on
    XLA, for steps of `tokens` tokens a device (where given: the grouped matmul's rows are checked,
    and refused ones run dense); None for a model without experts. The memory plan counts their
    activations by it and names it."""
    current = experts_implementation(model)
    if current not in REPLACED or not device_kind.startswith("xla"):
        return current
    chosen = _xla_choice()
    if chosen == XLA_GROUPED and tokens is not None and not _grouped_serves(model, tokens):
        return XLA_EXPERTS
    return chosen


def _grouped_serves(model: torch.nn.Module, tokens: int) -> bool:
    """Whether the grouped matmul takes `tokens` tokens' (token, expert) rows in every experts module."""
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "is_transposed"):
            m: Any = module  # an experts module (transformers' use_experts_implementation)
            up = m.gate_up_proj if m.has_gate else m.up_proj
            hidden, out = (up.size(1), up.size(2)) if m.is_transposed else (up.size(2), up.size(1))
            inner = m.down_proj.size(1) if m.is_transposed else m.down_proj.size(2)
            rows = tokens * _top_k(model)
            if not (gmm_serves(rows, hidden, out, m.num_experts) and gmm_serves(rows, inner, hidden, m.num_experts)):
                return False
    return True


def _top_k(model: torch.nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    top_k: int = getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", None) or 1
    return top_k


def experts_implementation(model: torch.nn.Module) -> str | None:
    """The name of the implementation `model`'s experts run (transformers' or the package's), or
    None for a model without experts: what the console and the metrics' memory plan name."""
    if not has_experts(model):
        return None
    config = getattr(model, "config", None)
    return getattr(config, "_experts_implementation", None) or "eager"
