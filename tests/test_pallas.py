"""The Pallas path with its real kernel: jax's Pallas TPU flash attention, run in TPU interpret
mode on the CPU with the arguments and block sizes torch_xla 2.9's wrapper gives it
(tests/pallas_interpret.py says which), against the mask path; and the rule the package
follows for the rows it hands the kernel (xla_train.core.xla.flash_serves) against what jax
accepts, on jax's traces. Needs jax and torch_xla (make test's .venv: the dev extra)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("jax")
pytest.importorskip("torch_xla")

import pallas_interpret as P  # noqa: E402
import tiny_decoders as td  # noqa: E402
from test_attention import documents, loss_alone, model_of, packed_loss  # noqa: E402

from xla_train.core import attention as A  # noqa: E402
from xla_train.core.xla import flash_serves  # noqa: E402


def accepted(length, head_dim, batch=2, heads=2):
    """Whether jax's kernel takes rows of `length` tokens with torch_xla's blocks, forward and
    backward with segment ids (traced, not run: jax.eval_shape in TPU interpret mode)."""
    jax, jnp, pltpu, fa = P._jax()
    FlashAttention, _ = P._wrapper()
    f = P.forward_blocks(batch, length, length)
    dq, dkv = P.backward_blocks(length, length)
    block = max(f["block_k_major"], f["block_k"])
    kv_length = -(-length // block) * block  # the wrapper pads k and v to the block, not the segment ids
    S = jax.ShapeDtypeStruct
    q, k = S((batch, heads, length, head_dim), jnp.float32), S((batch, heads, kv_length, head_dim), jnp.float32)
    segments = fa.SegmentIds(q=S((batch, length), jnp.int32), kv=S((batch, length), jnp.int32))
    rows = S((batch, heads, length), jnp.float32)
    common = {"sm_scale": 1.0, "causal": True, "mask_value": FlashAttention.DEFAULT_MASK_VALUE, "debug": False}
    args = (q, k, segments, rows)  # abstract: eval_shape traces each call with them
    calls = [lambda q, k, s, r: fa._flash_attention_impl(q, k, k, None, s, True, True, 1.0, f["block_b"], f["block_q"],
                                                         f["block_k_major"], f["block_k"], False),
             lambda q, k, s, r: fa._flash_attention_bwd_dq(q, k, k, None, s, r, r, q, r, **dq, **common),
             lambda q, k, s, r: fa._flash_attention_bwd_dkv(q, k, k, None, s, r, r, q, r, **dkv, **common)]
    with pltpu.force_tpu_interpret_mode():
        for call in calls:
            try:
                jax.eval_shape(call, *args)
            except (ValueError, TypeError, NotImplementedError):
                return False
    return True


def test_the_rows_handed_to_the_kernel_are_the_rows_it_takes():
    """Every row length the package can choose up to 2,048 (multiples of 8: buckets, packed rows)
    with 64-wide heads, the multiples of 128 with heads of 192 and 256, and beyond 2,048 the
    multiples of 128 up to 8,192: the package's rule agrees with jax's checks at each."""
    cases = [(n, 64) for n in range(8, 2049, 8)] + [(n, d) for n in range(128, 2049, 128) for d in (192, 256)]
    cases += [(n, 128) for n in range(2048 + 128, 8193, 128)]
    disagree = [(n, d) for n, d in cases if accepted(n, d) != flash_serves(n, d)]
    assert not disagree
    assert [n for n, d in cases if d == 64 and flash_serves(n, d)] == [128, 256, 512, 1024, 2048]


@pytest.mark.parametrize("length, head_dim", [(1024, 16), (2048, 8)])
def test_long_rows_through_the_kernel_equal_the_mask(length, head_dim):
    """Forward and backward at 1,024 and 2,048 tokens (several kv blocks, the dq pass's 1,024
    rows), three documents and padding a row: outputs and q, k, v gradients as sdpa with the
    documents' mask gives them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, length, head_dim, requires_grad=True) for _ in range(3))
    segments = torch.ones(2, length)
    segments[:, length // 3:] = 2
    segments[:, length // 2 + 5:] = 3
    segments[1, -37:] = 0
    out = P.flash_attention(q, k, v, True, segments, segments, head_dim ** -0.5)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = A.document_mask(segments)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=1e-4, rtol=1e-4)


class Watched:
    """torch_xla's flash_attention signature over the interpreted kernel, keeping each call's
    arguments (the kernel still computes the result)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, **kw):
        self.calls.append({"q": q, "k": k, "v": v, "causal": causal, "q_segment_ids": q_segment_ids,
                           "kv_segment_ids": kv_segment_ids, "sm_scale": sm_scale, **kw})
        return P.flash_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, **kw)


# rows of 128 and 256 tokens, each of 2-3 documents (the first row ends in padding)
ROWS = {128: [[40, 51, 20], [64, 39, 25]], 256: [[100, 90, 40], [128, 70, 58]]}


@pytest.mark.parametrize("family, length", [("llama", 128), ("qwen2", 256), ("gemma3", 128)])
def test_the_packed_loss_and_gradients_through_the_kernel(family, length):
    """A tiny model's packed rows through the Pallas path (its kernel interpreted) against the
    mask path, fp32: the same loss (equal to the documents' one-by-one loss) and the same
    gradients. Llama's grouped-query heads repeated for the kernel, Qwen2's biases, Gemma 3's
    five sliding layers (a window of 32, a quarter of the row) on the mask path and its global
    layer through the kernel."""
    rows = ROWS[length]
    window = length // 4 if family == "gemma3" else None
    docs, batch = documents(1, rows, length)
    results = {}
    for attention in ("mask", "pallas"):
        model = model_of(family, window=window).train()
        kernel = Watched()
        kw = {"device_kind": "xla-tpu", "kernel": kernel} if attention == "pallas" else {}
        loss = packed_loss(model, batch, attention, **kw)
        loss.backward()
        results[attention] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, kernel, model)
    assert abs(results["pallas"][0] - results["mask"][0]) < 1e-5
    with torch.no_grad():
        assert abs(results["mask"][0] - loss_alone(results["mask"][3].eval(), docs)) < 1e-5
    for name, grad in results["mask"][1].items():
        torch.testing.assert_close(results["pallas"][1][name], grad, atol=2e-5, rtol=1e-4, msg=name)
    kernel, model = results["pallas"][2], results["pallas"][3]
    config = model.config
    global_layers = sum(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"] *
                        config.num_hidden_layers)
    assert len(kernel.calls) == global_layers  # the windowed layers took the mask path
    heads, head_dim = config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    for call in kernel.calls:
        for name in ("q", "k", "v"):  # as many key/value heads as query heads
            assert tuple(call[name].shape) == (len(rows), heads, length, head_dim), name
        assert call["causal"] is True and "partition_spec" not in call
        for name in ("q_segment_ids", "kv_segment_ids"):  # float32 [batch, length], as test/test_pallas.py builds them
            assert call[name].dtype == torch.float32 and torch.equal(call[name], batch["segments"].float())
    if config.num_key_value_heads < heads:  # k repeated per group, in transformers' repeat_kv order
        k = kernel.calls[0]["k"]
        groups = heads // config.num_key_value_heads
        assert torch.equal(k[:, 0], k[:, groups - 1])


def test_the_memory_plan_counts_the_kernels_repeated_key_value_heads():
    from xla_train.memory import layer_bytes

    config = td.config("llama", 40, size=64)  # 4 query heads over 1 key/value head
    flash = layer_bytes(config, 1, 512, "fp32", attention="xla_flash", dense_mask=False)
    flex = layer_bytes(config, 1, 512, "fp32", attention="flex_attention", dense_mask=False)
    # per token: k and v at the query heads' width (3 more heads each) in fp32
    assert flash - flex == 2 * 3 * config.head_dim * 4 * 512
