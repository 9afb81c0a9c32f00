"""torch_xla 2.9's megablox grouped matmul with its real kernels, run on the CPU.

torch_xla's wrappers (torch_xla/experimental/custom_kernel.py, `gmm` and `tgmm`) hand jax's kernels
(jax/experimental/pallas/ops/tpu/megablox/gmm.py) to `torch_xla.core.xla_builder.call_jax`, whose
Mosaic custom call only a TPU executes (on XLA:CPU inside `force_tpu_interpret_mode` it stops at
"XLA type not supported: 17"). The jax functions themselves run here in jax's TPU interpret mode.
`KERNELS` has the wrappers' signatures (`xla_train.kernels.megablox.Kernels`) and makes the calls
they make, with the arguments they pass to call_jax:

- gmm(lhs, rhs, group_sizes, tiling, group_offset, transpose_rhs): tm = min(tiling[0], m), tk and tn
  as given; jax's `gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=(tm, tk, tn),
  group_offset, transpose_rhs=transpose_rhs)`;
- tgmm(lhs [k, m], rhs [m, n], group_sizes, tiling, group_offset, num_actual_groups=None): each tile
  at most its dimension; jax's `tgmm(lhs, rhs, group_sizes, lhs.dtype, (tm, tk, tn), group_offset,
  num_actual_groups)`.

Tensors cross as numpy arrays (fp32; bf16 through fp32, the values unchanged)."""

import importlib

import numpy as np
import torch

from xla_train.kernels.megablox import Kernels


def _jax():
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    # the module, not megablox/__init__'s `gmm` (ops.gmm, a custom_vjp over it)
    return jnp, pltpu, importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _to_jax(t):
    jnp = _jax()[0]
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.detach().float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.detach().numpy())


def _to_torch(a, dtype):
    return torch.from_numpy(np.asarray(a.astype("float32") if str(a.dtype) == "bfloat16" else a).copy()).to(dtype)


def _dtype(t):
    jnp = _jax()[0]
    return jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32


def gmm(lhs, rhs, group_sizes, tiling=None, group_offset=None, transpose_rhs=False):
    """torch_xla 2.9's `gmm`, its kernel interpreted (the package always passes a tiling)."""
    jnp, pltpu, mb = _jax()
    tm, tk, tn = tiling
    with pltpu.force_tpu_interpret_mode():
        out = mb.gmm(_to_jax(lhs), _to_jax(rhs), _to_jax(group_sizes), _dtype(lhs), (min(tm, lhs.shape[0]), tk, tn),
                     _to_jax(group_offset), transpose_rhs=transpose_rhs)
    return _to_torch(out, lhs.dtype)


def tgmm(lhs, rhs, group_sizes, tiling=(512, 512, 512), group_offset=None, num_actual_groups=None):
    """torch_xla 2.9's `tgmm`, its kernel interpreted."""
    jnp, pltpu, mb = _jax()
    k, m, n = lhs.shape[0], lhs.shape[1], rhs.shape[1]
    tiles = (min(tiling[0], m), min(tiling[1], k), min(tiling[2], n))
    with pltpu.force_tpu_interpret_mode():
        out = mb.tgmm(_to_jax(lhs), _to_jax(rhs), _to_jax(group_sizes), _dtype(lhs), tiles, _to_jax(group_offset),
                      num_actual_groups)
    return _to_torch(out, lhs.dtype)


KERNELS = Kernels(gmm, tgmm)
