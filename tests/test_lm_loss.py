"""The LM head and cross-entropy in chunks of tokens (xla_train/kernels/lm_loss.py): the loss and the
gradients of the hidden states, head weight and bias are the whole head's (fp32 within 1e-5, with
ignored tokens, soft-capping, chunks that do and do not divide the tokens), on the CPU and on
XLA:CPU (one graph), and the peak memory is below the whole head's."""

import pytest
import torch
import torch.nn.functional as F

from xla_train.kernels.lm_loss import chunked_entropy, chunked_lm_loss, chunked_token_losses
from xla_train.memory import measure_peak

ROWS, LENGTH, HIDDEN, VOCAB = 3, 10, 16, 50


def _inputs(bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    b = torch.randn(VOCAB, generator=g) if bias else None
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    labels[0, :4] = -100  # a prompt's tokens
    labels[2, 7:] = -100  # padding
    coef = torch.rand(ROWS, generator=g) + 0.5  # each row's loss weighted differently: per-row gradients
    leaves = [t.to(device).requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
    return leaves, labels.to(device), coef.to(device)


def _reference(hidden, weight, labels, bias=None, softcap=None):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return losses.sum(1), (labels != -100).sum(1).float()


def _loss_and_grads(fn, leaves, labels, coef, softcap, **kw):
    hidden, weight, *bias = leaves
    loss_sum, tokens = fn(hidden, weight, labels, bias[0] if bias else None, softcap=softcap, **kw)
    ((loss_sum * coef).sum() / tokens.sum()).backward()
    return [loss_sum.detach(), tokens] + [t.grad for t in leaves]


@pytest.mark.parametrize("chunk", [1, 7, 10, 16, 30, 64])  # 30 tokens: chunks that divide them and that do not
@pytest.mark.parametrize("bias,softcap", [(False, None), (True, None), (True, 3.0), (False, 30.0)])
def test_the_chunks_give_the_whole_heads_loss_and_gradients(chunk, bias, softcap):
    leaves, labels, coef = _inputs(bias)
    want = _loss_and_grads(_reference, leaves, labels, coef, softcap)
    leaves, labels, coef = _inputs(bias)
    got = _loss_and_grads(chunked_lm_loss, leaves, labels, coef, softcap, chunk_tokens=chunk)
    names = ["loss_sum", "tokens", "hidden", "weight", "bias"]
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    assert got[1].tolist() == [6.0, 10.0, 7.0]


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_a_temperature_divides_the_capped_logits_and_the_entropy_is_the_whole_heads(softcap):
    """GRPO's log-probabilities at its sampling temperature (TRL divides the logits by it): each
    token's loss and every gradient as the whole head's logits / temperature give them, soft-capped
    first; the chunks' entropy per token is the whole distribution's."""
    leaves, labels, coef = _inputs(True)
    hidden, weight, bias = leaves
    logits = hidden @ weight.t() + bias
    logits = (softcap * torch.tanh(logits / softcap) if softcap else logits) / 0.7
    want = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    (want * coef[:, None]).sum().backward()
    expected = [want.detach()] + [t.grad.clone() for t in leaves]
    logp = logits.detach().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    leaves, labels, coef = _inputs(True)
    got = chunked_token_losses(*leaves[:2], labels, leaves[2], softcap, chunk_tokens=7, temperature=0.7)
    (got * coef[:, None]).sum().backward()
    for g, w in zip([got.detach()] + [t.grad for t in leaves], expected):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_entropy(*[t.detach() for t in leaves[:2]], leaves[2].detach(), softcap,
                                               chunk_tokens=7, temperature=0.7), entropy, atol=1e-5, rtol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_an_all_ignored_row_counts_zero():
    leaves, labels, coef = _inputs(bias=False)
    hidden, weight = leaves
    weight.requires_grad_(False)
    labels[1] = -100
    loss_sum, tokens = chunked_lm_loss(hidden, weight, labels, chunk_tokens=8)
    assert loss_sum[1].item() == 0.0 and tokens[1].item() == 0.0
    loss_sum.sum().backward()
    assert weight.grad is None and hidden.grad[1].abs().max().item() == 0.0


def test_bf16_autocast_runs_the_matmul_in_bf16_and_the_loss_in_fp32():
    leaves, labels, coef = _inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(_reference, leaves, labels, coef, None)
    leaves, labels, coef = _inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(chunked_lm_loss, leaves, labels, coef, None, chunk_tokens=7)
    assert got[0].dtype == torch.float32
    assert [g.dtype for g in got[2:]] == [torch.float32] * 3  # fp32 master weights keep fp32 gradients
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    # bf16 hidden states (a bf16 model) give bf16 gradients
    hidden, weight, bias = (t.detach().bfloat16().requires_grad_() for t in leaves)
    loss_sum, _ = chunked_lm_loss(hidden, weight, labels, bias, chunk_tokens=7)
    loss_sum.sum().backward()
    assert loss_sum.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_the_chunked_heads_peak_is_below_the_whole_heads():
    """A vocabulary-heavy shape: 2,048 tokens x 30,522 words (the bundled vocabulary) x 64 wide.
    The whole head holds its fp32 logits, their log-softmax and gradient (about 12 x tokens x
    vocabulary bytes, 750 MB); 256-token chunks hold one chunk's (about 8 x 256 x vocabulary)."""
    torch.manual_seed(0)
    tokens, vocab, width = 2048, 30522, 64
    hidden = torch.randn(1, tokens, width, requires_grad=True)
    weight = (torch.randn(vocab, width) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))

    def step(fn, **kw):
        def run():
            loss_sum, count = fn(hidden, weight, labels, **kw)
            (loss_sum.sum() / count.sum()).backward()
            hidden.grad = weight.grad = None
        return run

    whole = measure_peak(step(_reference))
    chunked = measure_peak(step(chunked_lm_loss, chunk_tokens=256))
    logits = 4 * tokens * vocab
    assert whole >= 2.5 * logits  # logits, log-softmax and gradient at once
    assert chunked < 0.35 * logits < whole / 7, (chunked, whole)


@pytest.mark.xla
@pytest.mark.xla_in_process
def test_on_xla_the_chunks_give_the_same_loss_and_gradients_from_one_graph():
    import torch_xla
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    compiles = []
    for seed in (0, 1):  # new values, the same shapes: no new graph
        leaves, labels, coef = _inputs(True, seed)
        want = _loss_and_grads(_reference, leaves, labels, coef, 3.0)
        leaves, labels, coef = _inputs(True, seed, device)
        got = _loss_and_grads(chunked_lm_loss, leaves, labels, coef, 3.0, chunk_tokens=7)
        torch_xla.sync()
        got = [t.cpu() for t in got]
        compiles.append(met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert compiles[1] == compiles[0]
    assert not [c for c in met.counter_names() if c.startswith("aten::")]  # no op fell back to the CPU
