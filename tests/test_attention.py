"""Packed documents kept apart without an L x L mask (xla_train.kernels.attention): the 4-D mask is the
reference; FlexAttention (eager here, compiled on CUDA) must compute the same losses and
gradients; sliding windows are kept per layer type; which path each device takes. The Pallas
path runs its real kernel in tests/test_pallas.py."""

import copy
import importlib.util

import pytest
import tiny_decoders as td
import torch
import torch.nn.functional as F
from conftest import run_python

import gpu_fallback.device  # noqa: F401  (declares flex on CUDA and the CPU)
import xla_train.core.xla  # noqa: F401  (declares pallas on a TPU through torch_xla)
from xla_train.core.errors import UserError
from xla_train.kernels import attention as A

# The TPU's Pallas kernel needs jax (make test's .venv has it; make test-torch's .venv-torch not):
# without it `auto` takes the mask on a TPU too (test_without_jax_a_tpu_takes_the_mask)
JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not JAX, reason="the Pallas kernel needs jax (make test's .venv has it)")
# splash goes through torch_xla's call_jax, whose torchax imports flax (core.xla._splash_refusal)
SPLASH = JAX and importlib.util.find_spec("flax") is not None
needs_splash = pytest.mark.skipif(not SPLASH, reason="splash needs jax and flax (make test's .venv has them)")

IGNORE = -100
VOCAB = 40
LENGTH = 64
ROWS = [[13, 21, 9], [30, 17, 11]]  # document lengths per packed row (the first row ends in padding)


def model_of(family, seed=0, window=None, **size):
    """`family`'s tiny decoder; `window`: its sliding window, where the family has one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = td.config(family, VOCAB, bos=1, eos=2, **size)
    if window:
        cfg.sliding_window = window
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def documents(seed=0, rows=ROWS, length=LENGTH):
    """Token ids of every document, and the packed batch: input_ids, labels (shifted, IGNORE at
    each document's end and on padding), position_ids (from 0 per document), segments."""
    g = torch.Generator().manual_seed(seed)
    docs, batch = [], {k: torch.zeros(len(rows), length, dtype=torch.long) for k in
                       ("input_ids", "labels", "position_ids", "segments")}
    batch["labels"].fill_(IGNORE)
    for r, lengths in enumerate(rows):
        at = 0
        for n, length in enumerate(lengths, 1):
            ids = torch.randint(3, VOCAB, (length,), generator=g)
            docs.append(ids)
            batch["input_ids"][r, at:at + length] = ids
            batch["labels"][r, at:at + length - 1] = ids[1:]
            batch["position_ids"][r, at:at + length] = torch.arange(length)
            batch["segments"][r, at:at + length] = n
            at += length
    return docs, batch


def packed_loss(model, batch, attention, **kw):
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    extra = A.document_inputs(model, batch["segments"], attention=attention, **kw)
    logits = model(**inputs, **extra).logits.float()
    total = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
    return total / (batch["labels"] != IGNORE).sum()


def loss_alone(model, docs):
    """The documents' token-weighted loss, each run alone (no mask: plain causal attention)."""
    total, n = 0.0, 0
    for ids in docs:
        logits = model(input_ids=ids[None]).logits.float()[0]
        total += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        n += len(ids) - 1
    return total / n


# ---------------------------------------------------------------------------------------------
# Semantics: packed == one by one, flex == mask


# gpt-oss's attention sinks keep the mask path (test_sinks_keep_the_mask_path)
@pytest.mark.parametrize("family, attention", [(f, a) for f in ["llama", "qwen2", "gemma2", "mistral", *td.LATE_2026]
                                               for a in ("mask", "flex") if (f, a) != ("gptoss", "flex")])
def test_packed_loss_equals_the_documents_losses_one_by_one(family, attention):
    """fp32: 2-3 documents in a row give their one-by-one loss within 1e-5 (GQA, tied
    embeddings, Qwen2's biases, Gemma 2's soft-capping and sliding layers, Mistral's window; the
    late-2026 families: Qwen3's q/k norms and wide heads, Gemma 3's 5:1 layers, SmolLM3's layers
    without RoPE, Phi-4-mini's fused projections and LongRoPE, OLMo-2's post-norms, Granite's
    multipliers, the experts of Qwen3-MoE, Mixtral and gpt-oss)."""
    model = model_of(family)
    docs, batch = documents()
    with torch.no_grad():
        together = float(packed_loss(model, batch, attention))
        alone = loss_alone(model, docs)
    assert abs(together - alone) < 1e-5, (together, alone)
    switched = A.switched(model.config)
    assert switched == (attention == "flex")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_flex_gradients_equal_the_mask_paths(family):
    """Training: the same loss and the same gradients (fp32) through flex as through the mask."""
    _, batch = documents(1)
    grads = {}
    for attention in ("mask", "flex"):
        model = model_of(family).train()
        try:
            loss = packed_loss(model, batch, attention)
            loss.backward()
        except NotImplementedError as e:  # torch 2.13: "FlexAttention does not support backward on CPU"
            pytest.skip(str(e))
        grads[attention] = (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert abs(grads["mask"][0] - grads["flex"][0]) < 1e-5
    for name, g in grads["mask"][1].items():
        torch.testing.assert_close(grads["flex"][1][name], g, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow  # torch.compile in pytest's process (docs/tests.md: marked by hand)
def test_compiled_flex_equals_the_mask_path():
    """torch.compile(flex_attention) and a compiled block mask (what CUDA runs) on the CPU."""
    model = model_of("llama")
    _, batch = documents(2)
    with torch.no_grad():
        reference = float(packed_loss(model, batch, "mask"))
        compiled = float(packed_loss(model, batch, "flex", compiled=True))
    assert abs(compiled - reference) < 1e-5, (compiled, reference)


@pytest.mark.parametrize("family, attention", [
    ("gemma2", "mask"), ("gemma2", "flex"), ("gemma3", "mask"), ("gemma3", "flex"), ("mistral", "mask"),
    ("mistral", "flex"), ("gptoss", "mask")])
def test_rows_four_times_the_window_give_the_one_by_one_loss(family, attention):
    """A sliding window of a quarter of the row: packed documents longer than it (21, 30 and 17
    tokens against 16) give their one-by-one loss, the model applying its window alone; each
    layer type gets its own mask (Gemma 2/3, gpt-oss) or one windowed mask serves every layer
    (Mistral)."""
    window = LENGTH // 4
    model = model_of(family, window=window)
    docs, batch = documents()
    with torch.no_grad():
        together = float(packed_loss(model, batch, attention))
        alone = loss_alone(model, docs)
    assert abs(together - alone) < 1e-5, (together, alone)
    if attention == "mask":
        mask = A.document_inputs(model, batch["segments"], attention="mask")["attention_mask"]
        if getattr(model.config, "layer_types", None):
            assert set(mask) == set(model.config.layer_types)
            assert not torch.equal(mask["sliding_attention"], mask["full_attention"])
        else:
            assert torch.is_tensor(mask)


def test_sinks_keep_the_mask_path_where_no_kernel_takes_them():
    """gpt-oss hands its attention sinks to the attention function (s_aux): flex does not take them,
    splash does (a TPU: tests/test_pallas.py runs it), flash does not."""
    model = model_of("gptoss")
    assert A.choose("auto", "cuda", model, LENGTH) == "mask"
    with pytest.raises(UserError, match="sinks"):
        A.choose("flex", "cpu", model)
    assert A.choose("auto", "xla-tpu", model, 128) == ("pallas" if SPLASH else "mask")


def test_a_sliding_window_shorter_than_the_row_is_applied():
    """flex honours the family's window where it is shorter than the row, as transformers' own
    windowed mask does."""
    model = model_of("mistral")
    model.config.sliding_window = 4
    _, batch = documents(3)
    segments = batch["segments"]
    with torch.no_grad():
        extra = A.document_inputs(model, segments, attention="flex")
        assert set(extra["documents"].masks) == {None, 4}
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **extra).logits
        window = A.document_mask(segments)
        q, kv = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    attention_mask=window & (q - kv < 4)).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_the_switched_model_runs_its_former_attention_without_documents():
    """After a flex forward the model is DOCUMENT_ATTENTION, and a call without documents
    (generation, a padded batch with a 2-D mask) computes what the model computed before."""
    model = model_of("qwen2")
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as generation pads
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        _, batch = documents()
        packed_loss(model, batch, "flex")
        assert A.switched(model.config)
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert "xla_train" not in model.config.to_json_string()  # nothing of the switch is saved with the model
    with torch.no_grad():  # nor lost in a copy (a reference model, an EMA): it runs the same former attention
        assert torch.equal(copy.deepcopy(model)(input_ids=ids, attention_mask=mask).logits, before)


def test_the_mask_path_is_todays_mask_and_eager_gets_a_bias():
    segments = torch.tensor([[1, 1, 2, 2, 0]])
    mask = A.document_mask(segments)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                   [0, 0, 0, 0, 1]]
    bias = A.document_mask(segments, eager=True)
    assert bias.dtype == torch.float32 and bool(((bias == 0) == mask).all())
    assert float(bias.min()) == torch.finfo(torch.float32).min
    model = model_of("gemma2")  # eager (no sdpa for soft-capping)
    extra = A.document_inputs(model, segments, attention="mask")
    assert set(extra) == {"attention_mask"} and extra["attention_mask"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Which path


@pytest.mark.parametrize("kind, family, length, path", [
    pytest.param("xla-tpu", "llama", 128, "pallas", marks=needs_jax),  # torch_xla on a TPU
    pytest.param("xla-tpu", "qwen2", 1024, "pallas", marks=needs_jax),
    # the global layers; the local ones take the mask
    pytest.param("xla-tpu", "gemma3", 2048, "pallas", marks=needs_jax),
    ("xla-tpu", "llama", 64, "mask"),  # rows no kernel's blocks take
    ("xla-tpu", "llama", 200, "mask"),
    pytest.param("xla-tpu", "llama", 384, "pallas", marks=needs_splash),  # splash: any multiple of 128
    pytest.param("xla-tpu", "llama", 1536, "pallas", marks=needs_splash),
    pytest.param("xla-tpu", "gemma2", 128, "pallas", marks=needs_splash),  # soft-capping: splash has it
    ("xla-tpu", "gpt2", 128, "mask"),  # attention dropout 0.1
    ("xla", "llama", 128, "mask"),  # XLA:CPU: the reference
    ("cuda", "llama", 64, "flex"),
    ("cuda", "gemma2", 64, "flex"),  # soft-capping as a score_mod
    ("cuda", "gpt2", 64, "mask"),
    ("cpu", "llama", 64, "mask"),  # the CPU keeps its pinned losses
    ("tpu", "llama", 128, "mask"),  # TorchTPU
])
def test_auto_chooses_per_device(kind, family, length, path):
    assert A.choose("auto", kind, model_of(family), length) == path


@needs_jax
def test_the_mask_path_is_said_once_where_the_device_has_a_kernel():
    model = model_of("llama")
    assert "not pallas" in A.fallback_note("auto", "xla-tpu", model, 200)
    assert "not 200" in A.fallback_note("auto", "xla-tpu", model, 200)
    assert A.fallback_note("auto", "xla-tpu", model, 512) is None
    assert A.fallback_note("auto", "cpu", model, 200) is None  # the CPU has no kernel for auto
    assert A.fallback_note("mask", "xla-tpu", model, 200) is None


@pytest.mark.skipif(JAX, reason="jax is installed here; make test-torch's .venv-torch has none")
def test_without_jax_a_tpu_takes_the_mask():
    model = model_of("llama")
    assert A.choose("auto", "xla-tpu", model, 512) == "mask"
    assert "needs jax" in A.fallback_note("auto", "xla-tpu", model, 512)
    with pytest.raises(UserError, match="needs jax"):
        A.choose("pallas", "xla-tpu", model, 512)
    assert A.row_length("auto", "xla-tpu", model.config, 768, packed=True) == 768


@needs_jax
def test_an_explicit_path_that_cannot_serve_says_why():
    with pytest.raises(UserError, match="pallas.*TPU"):
        A.choose("pallas", "cpu", model_of("llama"))
    with pytest.raises(UserError, match="dropout"):
        A.choose("pallas", "xla-tpu", model_of("gpt2"), 128)
    with pytest.raises(UserError, match="dropout"):
        A.choose("flex", "cpu", model_of("gpt2"))
    with pytest.raises(UserError, match="none of"):
        A.choose("splash", "cpu", model_of("llama"))
    with pytest.raises(UserError, match="not 200"):
        A.choose("pallas", "xla-tpu", model_of("llama"), 200)
    assert A.choose("mask", "xla-tpu", model_of("llama")) == "mask"
    assert A.choose("flex", "cpu", model_of("llama")) == "flex"
    assert A.choose("pallas", "xla-tpu", model_of("mistral", window=32), 128) == "pallas"  # windowed: splash


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_an_xla_cpu_tensor_is_not_a_tpu():
    import torch_xla

    assert A.kind_of(torch.zeros(2, device=torch_xla.device())) == "xla"
    assert A.kind_of(torch.zeros(2)) == "cpu"


# ---------------------------------------------------------------------------------------------
# Pallas under SPMD (the kernel itself: tests/test_pallas.py)


SPMD_SCRIPT = """
import torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
from xla_train.kernels import attention as A
spec, mesh = A._spmd_layout()


def forward(q, k, v, segment_ids, sinks, scale, window, softcap, block):  # jax: each row's and head's own values
    return q * scale + k.mean(axis=1, keepdims=True) + v + segment_ids[:, None, :, None] + sinks[:, :, None, None]


def backward(q, k, v, segment_ids, sinks, scale, window, softcap, block, do):
    return do * scale, do.sum(axis=1, keepdims=True), do, None if sinks is None else do.sum(axis=(2, 3))


torch.manual_seed(0)
q, k, v, do = torch.randn(4, 2, 8, 4), torch.randn(4, 1, 8, 4), torch.randn(4, 2, 8, 4), torch.randn(4, 2, 8, 4)
segments, sinks = torch.randint(0, 3, (4, 8), dtype=torch.int32), torch.randn(4, 2)
on = []
for t in (q, k, v, segments, sinks, do):
    on.append(t.to(torch_xla.device()))
    xs.mark_sharding(on[-1], mesh, (spec[0],) + (None,) * (t.dim() - 1))
out = A._run_jax(forward, (*on[:5], 0.5, None, None, 128), 1)
print("forward", torch.allclose(out.cpu(), q * 0.5 + k.mean(1, keepdim=True) + v + segments[:, None, :, None]
                                + sinks[:, :, None, None]))
grads = A._run_jax(backward, (*on[:5], 0.5, None, None, 128, on[5]), 4)
print("backward", torch.allclose(grads[1].cpu(), do.sum(1, keepdim=True)),
      torch.allclose(grads[3].cpu(), do.sum((2, 3))))
grads = A._run_jax(backward, (*on[:4], None, 0.5, None, None, 128, on[5]), 4)
print("no sinks", grads[3] is None, torch.allclose(grads[0].cpu(), do * 0.5))
print(spec, mesh.mesh_shape, mesh.axis_names)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_under_spmd_the_kernel_gets_the_batch_split_by_rows(tmp_path):
    """SPMD on 4 XLA:CPU devices: partition_spec ("data", None, None, None) over a 1-D mesh of
    every device, as test/test_pallas_spmd.py passes it. Splash's call (`_run_jax`: torch_xla's
    call_jax under its manual sharding, custom_kernel._shard_map) runs each device's rows, segment ids
    and sinks and puts the outputs back whole, forward and backward, with and without sinks: shown with
    a jax function of the kernel's signature in the kernel's place (the Mosaic kernel runs on a TPU
    only; interpreted, call_jax refuses its host callbacks)."""
    import os

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = run_python(["-c", SPMD_SCRIPT], env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-4:] == [
        "forward True", "backward True True", "no sinks True True", "('data', None, None, None) (4,) ('data',)"]


# ---------------------------------------------------------------------------------------------
# Row lengths the kernel serves


def _published(family):
    """`family`'s config at its published size (FLOPs depend on it)."""
    from transformers import CONFIG_MAPPING

    entry = dict(td.ZOO[family]["config"])
    entry = {k: v for k, v in entry.items() if not k.endswith("token_id")}
    return CONFIG_MAPPING[entry["model_type"]].from_dict(entry)


@needs_splash
def test_rows_are_rounded_up_only_where_the_count_says_cheaper():
    """Rows no kernel serves are rounded up to the next length one does (splash: a multiple of 128)
    only where that costs fewer FLOPs than the mask path at their length (core.xla.attention_cost: each
    layer's kernel with its blocks and recomputations against every score of the mask, a first-order
    count). Packed rows (added tokens are documents) for Gemma 3 1B's and gpt-oss-20b's sizes: 600 ->
    640, and gpt-oss's 1,100 -> 1,152; Llama-3.2-1B's short rows cost fewer FLOPs on the mask (the
    kernels compute their diagonal blocks whole, and the backward computes the scores again); padded
    rows (added tokens are padding) stay."""
    llama, gemma3, gptoss = _published("llama"), _published("gemma3"), _published("gptoss")
    assert [A.row_length("auto", "xla-tpu", llama, n, packed=True) for n in (100, 384, 1000, 1536, 2048)] == [
        100, 384, 1000, 1536, 2048]
    assert [A.row_length("auto", "xla-tpu", gemma3, n, packed=True) for n in (600, 1100)] == [640, 1100]
    assert [A.row_length("auto", "xla-tpu", gptoss, n, packed=True) for n in (600, 1100)] == [640, 1152]
    assert A.row_length("mask", "xla-tpu", gemma3, 600, packed=True) == 600
    for kind in ("xla", "cpu", "cuda", "tpu"):  # no kernel that refuses lengths there
        assert A.row_length("auto", kind, gemma3, 600, packed=True) == 600
    assert [A.row_length("auto", "xla-tpu", llama, n, packed=False) for n in (200, 1000, 1020)] == [200, 1000, 1020]
    line = A.row_lengths_line("auto", "xla-tpu", [600], [640])
    assert "600 -> 640" in line and "pallas" in line
    assert A.row_lengths_line("auto", "xla-tpu", [512], [512]) is None


def test_the_padding_share_of_buckets():
    from xla_train.core.shapes import Padding
    from xla_train.job import padding_share

    assert padding_share(Padding("buckets", [4, 8]), [2, 4, 6, 8]) == pytest.approx(4 / 24)  # 2 -> 4, 6 -> 8
    assert padding_share(Padding("buckets", [8]), [8, 8]) == 0.0


def test_layers_no_kernel_serves_are_said_on_the_console(monkeypatch):
    """A path whose rule (Kernel.layer) serves the full layers but not the windowed ones (a TPU
    without flax: flash only) names those layers and why, once."""
    from xla_train.core.roles import KERNELS, Kernel, LayerPlan

    def rule(length, head_dim, window, softcap, sinks):
        return LayerPlan(None, "no window here", 6) if window else LayerPlan("flash", None, 4)

    monkeypatch.setitem(KERNELS, ("xla-tpu", "pallas"), Kernel("pallas", auto=True, layer=rule))
    model = model_of("gemma3", window=16)
    note = A.fallback_note("auto", "xla-tpu", model, LENGTH)
    assert note == f"attention: layers with a window of 16 on the mask path ({LENGTH} x {LENGTH} per row): " \
        "no window here"
    assert A.choose("auto", "xla-tpu", model, LENGTH) == "pallas"
    assert A.fallback_note("auto", "xla-tpu", model_of("llama"), LENGTH) is None


@needs_jax
def test_a_jax_other_than_0_7_is_refused_in_one_line(monkeypatch):
    """torch_xla 2.9's Pallas wrappers call private functions of jax 0.7.1: another installed jax
    (its version as importlib.metadata reports it) keeps `auto` on the mask, said in one line."""
    import importlib.metadata

    from xla_train.core import xla as X

    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.8.1" if name == "jax" else version(name))
    X._jax_refusal.cache_clear()
    X.pallas_layer.cache_clear()
    try:
        model = model_of("llama")
        assert A.choose("auto", "xla-tpu", model, 512) == "mask"
        note = A.fallback_note("auto", "xla-tpu", model, 512)
        assert "jax 0.7.1" in note and "jax 0.8.1 is installed" in note and "\n" not in note
        with pytest.raises(UserError, match="jax 0.8.1"):
            A.choose("pallas", "xla-tpu", model, 512)
    finally:
        X._jax_refusal.cache_clear()
        X.pallas_layer.cache_clear()
