"""A causal LM's head and cross-entropy in chunks of tokens: the loss from the final hidden states
and the head's weight (and bias, and Gemma 2's final logit soft-capping) without ever holding the
whole [tokens x vocabulary] fp32 logits, their log-softmax or their gradient.

The forward pass computes one chunk's logits at a time (the matmul in the compute dtype: bf16
under bf16 autocast, the softmax and cross-entropy in fp32) and keeps only the per-token loss and
log-sum-exp; the backward pass computes each chunk's logits again and adds its share to the
gradients of the hidden states, the weight and the bias. At most one chunk's fp32 logits and their
gradient are alive at a time: 8 x chunk_tokens x vocabulary bytes, against 12 x tokens x
vocabulary for the whole head (measured on an H200, issue 44).

The same idea as Liger kernel's fused linear cross-entropy and TRL's chunked log-probabilities,
written for torch_xla too: the chunks are fixed by the shapes (no data-dependent branch, no
`.item()`), so XLA compiles one graph per shape; a last, shorter chunk takes the tokens that do not
fill a whole one.
"""

from typing import cast

import torch

IGNORE_INDEX = -100
CHUNK_TOKENS = 1024  # 1,024 tokens x 128,256 words: 0.5 GiB of fp32 logits a chunk


def _compute_dtype(x):
    """The matmul's dtype: autocast's where it is on for the tensor's device, else the tensor's own."""
    device_type = x.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        pass
    return x.dtype


def _chunk_logits(x, w, b, softcap, temperature=1.0):
    """One chunk's fp32 logits (soft-capped where asked, then divided by `temperature`) and, with
    soft-capping, tanh's value for the backward pass."""
    z = (x @ w.t()).float()  # a fresh buffer: the steps below work in place
    if b is not None:
        z = z.add_(b.float())
    t = None
    if softcap is not None:
        t = z.div_(softcap).tanh_()
        z = t * softcap
    return (z if temperature == 1 else z.div_(temperature)), t


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `hidden @ weight.T + bias` against `labels` ([tokens, hidden],
    [vocab, hidden], [vocab] or None, [tokens]); ignored tokens give 0."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, chunk, dtype, ignore_index, temperature=1.0):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias
            valid = labels != ignore_index
            target = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)
            losses, lses = [], []
            for start in range(0, hidden.shape[0], chunk):  # fixed by the shape
                z, _ = _chunk_logits(hidden[start:start + chunk].to(dtype), w, b, softcap, temperature)
                lse = torch.logsumexp(z, dim=-1)
                losses.append(lse - z.gather(1, target[start:start + chunk]).squeeze(1))
                lses.append(lse)
            loss = torch.where(valid, torch.cat(losses), torch.zeros((), dtype=torch.float32, device=hidden.device))
        ctx.save_for_backward(hidden, weight, bias, target, valid, torch.cat(lses))
        ctx.softcap, ctx.chunk, ctx.dtype, ctx.temperature = softcap, chunk, dtype, temperature
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, valid, lse = ctx.saved_tensors
        softcap, chunk, dtype, temperature = ctx.softcap, ctx.chunk, ctx.dtype, ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            scale = torch.where(valid, grad_loss.float(), torch.zeros((), dtype=torch.float32, device=hidden.device))
            grad_h, grad_w, grad_b = [], None, None
            for start in range(0, hidden.shape[0], chunk):
                stop = start + chunk
                x = hidden[start:stop].to(dtype)
                z, t = _chunk_logits(x, w, bias, softcap, temperature)
                # d(lse - z[target])/dz = softmax(z) - onehot(target), times the token's incoming gradient
                s = scale[start:stop, None]
                g = z.sub_(lse[start:stop, None]).exp_().mul_(s)  # in place: one chunk-sized buffer
                g = g.scatter_add_(1, target[start:stop], -s)
                if temperature != 1:  # the logits were divided by it
                    g = g.div_(temperature)
                if t is not None:  # z = cap * tanh(z0 / cap): dz/dz0 = 1 - tanh^2
                    g = g.mul_(t.mul_(t).neg_().add_(1))
                    del t
                if need_h:
                    grad_h.append((g.to(dtype) @ w).to(hidden.dtype))
                if need_w:  # summed in fp32, in place: no second [vocab, hidden] buffer in fp32
                    if grad_w is None:
                        grad_w = (g.t().to(dtype) @ x).float()
                    elif dtype == torch.float32:
                        grad_w.addmm_(g.t(), x)
                    else:
                        grad_w.add_(g.t().to(dtype) @ x)
                if need_b:
                    part = g.sum(0)
                    grad_b = part if grad_b is None else grad_b + part
        # grad_w and grad_b are set where needed: the loop ran at least once (forward's torch.cat did too)
        return (torch.cat(grad_h) if need_h else None,
                cast(torch.Tensor, grad_w).to(weight.dtype) if need_w else None,
                cast(torch.Tensor, grad_b).to(bias.dtype) if need_b else None,
                None, None, None, None, None, None)


def chunked_lm_loss(hidden, weight, labels, bias=None, softcap=None, chunk_tokens=CHUNK_TOKENS,
                    ignore_index=IGNORE_INDEX):
    """A causal LM's cross-entropy computed in chunks of `chunk_tokens` tokens.

    hidden: [rows, length, hidden] final hidden states (after the final norm); weight: the head's
    [vocab, hidden] weight; labels: [rows, length] token ids already shifted (the label at position
    t is the target of the hidden state at t), `ignore_index` where no loss is taken; bias: [vocab]
    or None; softcap: Gemma 2's final_logit_softcapping (logits = cap * tanh(logits / cap)) or None.

    Returns (loss_sum [rows] fp32: each row's cross-entropy summed over its trained tokens,
    tokens [rows] fp32: their number). Training takes loss_sum.sum() / tokens.sum(); evaluation
    keeps the rows. Both are differentiable as usual (the tokens need no gradient)."""
    losses = chunked_token_losses(hidden, weight, labels, bias, softcap, chunk_tokens, ignore_index)
    return losses.sum(-1), (labels != ignore_index).sum(-1).float()


def chunked_token_losses(hidden, weight, labels, bias=None, softcap=None, chunk_tokens=CHUNK_TOKENS,
                         ignore_index=IGNORE_INDEX, temperature=1.0):
    """`chunked_lm_loss`'s per-token cross-entropy, [rows, length] fp32 (0 where the label is
    `ignore_index`): minus each label's log-probability, for objectives that sum tokens their own
    way (a preference pair's two sequences apart). Differentiable as `chunked_lm_loss` is. With
    `temperature`, of the logits divided by it (after soft-capping): the distribution a sampler at
    that temperature drew from (TRL's GRPO computes its log-probabilities so)."""
    rows = labels.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    chunk = max(1, min(int(chunk_tokens), flat_hidden.shape[0]))
    losses = _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, softcap, chunk,
                                              _compute_dtype(flat_hidden), ignore_index, temperature)
    return losses.view(*rows, labels.shape[-1])


def chunked_entropy(hidden, weight, bias=None, softcap=None, chunk_tokens=CHUNK_TOKENS, temperature=1.0):
    """Each token's predictive entropy, [rows, length] fp32, from the head computed in chunks of
    tokens as `chunked_token_losses` computes it (the same logits), without gradients."""
    rows = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = max(1, min(int(chunk_tokens), flat.shape[0]))
    dtype = _compute_dtype(flat)
    out = []
    with torch.no_grad(), torch.autocast(flat.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, flat.shape[0], chunk):  # fixed by the shape
            logp = _chunk_logits(flat[start:start + chunk].to(dtype), w, bias, softcap, temperature)[0].log_softmax(-1)
            out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).view(*rows)


# The families whose causal-LM forward computes `logits = lm_head(hidden)`, soft-capped where the
# config's final_logit_softcapping says (transformers 5.24's modeling files, e.g.
# LlamaForCausalLM.forward, Gemma2ForCausalLM.forward). Others may rescale the logits after the head
# (Granite divides by logits_scaling, Cohere multiplies by logit_scale): they keep the whole head.
PLAIN_HEADS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                         "gemma3_text", "phi", "phi3", "gpt2", "starcoder2", "olmo2", "smollm3", "gpt_oss"})


def head_of(model):
    """(weight, bias or None, softcap or None) of a transformers causal LM's head (its output
    embeddings and its config's final_logit_softcapping), or None where the chunks could not
    compute what the model's own head does: a family outside PLAIN_HEADS, a head that is not a
    plain linear layer (peft's LoRA on lm_head), or one whose weight FSDP2 holds sharded between
    forward passes (a tied head)."""
    from torch.distributed.tensor import DTensor

    head = model.get_output_embeddings()
    if getattr(model.config, "model_type", None) not in PLAIN_HEADS or type(head) is not torch.nn.Linear:
        return None
    if isinstance(head.weight, DTensor):  # FSDP2's shard, outside the module's forward: the head computes it whole
        return None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return head.weight, head.bias, softcap
