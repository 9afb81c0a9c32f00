"""Packed documents kept apart without an L x L mask (xla_train.core.attention): the 4-D mask is the
reference; FlexAttention (eager here, compiled on CUDA) must compute the same losses and
gradients; the Pallas path (TPU only) is checked for its choice and for the arguments it hands
torch_xla's flash_attention, through a recording kernel."""

import copy
import importlib.util

import pytest
import tiny_decoders as td
import torch
import torch.nn.functional as F

from xla_train.core import attention as A
from xla_train.core.errors import UserError

IGNORE = -100
VOCAB = 40
LENGTH = 64
ROWS = [[13, 21, 9], [30, 17, 11]]  # document lengths per packed row (the first row ends in padding)


def model_of(family, seed=0, **size):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = td.config(family, VOCAB, bos=1, eos=2, **size)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def documents(seed=0):
    """Token ids of every document, and the packed batch: input_ids, labels (shifted, IGNORE at
    each document's end and on padding), position_ids (from 0 per document), segments."""
    g = torch.Generator().manual_seed(seed)
    docs, batch = [], {k: torch.zeros(len(ROWS), LENGTH, dtype=torch.long) for k in
                       ("input_ids", "labels", "position_ids", "segments")}
    batch["labels"].fill_(IGNORE)
    for r, lengths in enumerate(ROWS):
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral"])
@pytest.mark.parametrize("attention", ["mask", "flex"])
def test_packed_loss_equals_the_documents_losses_one_by_one(family, attention):
    """fp32: 2-3 documents in a row give their one-by-one loss within 1e-5 (GQA, tied
    embeddings, Qwen2's biases, Gemma 2's soft-capping and sliding layers, Mistral's window)."""
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


def test_compiled_flex_equals_the_mask_path():
    """torch.compile(flex_attention) and a compiled block mask (what CUDA runs) on the CPU."""
    model = model_of("llama")
    _, batch = documents(2)
    with torch.no_grad():
        reference = float(packed_loss(model, batch, "mask"))
        compiled = float(packed_loss(model, batch, "flex", compiled=True))
    assert abs(compiled - reference) < 1e-5, (compiled, reference)


def test_a_sliding_window_shorter_than_the_row_is_applied():
    """flex honours the family's window where it is shorter than the row (the mask path, like
    transformers with a given 4-D mask, does not: the task refuses such --max-length)."""
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


@pytest.mark.parametrize("kind, family, path", [
    ("xla-tpu", "llama", "pallas"),  # torch_xla on a TPU
    ("xla-tpu", "qwen2", "pallas"),
    ("xla-tpu", "gemma2", "mask"),  # soft-capping: flash attention has none
    ("xla-tpu", "gpt2", "mask"),  # attention dropout 0.1
    ("xla", "llama", "mask"),  # XLA:CPU: the reference
    ("cuda", "llama", "flex"),
    ("cuda", "gemma2", "flex"),  # soft-capping as a score_mod
    ("cuda", "gpt2", "mask"),
    ("cpu", "llama", "mask"),  # the CPU keeps its pinned losses
    ("tpu", "llama", "mask"),  # TorchTPU
])
def test_auto_chooses_per_device(kind, family, path):
    assert A.choose("auto", kind, model_of(family), LENGTH) == path


def test_an_explicit_path_that_cannot_serve_says_why():
    with pytest.raises(UserError, match="pallas.*TPU"):
        A.choose("pallas", "cpu", model_of("llama"))
    with pytest.raises(UserError, match="soft-caps"):
        A.choose("pallas", "xla-tpu", model_of("gemma2"))
    with pytest.raises(UserError, match="dropout"):
        A.choose("flex", "cpu", model_of("gpt2"))
    with pytest.raises(UserError, match="none of"):
        A.choose("splash", "cpu", model_of("llama"))
    with pytest.raises(UserError, match="sliding window"):
        model = model_of("mistral")
        model.config.sliding_window = 32
        A.choose("pallas", "xla-tpu", model, LENGTH)
    assert A.choose("mask", "xla-tpu", model_of("llama")) == "mask"
    assert A.choose("flex", "cpu", model_of("llama")) == "flex"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_an_xla_cpu_tensor_is_not_a_tpu():
    import torch_xla

    assert A.kind_of(torch.zeros(2, device=torch_xla.device())) == "xla"
    assert A.kind_of(torch.zeros(2)) == "cpu"


# ---------------------------------------------------------------------------------------------
# Pallas: the arguments its kernel gets (the kernel itself runs on a TPU only)


class Recorder:
    """Stands for torch_xla's flash_attention: records each call and answers what the kernel
    computes (causal within each segment id) with sdpa, so the forward completes."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, **kw):
        self.calls.append({"q": q, "k": k, "v": v, "causal": causal, "q_segment_ids": q_segment_ids,
                           "kv_segment_ids": kv_segment_ids, "sm_scale": sm_scale, **kw})
        positions = torch.arange(q.shape[2])
        mask = (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]) & (
            positions[:, None] >= positions[None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_pallas_gets_the_arguments_torch_xlas_tests_use(family):
    model = model_of(family)
    config = model.config
    docs, batch = documents()
    kernel = Recorder()
    with torch.no_grad():
        together = float(packed_loss(model, batch, "pallas", device_kind="xla-tpu", kernel=kernel))
        alone = loss_alone(model, docs)
    assert abs(together - alone) < 1e-5  # the recorded arguments mean the reference's semantics
    assert len(kernel.calls) == config.num_hidden_layers
    heads, head_dim = config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    for call in kernel.calls:
        # q, k, v [batch, heads, length, head_dim]; as many key/value heads as query heads (GQA
        # and multi-query repeated)
        for name in ("q", "k", "v"):
            assert tuple(call[name].shape) == (len(ROWS), heads, LENGTH, head_dim), name
        assert call["causal"] is True
        # segment ids: float32 [batch, length], as test/test_pallas.py builds them; q's and kv's the same
        for name in ("q_segment_ids", "kv_segment_ids"):
            assert call[name].dtype == torch.float32 and tuple(call[name].shape) == (len(ROWS), LENGTH)
            assert torch.equal(call[name], batch["segments"].float())
        assert call["sm_scale"] == pytest.approx(model.model.layers[0].self_attn.scaling)
        assert "partition_spec" not in call  # outside SPMD the kernel gets none
    if config.num_key_value_heads < heads:  # k repeated per group, in transformers' repeat_kv order
        k = kernel.calls[0]["k"]
        groups = heads // config.num_key_value_heads
        assert torch.equal(k[:, 0], k[:, groups - 1]) and (groups == heads or not torch.equal(k[:, 0], k[:, groups]))


SPMD_SCRIPT = """
import torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
from xla_train.core import attention as A
spec, mesh = A._spmd_layout()
print(spec, mesh.mesh_shape, mesh.axis_names)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_under_spmd_the_kernel_gets_the_batch_split_by_rows(tmp_path):
    """SPMD on 4 XLA:CPU devices: partition_spec ("data", None, None, None) over a 1-D mesh of
    every device, as test/test_pallas_spmd.py passes it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run([sys.executable, "-c", SPMD_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "('data', None, None, None) (4,) ('data',)"
