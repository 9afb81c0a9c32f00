"""torch_xla 2.9's megablox grouped matmul (a Pallas TPU kernel) for the experts of a mixture of
experts on a TPU: the (token, expert) rows sorted by expert, one product per expert over its own
rows, so the experts cost their active FLOPs (kernels/experts.py, `grouped_experts_forward`).

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
import math
from typing import Any, NamedTuple

import torch

from ..parallel.mesh import rows_entry

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


class RowShards(NamedTuple):
    """How SPMD splits a step's tokens: by rows over the mesh's first axis (`axis`, `devices` devices
    along it; kernels.attention._spmd_layout, the Pallas kernels' rule)."""

    mesh: Any
    axis: str | tuple[str, ...]  # the row axes (parallel.mesh.rows_entry)
    devices: int


def spmd_mesh() -> Any:
    """Under SPMD the mesh the Pallas kernels' rows are laid out on: the strategy's global mesh
    (XlaFsdp sets it), else torch_xla's 1-D "data" mesh over every device (as XlaSpmd's is), rows
    over its first axis; None outside SPMD. Read here by the grouped matmul (`row_shards`) and by
    kernels.attention's kernels (_spmd_layout), which imports this module (not the other way round:
    kernels.attention imports core.xla, which imports this module)."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        return None
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh() or xs.get_1d_mesh("data")
    assert mesh.axis_names is not None  # get_1d_mesh names its axis, and no global mesh here is unnamed
    return mesh


def row_shards(tensor: torch.Tensor) -> RowShards | None:
    """The row split of `tensor`'s tokens under SPMD (`spmd_mesh`), or None (one device holds them all)."""
    mesh = spmd_mesh() if tensor.device.type == "xla" else None
    if mesh is None:
        return None
    axis = rows_entry(mesh.axis_names)
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    return RowShards(mesh, axis, math.prod(sizes[a] for a in ((axis,) if isinstance(axis, str) else axis)))


def _manual(t: torch.Tensor, layout: RowShards | None, split: bool) -> torch.Tensor:
    """`t` as each device's part inside torch_xla's manual sharding: split along dimension 0 over
    the rows' axis, or whole (`split` False: the experts' weights, gathered onto every device)."""
    if layout is None:
        return t
    import torch_xla
    import torch_xla.distributed.spmd as xs

    spec = ((layout.axis,) if split else (None,)) + (None,) * (t.dim() - 1)
    # a copy without its layout: enable_manual_sharding annotates it, and a tensor already laid out (a
    # parameter FSDPv2 split, a propagated layout) stops it ("Existing annotation must be cleared first")
    copy = t * 1  # a node of the graph (a clone of a parameter keeps its device data, and its layout)
    torch_xla._XLAC._xla_clear_sharding(copy)
    return xs.enable_manual_sharding(copy, spec, mesh=layout.mesh).global_tensor


def _automatic(t: torch.Tensor, layout: RowShards | None) -> torch.Tensor:
    """Each device's part (`_manual`) back as one tensor split along dimension 0 over the rows' axis."""
    if layout is None:
        return t
    import torch_xla.distributed.spmd as xs

    spec = (layout.axis,) + (None,) * (t.dim() - 1)
    whole = torch.Size((t.size(0) * layout.devices, *t.shape[1:]))
    return xs.disable_manual_sharding(t, spec, whole, mesh=layout.mesh).global_tensor


class GroupedMatmul(torch.autograd.Function):
    """rows [shards, m, k], each shard's sorted by group, weights [groups, k, n] (or [groups, n, k],
    `transposed`), group sizes [shards, groups] -> [shards, m, n]: each group's rows times its
    weights, shard by shard. Under SPMD (`layout`) each device runs the kernel on its own shard
    (torch_xla's manual sharding, as its flash attention wrapper runs under a mesh) with the whole
    weights. Backward: the rows' gradient through the kernel with the weights the other way round
    (no transposed copy), the weights' through tgmm, summed over the shards."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor,
                transposed: bool, kernels: Kernels, layout: RowShards | None,
                group_offset: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, group_sizes)
        ctx.transposed, ctx.kernels, ctx.layout, ctx.group_offset = transposed, kernels, layout, group_offset
        n = weights.size(1) if transposed else weights.size(2)
        lhs, rhs = _manual(rows, layout, True), _manual(weights, layout, False)
        sizes = _manual(group_sizes, layout, True)
        tiling = gmm_tiling(lhs.size(1), lhs.size(2), n, rhs.size(0))
        out = torch.stack([kernels.gmm(lhs[s], rhs, sizes[s], tiling, group_offset, transposed)
                           for s in range(lhs.size(0))])
        return _automatic(out, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weights, group_sizes = ctx.saved_tensors
        kernels, offset, transposed, layout = ctx.kernels, ctx.group_offset, ctx.transposed, ctx.layout
        lhs, rhs = _manual(rows, layout, True), _manual(weights, layout, False)
        sizes, grads = _manual(group_sizes, layout, True), _manual(grad.contiguous(), layout, True)
        m, k, groups, n = lhs.size(1), lhs.size(2), rhs.size(0), grads.size(2)
        d_rows, d_weights = [], []
        for s in range(lhs.size(0)):
            # d(rows) [m, k] = grad [m, n] x each group's weights, read [k, n] as [n, k]'s transpose
            d_rows.append(kernels.gmm(grads[s], rhs, sizes[s], gmm_tiling(m, n, k, groups), offset, not transposed))
            # d(weights): tgmm of [k, m] x [m, n] -> [groups, k, n]; transposed weights: [n, m] x [m, k]
            if transposed:
                d_weights.append(kernels.tgmm(grads[s].t(), lhs[s], sizes[s], gmm_tiling(m, n, k, groups), offset))
            else:
                d_weights.append(kernels.tgmm(lhs[s].t(), grads[s], sizes[s], gmm_tiling(m, k, n, groups), offset))
        # each device's share of the weights' gradient, added up over the devices outside the manual part
        d_weight = _automatic(torch.stack(d_weights), layout).sum(0)
        return _automatic(torch.stack(d_rows), layout), d_weight, None, None, None, None, None


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, transposed: bool,
                   kernels: Kernels, layout: RowShards | None = None,
                   group_offset: torch.Tensor | None = None) -> torch.Tensor:
    """`GroupedMatmul` in autocast's dtype where autocast is on (a custom call is not cast by it;
    jax's kernel multiplies in bf16 only where both operands are bf16: megablox/common.py)."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        rows, weights = rows.to(dtype), weights.to(dtype)
    out: torch.Tensor = GroupedMatmul.apply(rows, weights, group_sizes, transposed, kernels, layout, group_offset)
    return out
