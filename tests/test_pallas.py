"""The Pallas path with its real kernels: jax's Pallas TPU flash attention, run in TPU interpret
mode on the CPU with the arguments and block sizes torch_xla 2.9's wrapper gives it
(tests/pallas_interpret.py says which), and jax's splash attention with the package's own jax
functions and arguments (tests/splash_interpret.py), against the mask path; and the rule the package
follows for the rows and layers it hands each kernel (xla_train.core.xla.flash_serves, pallas_layer)
against what jax accepts and skips, on jax's traces. Needs jax and torch_xla (make test's .venv: the
dev extra); splash needs flax too (torch_xla's call_jax: core.xla._splash_refusal)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("jax")
pytest.importorskip("torch_xla")

import pallas_interpret as P  # noqa: E402
import splash_interpret as SI  # noqa: E402
import tiny_decoders as td  # noqa: E402
from test_attention import SPLASH, _published, documents, loss_alone, model_of, needs_splash, packed_loss  # noqa: E402

from xla_train.core import xla as X  # noqa: E402
from xla_train.core.xla import flash_serves  # noqa: E402
from xla_train.kernels import attention as A


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


def splash(q, k, v, segment_ids, sinks=None, **kw):
    """The package's splash_attention with its jax functions run in TPU interpret mode."""
    return A.splash_attention(q, k, v, segment_ids, sinks, run=SI.interpreted, **kw)


class Watched:
    """torch_xla's flash_attention signature over the interpreted kernel, keeping each call's
    arguments (the kernel still computes the result)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, **kw):
        self.calls.append({"q": q, "k": k, "v": v, "causal": causal, "q_segment_ids": q_segment_ids,
                           "kv_segment_ids": kv_segment_ids, "sm_scale": sm_scale, **kw})
        return P.flash_attention(q, k, v, causal, q_segment_ids, kv_segment_ids, sm_scale, **kw)


# rows of 128, 256 and 384 tokens, each of 2-3 documents (the first row ends in padding)
ROWS = {128: [[40, 51, 20], [64, 39, 25]], 256: [[100, 90, 40], [128, 70, 58]], 384: [[150, 120, 90], [200, 100, 84]]}


@pytest.mark.parametrize("family, length, window", [
    ("llama", 128, None), ("qwen2", 256, None), ("gemma3", 128, 32),
    pytest.param("gemma3", 384, 48, marks=needs_splash), pytest.param("gptoss", 128, 32, marks=needs_splash),
    pytest.param("gemma2", 128, None, marks=needs_splash)])
def test_the_packed_loss_and_gradients_through_the_kernels(family, length, window):
    """A tiny model's packed rows through the Pallas path (its kernels interpreted, each layer where the
    rule sends it) against the mask path, fp32: the same loss (equal to the documents' one-by-one loss)
    and the same gradients. Llama's grouped-query heads repeated for flash, Qwen2's biases; Gemma 3's
    five sliding layers through splash (a window shorter than the documents) and its global layer
    through flash at 128 tokens, every layer through splash at 384, which flash refuses; gpt-oss's
    sinks (and their gradient) and windows through splash; Gemma 2's soft-capping through splash.
    Without flax the windowed layers take the mask path, as before."""
    rows = ROWS[length]
    docs, batch = documents(1, rows, length)
    results = {}
    SI.CALLS.clear()
    for attention in ("mask", "pallas"):
        model = model_of(family, window=window).train()
        flash = Watched()
        kw = {"device_kind": "xla-tpu", "kernels": {"flash": flash, "splash": splash}} if attention == "pallas" else {}
        loss = packed_loss(model, batch, attention, **kw)
        loss.backward()
        results[attention] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, flash, model)
    assert abs(results["pallas"][0] - results["mask"][0]) < 1e-5
    with torch.no_grad():
        assert abs(results["mask"][0] - loss_alone(results["mask"][3].eval(), docs)) < 1e-5
    for name, grad in results["mask"][1].items():
        torch.testing.assert_close(results["pallas"][1][name], grad, atol=2e-5, rtol=1e-4, msg=name)
    flash, model = results["pallas"][2], results["pallas"][3]
    config = model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    # each layer where the rule sends it (forward and backward splash calls: one each a layer)
    softcap = getattr(config, "attn_logit_softcapping", None)
    rule = {t: X.pallas_layer(length, model.model.layers[0].self_attn.head_dim,
                              window if t == "sliding_attention" else None, softcap, family == "gptoss").kernel
            for t in types}
    assert len(flash.calls) == sum(rule[t] == "flash" for t in types)
    assert len([c for c in SI.CALLS if c[0] == "splash_forward"]) == sum(rule[t] == "splash" for t in types)
    assert (family, length) != ("gemma3", 384) or set(rule.values()) == {"splash"}
    heads, head_dim = config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    for call in flash.calls:
        for name in ("q", "k", "v"):  # as many key/value heads as query heads
            assert tuple(call[name].shape) == (len(rows), heads, length, head_dim), name
        assert call["causal"] is True and "partition_spec" not in call
        for name in ("q_segment_ids", "kv_segment_ids"):  # float32 [batch, length], as test/test_pallas.py builds them
            assert call[name].dtype == torch.float32 and torch.equal(call[name], batch["segments"].float())
    for _, args in SI.CALLS:  # k and v as they are (grouped), int32 segment ids, the static arguments
        k, segment_ids, sinks, layer_window, softcap, block = args[1], args[3], args[4], *args[6:9]
        assert k.shape[1] == config.num_key_value_heads and segment_ids.dtype == torch.int32
        assert torch.equal(segment_ids, batch["segments"].int()) and block == X.splash_block(length)
        assert layer_window in (None, window) and softcap == getattr(config, "attn_logit_softcapping", None)
        assert (sinks is not None) == (family == "gptoss")
    if flash.calls and config.num_key_value_heads < heads:  # k repeated per group, in transformers' repeat_kv order
        k = flash.calls[0]["k"]
        groups = heads // config.num_key_value_heads
        assert torch.equal(k[:, 0], k[:, groups - 1])


@needs_splash
def test_splash_keeps_transformers_window_not_one_token_more():
    """Splash's LocalMask((w, w)) keeps q - k <= w, transformers' window q - k < w: the package passes
    window - 1 (splash_forward). The kernel with the layer's window gives the mask path's output within
    a window of 40; asked for a window one token longer (what LocalMask((w, w)) would keep) it differs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    segments = torch.ones(1, 256, dtype=torch.int32)
    segments[:, 150:] = 2
    scale = 16 ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=A.document_mask(segments, window=40), scale=scale)
    with torch.no_grad():
        exact = splash(q, k, v, segments, scale=scale, window=40)
        longer = splash(q, k, v, segments, scale=scale, window=41)
    torch.testing.assert_close(exact, ref, atol=1e-5, rtol=1e-5)
    assert (longer - ref).abs().max() > 1e-2


def splash_lowered(length, head_dim, window=None, heads=4, kv_heads=1):
    """The package's splash call (splash_forward, splash_backward) at rows of `length` tokens lowered for
    a TPU as call_jax lowers it (jax.jit(...).lower; here with lowering_platforms=("tpu",), no TPU needed):
    the Mosaic kernels' count in each, or the error jax raises. Pallas's TPU lowering checks the blocks
    against the shapes; what it leaves is Mosaic's compilation for the chip."""
    import jax
    import jax.numpy as jnp

    block = X.splash_block(length) if length % 128 == 0 else 128  # what jax says to 128 where the rule refuses
    S = jax.ShapeDtypeStruct
    q, k = S((2, heads, length, head_dim), jnp.bfloat16), S((2, kv_heads, length, head_dim), jnp.bfloat16)
    ids, sinks = S((2, length), jnp.int32), S((2, heads), jnp.float32)
    static = (0.1, window, None, block)
    calls = (lambda q, k, i, s: A.splash_forward(q, k, k, i, s, *static),
             lambda q, k, i, s: A.splash_backward(q, k, k, i, s, *static, q))
    try:
        return [jax.jit(f).trace(q, k, ids, sinks).lower(lowering_platforms=("tpu",)).as_text().count(
            "tpu_custom_call") for f in calls]
    except ValueError as e:
        return str(e)


def test_the_rule_agrees_with_splash_and_counts_its_blocks_as_jax_does():
    """The rule's splash lengths against jax's own checks (lowered for a TPU), with a window, sinks and
    grouped heads of 16 to 256; and the
    blocks the cost counts (core.xla._entries: blocks holding a kept pair, each whole) against the
    blocks splash's mask info keeps (process_mask's block_mask: empty blocks skipped), causal and
    windowed, for the package's blocks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import process_mask

    for length, head_dim, window in [(120, 64, None), (128, 64, None), (200, 64, 100), (384, 64, 100), (640, 16, 48),
                                     (1000, 64, None), (1152, 256, 512), (4096, 64, 128)]:
        lowered = splash_lowered(length, head_dim, window)
        if length % 128 == 0:  # the rule serves it: one kernel forward, the forward again and the fused pass backward
            assert lowered == [1, 2], (length, lowered)
        else:
            assert f"should divide q_seq_len={length}" in lowered
    for length, window in [(384, None), (384, 100), (1024, None), (1024, 128), (2048, 512), (4096, 128)]:
        block = X.splash_block(length)
        mask = sm.LocalMask((length, length), (window - 1, 0), 0) if window else sm.CausalMask((length, length))
        info, _ = process_mask(sm.MultiHeadMask((mask,)), (block, block))
        kept = int((info.block_mask > 0).sum()) if info.block_mask is not None else (length // block) ** 2
        assert X._entries(length, block, block, window) == kept * block * block, (length, window)


def test_no_layer_or_row_a_kernel_can_take_falls_back_at_4096_tokens():
    """The goal, the rule evaluated on the published configs: at 4,096-token rows every Gemma 3 1B and
    gpt-oss-20b layer (windows of 512 and 128, gpt-oss's sinks) has a kernel, and so has every DPO and
    GRPO row length a kernel can take (multiples of 128: a bucket plus completions, 128 + 256 = 384,
    padded pairs); lengths no kernel takes are named with the reason. With splash unavailable (no
    flax) the windowed layers and those rows are on the mask, as before."""
    kernel = A._kernels()[("xla-tpu", "pallas")]
    for family in ("gemma3", "gptoss"):
        plans = A.layer_plans(kernel, _published(family), 4096)
        assert all(plan.kernel == ("splash" if SPLASH else None) for w, (plan, n) in plans.items() if w), family
        assert sum(n for _, n in plans.values()) == _published(family).num_hidden_layers
    llama = _published("llama")
    for length in range(128, 4097, 128):  # DPO's and GRPO's rows up to 4,096
        served = {plan.kernel for plan, _ in A.layer_plans(kernel, llama, length).values()}
        assert None not in served or not SPLASH, length
    assert "not 200" in A.layer_plans(kernel, llama, 200)[None][0].reason


def test_the_memory_plan_counts_the_kernels_repeated_key_value_heads():
    from xla_train.memory import layer_bytes

    config = td.config("llama", 40, size=64)  # 4 query heads over 1 key/value head
    flash = layer_bytes(config, 1, 512, "fp32", attention="xla_flash", dense_mask=False)
    flex = layer_bytes(config, 1, 512, "fp32", attention="flex_attention", dense_mask=False)
    # per token: k and v at the query heads' width (3 more heads each) in fp32
    assert flash - flex == 2 * 3 * config.head_dim * 4 * 512
