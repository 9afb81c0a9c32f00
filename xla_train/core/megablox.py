"""torch_xla 2.9's megablox grouped matmul (a Pallas TPU kernel) for the experts of a mixture of
experts on a TPU: the (token, expert) rows sorted by expert, one product per expert over its own
rows, so the experts cost their active FLOPs (core/experts.py, `grouped_experts_forward`).

torch_xla's wrappers (torch_xla/experimental/custom_kernel.py: `gmm`, `tgmm`) hand jax 0.7.1's
kernels (jax/experimental/pallas/ops/tpu/megablox/gmm.py: `gmm`, `tgmm`) to
`torch_xla.core.xla_builder.call_jax`, which lowers them to a Mosaic custom call that only a TPU
runs (on XLA:CPU it stops at "XLA type not supported: 17"), and which needs torchax: torch_xla's
wheel bundles torchax 0.0.6, whose import needs flax (the tpu and dev extras bring flax 0.12.0,
the newest release made for jax 0.7.1). The autograd around the kernels is the package's
(`GroupedMatmul`), not torch_xla's `GMM`: `GMM` and `gmm_backward` pass no `group_offset`
(expert parallelism needs it), and `gmm_backward` copies the experts' weights transposed where
the kernel takes `transpose_rhs`.

The one rule for the shapes handed to the kernel is `gmm_tiling` and `gmm_serves`; tests/
test_experts.py checks it against jax's kernels lowered for a TPU, and runs them in jax's TPU
interpret mode with these arguments (tests/megablox_interpret.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any, NamedTuple

import torch

TILE = 128  # the kernel's tiles are multiples of the TPU's 128 lanes
ROW_TILE_LIMIT = 512  # torch_xla 2.9's limits on the tiles (_get_tiling_size_for_gmm_kernel)
FEATURE_TILE_LIMIT = 2048


def _round_up_within(x: int, limit: int) -> int:
    """torch_xla 2.9's `_round_up_to_multiple_of_128_within_limit` (custom_kernel.py)."""
    if x <= TILE:
        return TILE
    if x < limit:
        return -(-x // TILE) * TILE
    return next((c for c in range(limit, 511, -TILE) if x % c == 0), limit)


def gmm_tiling(m: int, k: int, n: int, groups: int) -> tuple[int, int, int]:
    """The (tm, tk, tn) tiles for `m` rows of width `k` times `groups` experts' (k, n) weights: torch_xla
    2.9's `_get_tiling_size_for_gmm_kernel` (custom_kernel.py), which its `gmm` takes when given no
    tiling (tm: twice the mean rows an expert gets, in multiples of 128 up to 512, at most `m`)."""
    tm = min(_round_up_within(2 * m // groups, ROW_TILE_LIMIT), m)
    return tm, _round_up_within(k, FEATURE_TILE_LIMIT), _round_up_within(n, FEATURE_TILE_LIMIT)


def gmm_serves(m: int, k: int, n: int, groups: int) -> bool:
    """Whether the kernel takes `m` sorted rows through `groups` experts' (k, n) weights with
    `gmm_tiling`'s tiles, forward (gmm) and backward (gmm with the weights transposed, tgmm): jax's
    kernel needs the rows to be a multiple of the row tile (megablox/gmm.py, make_group_metadata:
    "must be divisible by x-dimension tile size"); the feature tiles are multiples of 128, which
    Mosaic takes for any width (the kernel masks the remainder), and a row tile is either a
    multiple of 128 or all the rows, which Mosaic takes too."""
    return m > 0 and m % gmm_tiling(m, k, n, groups)[0] == 0


def grouped_refusal() -> str | None:
    """Why the grouped matmul cannot run in this process, or None: it needs a TPU
    (torch_xla.runtime.device_type()), jax and a torchax that imports (torch_xla's call_jax)."""
    if importlib.util.find_spec("torch_xla") is None:
        return "it needs torch_xla"
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return f"its Pallas kernel runs on a TPU only, not on XLA:{xr.device_type()}"
    if importlib.util.find_spec("jax") is None:
        return "it needs jax (pip install 'xla-train[tpu]')"
    from torch_xla._internal.jax_workarounds import maybe_get_torchax

    if maybe_get_torchax() is None:  # torch_xla's bundled torchax imports flax (torchax/checkpoint.py)
        return "torch_xla's call_jax needs torchax, whose bundled copy needs flax (pip install 'xla-train[tpu]')"
    return None


class Kernels(NamedTuple):
    """The grouped matmul's two kernels with torch_xla 2.9's wrappers' signatures:
    gmm(lhs [m, k], rhs [groups, k, n] ([groups, n, k] with transpose_rhs), group_sizes int32 [groups],
    tiling, group_offset, transpose_rhs) -> [m, n];
    tgmm(lhs [k, m], rhs [m, n], group_sizes, tiling, group_offset) -> [groups, k, n]."""

    gmm: Any
    tgmm: Any


def torch_xla_kernels() -> Kernels:
    from torch_xla.experimental.custom_kernel import gmm, tgmm

    return Kernels(gmm, tgmm)


class GroupedMatmul(torch.autograd.Function):
    """rows [m, k] sorted by group, weights [groups, k, n] (or [groups, n, k], `transposed`) ->
    [m, n]: each group's rows times its weights. Backward: the rows' gradient through the kernel
    with the weights the other way round (no transposed copy), the weights' through tgmm."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor,
                transposed: bool, kernels: Kernels, group_offset: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, group_sizes)
        ctx.transposed, ctx.kernels, ctx.group_offset = transposed, kernels, group_offset
        n = weights.size(1) if transposed else weights.size(2)
        tiling = gmm_tiling(rows.size(0), rows.size(1), n, weights.size(0))
        return kernels.gmm(rows, weights, group_sizes, tiling, group_offset, transposed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weights, group_sizes = ctx.saved_tensors
        kernels, offset, transposed = ctx.kernels, ctx.group_offset, ctx.transposed
        m, k, groups, n = rows.size(0), rows.size(1), weights.size(0), grad.size(1)
        grad = grad.contiguous()
        # d(rows) [m, k] = grad [m, n] x each group's weights, read [k, n] as [n, k]'s transpose
        d_rows = kernels.gmm(grad, weights, group_sizes, gmm_tiling(m, n, k, groups), offset, not transposed)
        # d(weights): tgmm of [k, m] x [m, n] -> [groups, k, n]; transposed weights: [n, m] x [m, k]
        if transposed:
            d_weights = kernels.tgmm(grad.t(), rows, group_sizes, gmm_tiling(m, n, k, groups), offset)
        else:
            d_weights = kernels.tgmm(rows.t(), grad, group_sizes, gmm_tiling(m, k, n, groups), offset)
        return d_rows, d_weights, None, None, None, None


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, transposed: bool,
                   kernels: Kernels, group_offset: torch.Tensor | None = None) -> torch.Tensor:
    """`GroupedMatmul` in autocast's dtype where autocast is on (a custom call is not cast by it;
    jax's kernel multiplies in bf16 only where both operands are bf16: megablox/common.py)."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        rows, weights = rows.to(dtype), weights.to(dtype)
    out: torch.Tensor = GroupedMatmul.apply(rows, weights, group_sizes, transposed, kernels, group_offset)
    return out
