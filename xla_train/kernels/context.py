"""Context parallelism on the torch-native backends (FSDP2 with a mesh's `context` axis N): each
worker of a context group holds 1/N of every row's tokens, and attention still sees the whole row.

    split_rows   a batch's token columns (every 2-D tensor as long as `input_ids`) cut along the
                 row into N slices, each worker keeping its own (`Context.index`); `position_ids`
                 added where the batch has none, so that every slice keeps its global positions
    inputs       the keyword arguments of one forward: the row's segments all-gathered once, and
                 the model switched to CONTEXT_ATTENTION, which all-gathers each layer's keys and
                 values over the group (autograd: the gradients of the keys and values other
                 workers' queries used come back to their worker) and masks the local queries
                 against the whole row's keys: causal by global position in the row, documents
                 kept apart by the global segments (padding, segment 0, attends to padding only)
    row_sums     a loss's per-row sums over local tokens summed over the group (one all-reduce,
                 with autograd): the whole row's

The loss over the whole row (sum of token losses / sum of tokens, each over the group) has on each
of the N workers the same value; the backward of the all-reduce sums its gradient over them, so
each worker back-propagates N times its local part, and FSDP2's mean over fsdp x context (the
parameters shard and reduce over both axes) gives the gradient of the fsdp groups' mean loss, as
fsdp alone over the same rows gives it. XLA's SPMD splits the tokens in the loaders' sharding
instead (parallel/mesh.py, `batch_spec`)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import UserError

if TYPE_CHECKING:
    import torch

CONTEXT_ATTENTION = "xla_train_context"
_OVER = CONTEXT_ATTENTION + "_over_"
ATTRIBUTE = "_xla_train_context"  # on the transformers model: its Context (Fsdp2.wrap_model sets it)


@dataclass(frozen=True)
class Context:
    """A worker's context group: `size` workers (neighbouring ranks) holding slices of the same
    rows, this worker's slice the `index`-th; `group` the process group."""

    group: Any
    size: int
    index: int

    def split_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This worker's slice of every row of `batch` (see the module's docstring)."""
        import torch

        ids = batch.get("input_ids")
        if ids is None or ids.dim() != 2 or "segments" not in batch:
            # a causal LM's document rows only (they carry their segments: tasks.causal_lm), which
            # its loss puts back together; others (a classifier's rows, prompts to generate from)
            # go whole to every worker of the group
            return batch
        rows, length = ids.shape
        if length % self.size:
            raise UserError(f"`context_parallel` {self.size} does not divide the rows' length {length}: "
                            f"choose a `max_length` that it divides")
        if "position_ids" not in batch:  # plain rows: the positions the model would count, made global
            batch = {**batch, "position_ids": torch.arange(length, device=ids.device).expand(rows, length)}
        part = length // self.size
        cut = slice(self.index * part, (self.index + 1) * part)
        return {k: v[:, cut] if v.dim() == 2 and v.shape[1] == length else v for k, v in batch.items()}

    def inputs(self, model: Any, segments: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments of `model(...)` on local tokens whose documents `segments`
        ([rows, local length]) numbers: the whole row's segments, gathered once for every layer."""
        import torch
        import torch.distributed as dist

        hf = _switch(model)
        parts = [torch.empty_like(segments) for _ in range(self.size)]
        dist.all_gather(parts, segments.contiguous(), group=self.group)
        # a 4-D attention_mask is returned as it is by transformers' masking_utils: no L x L mask built
        return {"attention_mask": segments[:, None, None, :],
                "context": RowAttention(self, torch.cat(parts, 1), eager=_former(hf.config) == "eager")}

    def row_sums(self, *sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of `sums` (per-row sums over local tokens, [rows]) summed over the group."""
        import torch
        from torch.distributed.nn.functional import all_reduce

        whole = all_reduce(torch.stack([s.float() for s in sums]), group=self.group)
        return tuple(whole.unbind(0))

    def row_max(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (per row, [rows]) the largest over the group (no gradient: a row's documents)."""
        import torch.distributed as dist

        values = values.detach().clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values


def of(model: Any) -> Context | None:
    """The Context a model was split with (FSDP2 under a `context` axis), or None."""
    from .attention import unwrapped

    return getattr(unwrapped(model), ATTRIBUTE, None)


@dataclass
class RowAttention:
    """One forward's whole-row segments, handed to every attention layer (kwarg `context`)."""

    context: Context
    segments: torch.Tensor  # [rows, whole length]
    eager: bool = False  # the former implementation is eager: an additive mask
    masks: dict = field(default_factory=dict)  # sliding window (None: none) -> [rows, 1, local, whole]

    def mask(self, window: int | None) -> torch.Tensor:
        """Local queries against the whole row's keys: same document, not later in the row, and
        with a window fewer than `window` tokens back."""
        import torch

        from .attention import mask_for

        if window not in self.masks:
            length = self.segments.shape[1]
            part = length // self.context.size
            keys = torch.arange(length, device=self.segments.device)
            queries = keys[self.context.index * part:(self.context.index + 1) * part]
            local = self.segments[:, queries]
            keep = (local[:, None, :, None] == self.segments[:, None, None, :]) & (queries[:, None] >= keys[None, :])
            if window is not None:
                keep = keep & (queries[:, None] - keys[None, :] < window)
            self.masks[window] = mask_for(keep, self.eager)
        return self.masks[window]

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
        """q [rows, heads, local, d], k and v [rows, kv heads, local, d]: the former implementation
        (sdpa, eager: grouped heads, scaling, soft-capping and sinks as the family has them) on
        the whole row's keys and values."""
        if kwargs.get("dropout"):
            raise UserError("`context_parallel` takes no attention dropout")
        gather = _gather_tokens()
        key = gather.apply(key, self.context)
        value = gather.apply(value, self.context)
        window = kwargs.get("sliding_window")
        base = _base(module, _former(module.config))
        return base(module, query, key, value, self.mask(window if window and window < key.shape[2] else None),
                    **kwargs)


@functools.cache
def _gather_tokens() -> Any:
    """The autograd of a gather along the tokens (dim 2) over a context group: its backward sums
    each worker's part of the gradient over the group (a reduce-scatter). Not torch's
    torch.distributed.nn.functional.all_gather: on gloo its backward scatters from group ranks
    as if they were global ones (torch 2.9, _AlltoAll.forward: "Global rank 0 is not part of
    group", tried on the context groups of 4 gloo workers)."""
    import torch
    import torch.distributed as dist

    class GatherTokens(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, part: torch.Tensor, context: Context) -> torch.Tensor:
            ctx.context = context
            parts = [torch.empty_like(part) for _ in range(context.size)]
            dist.all_gather(parts, part.contiguous(), group=context.group)
            return torch.cat(parts, 2)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            context = ctx.context
            if dist.get_backend(context.group) == "gloo":  # gloo has no reduce-scatter
                whole = grad.contiguous()
                dist.all_reduce(whole, group=context.group)
                return whole.chunk(context.size, 2)[context.index].contiguous(), None
            chunks = [c.contiguous() for c in grad.chunk(context.size, 2)]
            mine = torch.empty_like(chunks[context.index])
            dist.reduce_scatter(mine, chunks, group=context.group)
            return mine, None

    return GatherTokens


# --- the transformers registration -----------------------------------------------------------
def _former(config: Any) -> str:
    name = getattr(config, "_attn_implementation", None) or "eager"
    return name[len(_OVER):] if name.startswith(_OVER) else name


def _base(module: Any, name: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward  # the family's own (soft-caps, sinks)


def context_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                      context: RowAttention | None = None, **kwargs: Any) -> Any:
    """CONTEXT_ATTENTION: a call with `context` attends over the whole row; any other (generation,
    a plain forward) runs the model's former implementation."""
    if context is not None:
        return context.attend(module, query, key, value, **kwargs)
    return _base(module, _former(module.config))(module, query, key, value, attention_mask, *args, **kwargs)


def context_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """CONTEXT_ATTENTION's mask function: the former implementation's (a context call's 4-D mask
    never reaches it)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = _former(config) if config is not None else None
    return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, config=config, **kwargs) if base in ALL_MASK_ATTENTION_FUNCTIONS \
        else None


def _switch(model: Any) -> Any:
    """The transformers model inside `model`, switched once to CONTEXT_ATTENTION over its former
    implementation (registered with transformers' AttentionInterface)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import unwrapped

    hf = unwrapped(model)
    name = getattr(hf.config, "_attn_implementation", None) or "eager"
    if name.startswith(_OVER):
        return hf
    if not getattr(hf, "_supports_attention_backend", False):
        raise UserError(f"`context_parallel`: {type(hf).__name__}'s attention does not take a registered "
                        "attention function")
    AttentionInterface.register(_OVER + name, context_attention)
    AttentionMaskInterface.register(_OVER + name, context_mask)
    hf.set_attn_implementation(_OVER + name)
    return hf
