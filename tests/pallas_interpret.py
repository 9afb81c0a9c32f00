"""torch_xla 2.9's Pallas flash attention with its real kernel, run on the CPU.

torch_xla's wrapper (torch_xla/experimental/custom_kernel.py, `flash_attention` ->
`FlashAttention.apply`) traces jax's kernel functions with the arguments below and hands the
lowered Mosaic kernel to `torch_xla._XLAC._xla_tpu_custom_call`, which only a TPU executes. The
jax functions themselves run here in jax's TPU interpret mode
(`jax.experimental.pallas.tpu.force_tpu_interpret_mode`), which checks blocks and shapes as the
TPU lowering does. `InterpretedFlash` makes the wrapper's calls, in its order, with its block
sizes (`FlashAttention.DEFAULT_BLOCK_SIZES`, read from torch_xla itself) and its padding of k and
v (`_pad_to_block_size`):

- forward, `_fa_custom_forward_single_device`: `_flash_attention_impl(q, k, v, None, segment_ids,
  save_residuals=True, causal, sm_scale, block_b=min(2, batch), block_q=min(512, L),
  block_k_major=min(512, L), block_k=min(512, L), debug=False)`, keeping o, l and m;
- backward, `_fa_custom_backward_single_device`: di = sum(o * do) in fp32, then
  `_flash_attention_bwd_dq(..., block_q_major=min(1024, L), block_k_major=min(512, L),
  block_k=min(256, L))` and `_flash_attention_bwd_dkv(..., block_q_major=min(512, L),
  block_k_major=min(512, L), block_k=min(512, L), block_q=min(512, L))`, with
  `FlashAttention.DEFAULT_MASK_VALUE`.

Segment ids go to jax as `SegmentIds(q=[batch, L], kv=[batch, L])`; torch_xla passes the same
arrays broadcast to the lanes (`prepare_segment_ids`), which jax's functions broadcast themselves.
Tensors cross as numpy arrays (fp32; bf16 through fp32, the values unchanged)."""

import numpy as np
import torch


def _jax():
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    return jax, jnp, pltpu, fa


def _wrapper():
    from torch_xla.experimental.custom_kernel import FlashAttention, _pad_to_block_size

    return FlashAttention, _pad_to_block_size


def forward_blocks(batch, q_len, kv_len):
    """The forward's block sizes as `_fa_custom_forward_single_device` computes them."""
    sizes = _wrapper()[0].DEFAULT_BLOCK_SIZES
    return {"block_b": min(sizes["block_b"], batch), "block_q": min(sizes["block_q"], q_len),
            "block_k_major": min(sizes["block_k_major"], kv_len), "block_k": min(sizes["block_k"], kv_len)}


def backward_blocks(q_len, kv_len):
    """The backward's block sizes as `_fa_custom_backward_single_device` computes them."""
    s = _wrapper()[0].DEFAULT_BLOCK_SIZES
    return ({"block_q_major": min(s["block_q_dq"], q_len), "block_k_major": min(s["block_k_major_dq"], kv_len),
             "block_k": min(s["block_k_dq"], kv_len)},
            {"block_q_major": min(s["block_q_major_dkv"], q_len), "block_k_major": min(s["block_k_major_dkv"], kv_len),
             "block_k": min(s["block_k_dkv"], kv_len), "block_q": min(s["block_q_dkv"], q_len)})


def _to_jax(t):
    jnp = _jax()[1]
    dtype = jnp.bfloat16 if t.dtype == torch.bfloat16 else None
    array = jnp.asarray(t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy())
    return array.astype(dtype) if dtype is not None else array


def _to_torch(a, dtype):
    return torch.from_numpy(np.asarray(a.astype("float32") if str(a.dtype) == "bfloat16" else a).copy()).to(dtype)


def _segments(q_segment_ids, kv_segment_ids):
    fa = _jax()[3]
    return fa.SegmentIds(q=_to_jax(q_segment_ids).astype("int32"), kv=_to_jax(kv_segment_ids).astype("int32"))


def forward(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, save_residuals=True):
    """The forward as the wrapper runs it: (o, l, m) as torch tensors ([batch, heads, L, d], and
    l, m [batch, heads, L] where saved)."""
    jax, jnp, pltpu, fa = _jax()
    FlashAttention, pad = _wrapper()
    blocks = forward_blocks(q.shape[0], q.shape[2], k.shape[2])
    k, padded = pad(k, max(blocks["block_k_major"], blocks["block_k"]), 2)
    if padded:
        v, _ = pad(v, max(blocks["block_k_major"], blocks["block_k"]), 2)
    segment_ids = _segments(q_segment_ids, kv_segment_ids) if q_segment_ids is not None else None
    with pltpu.force_tpu_interpret_mode():
        out = fa._flash_attention_impl(_to_jax(q), _to_jax(k), _to_jax(v), None, segment_ids, save_residuals, causal,
                                       sm_scale, blocks["block_b"], blocks["block_q"], blocks["block_k_major"],
                                       blocks["block_k"], False)
    if not save_residuals:
        return _to_torch(out, q.dtype), None, None
    o, lse_l, lse_m = out  # l and m [batch, heads, L]: jax's impl takes lane 0 of the kernel's, as the wrapper does
    return _to_torch(o, q.dtype), _to_torch(lse_l, torch.float32), _to_torch(lse_m, torch.float32)


def backward(do, q, k, v, o, lse_l, lse_m, causal, q_segment_ids, kv_segment_ids, sm_scale):
    """The backward as the wrapper runs it: (dq, dk, dv)."""
    jax, jnp, pltpu, fa = _jax()
    FlashAttention, _ = _wrapper()
    di = torch.sum(o.float() * do.float(), dim=-1)  # [batch, heads, L], as the wrapper computes grad_i
    dq_blocks, dkv_blocks = backward_blocks(q.shape[2], k.shape[2])
    segment_ids = _segments(q_segment_ids, kv_segment_ids) if q_segment_ids is not None else None
    args = [_to_jax(t) for t in (q, k, v)] + [None, segment_ids] + [_to_jax(t) for t in (lse_l, lse_m, do, di)]
    common = {"sm_scale": sm_scale, "causal": causal, "mask_value": FlashAttention.DEFAULT_MASK_VALUE, "debug": False}
    with pltpu.force_tpu_interpret_mode():
        dq, _ = fa._flash_attention_bwd_dq(*args, **dq_blocks, **common)
        dk, dv = fa._flash_attention_bwd_dkv(*args, **dkv_blocks, **common)
    return _to_torch(dq, q.dtype), _to_torch(dk, k.dtype), _to_torch(dv, v.dtype)


class InterpretedFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale):
        o, lse_l, lse_m = forward(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse_l, lse_m, q_segment_ids, kv_segment_ids)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse_l, lse_m, q_segment_ids, kv_segment_ids = ctx.saved_tensors
        dq, dk, dv = backward(do.contiguous(), q, k, v, o, lse_l, lse_m, ctx.causal, q_segment_ids, kv_segment_ids,
                              ctx.sm_scale)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *, ab=None,
                    partition_spec=None, mesh=None):
    """torch_xla's `flash_attention` signature (custom_kernel.py), its kernel interpreted on the CPU."""
    assert ab is None and partition_spec is None and mesh is None, "interpreted: one device, no bias"
    return InterpretedFlash.apply(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale)
