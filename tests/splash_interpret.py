"""jax's splash attention with its real kernel, run on the CPU, as the package calls it on a TPU.

On a TPU, `xla_train.kernels.attention.splash_attention` hands torch_xla's `call_jax`
(torch_xla/core/xla_builder.py) the package's own jax functions, `splash_forward` and
`splash_backward` (jax.vjp of the forward), with the layer's tensors and static arguments (scale,
window, soft cap, block: `core.xla.splash_block`); call_jax lowers them, with jax 0.7.1's Mosaic
kernel inside, into the step's graph, which only a TPU executes. `interpreted` runs the same two
functions with the same arguments in jax's TPU interpret mode
(`jax.experimental.pallas.tpu.force_tpu_interpret_mode`), which checks blocks and shapes as the TPU
lowering does; it is the `run` argument of `splash_attention`, in call_jax's place. Tensors cross as
numpy arrays (fp32; bf16 through fp32, the values unchanged), as in tests/pallas_interpret.py."""

import functools

import numpy as np
import torch

CALLS = []  # every run's function name and arguments, in order (tests read what the package handed it)


def _to_jax(t):
    import jax.numpy as jnp

    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.detach().float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.detach().numpy())


def _to_torch(a):
    if a is None:
        return None
    a = np.asarray(a.astype("float32") if str(a.dtype) == "bfloat16" else a)
    return torch.from_numpy(a.copy())


@functools.cache
def _jitted(function, static):
    """jax.jit of `function` with its non-tensor arguments static, compiled once per shape, as call_jax
    lowers it (JaxCallable.specialize: jax.jit(...).lower for each shape and static values)."""
    import jax

    return jax.jit(function, static_argnums=static)


def interpreted(function, args, outputs):
    """call_jax's part: `function(*args)` with tensors as jax arrays, in TPU interpret mode; its
    output(s) as torch tensors in the dtypes of the inputs they stand for."""
    from jax.experimental.pallas import tpu as pltpu

    CALLS.append((function.__name__, args))
    jax_args = [_to_jax(a) if isinstance(a, torch.Tensor) else a for a in args]
    static = tuple(i for i, a in enumerate(args) if a is not None and not isinstance(a, torch.Tensor))
    with pltpu.force_tpu_interpret_mode():
        out = _jitted(function, static)(*jax_args)
    if outputs == 1:
        return _to_torch(out).to(args[0].dtype)
    like = (args[0], args[1], args[2], args[4])  # dq, dk, dv like q, k, v; dsinks like the sinks
    return tuple(None if o is None else _to_torch(o).to(t.dtype) for o, t in zip(out, like))
