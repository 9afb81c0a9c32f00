"""The memory plan: what each device holds for the model, its gradients and AdamW's state (exact,
from the parameters' shapes, dtypes and how the strategy lays them out), an estimate of the
activations, and the device's memory where the backend can tell. Printed at the start of every
run, written to the metrics JSON as `memory`, and checked before the first step compiles.
"""

import os

from .core.errors import UserError
from .core.peaks import experts_of
from .kernels.lm_loss import CHUNK_TOKENS
from .parallel.tensor_parallel import kv_heads_per_device

DEVICE_BYTES = "XLA_TRAIN_DEVICE_BYTES"  # the device's memory, where the backend cannot tell (or to plan for another)
MIB, GIB = 2**20, 2**30


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert", "deberta", "deberta-v2",
            "gpt2")  # families whose MLP is one activation between two linears (not gated)
O_S_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "xla_sdpa", "xla_flash")
NATIVE_GQA = ("flash_attention_2", "flash_attention_3", "flex_attention")  # K and V never copied per query head


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    return default


def shape_of(config):
    """The sizes the plan reads from a transformers config (with its family's flags): hidden width,
    layers, query and key/value heads (GQA), head width, the MLP's width and kind, the vocabulary."""
    hidden = _get(config, "hidden_size", "n_embd", "dim", default=0)
    heads = _get(config, "num_attention_heads", "n_head", default=1)
    head_dim = _get(config, "head_dim", default=hidden // heads if heads else 0)
    return {"hidden": hidden, "layers": _get(config, "num_hidden_layers", "n_layer", default=0), "heads": heads,
            "kv_heads": _get(config, "num_key_value_heads", default=heads), "head_dim": head_dim,
            "intermediate": _get(config, "intermediate_size", "n_inner", default=4 * hidden),
            "gated": getattr(config, "model_type", None) not in ENCODERS,
            "vocab": _get(config, "vocab_size", default=0)}


def layer_bytes(config, rows, length, precision="fp32", attention="sdpa", dense_mask=True, param_bytes=4, tensor=1,
                experts=None):
    """Bytes one block keeps for its backward pass: what autograd saves, tensor by tensor, for
    `rows` rows of `length` tokens, the matmuls in bf16 under bf16 autocast (else in the weights'
    dtype, `param_bytes` a value), the residual stream in the weights' dtype. Per token:
    - each of the two norms (RMSNorm, LayerNorm): its input, its fp32 normalised value and its
      output as the next matmul reads it;
    - attention: the rotated queries, keys and values (copied to every query head where the path
      repeats them: eager, or sdpa when a mask is passed, for transformers then drops enable_gqa),
      the kernel's output and its contiguous copy for o_proj, an fp32 log-sum-exp a head; eager
      attention (and only it) keeps the fp32 softmax and its cast, heads x length values a token;
      a dense 4-D mask passed to sdpa becomes a bias in the compute dtype that every block keeps;
    - the MLP: gated (Llama's) gate, activation, up and product; else two intermediate values; a
      mixture of experts' by the implementation its experts run (`experts`, transformers' name;
      None: the config's): `_experts_bytes`.
    Checked against torch's profiler on the CPU within a few percent (tests/test_memory.py).
    Split over `tensor` devices (--tensor-parallel): a device keeps its heads' attention values and
    its share of the MLP's; the norms and the residual stream stay whole on each."""
    d = shape_of(config)
    h, heads, kv, hd, inter = d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], d["intermediate"]
    heads, kv, inter = heads // tensor, kv_heads_per_device(kv, tensor), inter // tensor
    if not h or not d["layers"]:
        return None
    c = 2 if precision == "bf16" else param_bytes  # what the matmuls write
    r = param_bytes
    q_width = heads * hd
    # K and V repeated to the query heads: by eager attention and sdpa with a dense mask, and by
    # the Pallas path (kernels.attention.Documents._pallas: torch_xla's flash attention takes as many)
    repeated = kv < heads and (attention not in NATIVE_GQA) and (
        attention not in O_S_ATTENTION or dense_mask or attention == "xla_flash")
    kv_width = q_width if repeated else kv * hd
    per_token = 2 * (r * h + 4 * h + c * h)  # two norms
    per_token += c * (q_width + 2 * kv_width + 2 * q_width)  # q, k, v, the kernel's output and o_proj's input
    if attention in O_S_ATTENTION:
        per_token += 4 * heads  # log-sum-exp
        if dense_mask and attention.endswith("sdpa"):
            per_token += c * length  # the mask made a bias, [rows, 1, length, length], in every block
    else:  # eager (or math): the fp32 softmax, and its cast where the matmul reads another dtype
        per_token += heads * length * (4 + (c if c != 4 else 0))
    if experts_of(config):
        per_token += _experts_bytes(config, c, r, h, experts)
    else:
        per_token += (4 if d["gated"] else 2) * c * inter
    return int(per_token * rows * length)


def _experts_bytes(config, c, r, h, implementation=None):
    """What a mixture of experts' layer keeps per token, by the implementation its experts run
    (config._experts_implementation): the router's fp32 logits and probabilities, and a gated MLP's
    four values an expert wide (gate and up, the activation, the product; gpt-oss's gate seven) for
    each expert the token passes through: its top-k (transformers' grouped_mm and eager, the
    package's xla_grouped, with each (token, expert) pair's gathered input and output, 2 x hidden),
    or every expert (xla_dense, which runs them all, and keeps their products weighted by the
    routing too, one more value each). batched_mm gathers a copy of its experts' weights for every pair besides
    (kernels/experts.py). The experts are kept whole under --tensor-parallel (tensor_parallel.KEPT_WHOLE)."""
    experts, top_k, width, _ = experts_of(config)
    implementation = implementation or getattr(config, "_experts_implementation", None)
    router = 2 * 4 * experts
    # gpt-oss's clamped, interleaved gate keeps 7 values an expert wide (measured within 1%: benchmarks/bench_moe.py)
    kept = 7 if getattr(config, "model_type", "") == "gpt_oss" else 4
    if implementation == "xla_dense":
        return router + experts * (kept + 1) * c * width
    pairs = top_k * (kept * c * width + 2 * c * h)
    if implementation == "batched_mm":
        pairs += top_k * 3 * h * width * r
    return router + pairs


def activation_estimate(config, rows, length, precision="fp32", checkpointed=False, attention="sdpa",
                        dense_mask=True, param_bytes=4, tensor=1, experts=None):
    """Bytes of activations the backward pass finds kept: every block's (`layer_bytes`) and the final
    norm's; checkpointed (full recomputation), each block's input only (the residual stream, in
    the weights' dtype) and the final norm's; the block recomputed in the backward pass is the
    plan's `layer_bytes`, counted where it lives (beside the gradients)."""
    one = layer_bytes(config, rows, length, precision, attention, dense_mask, param_bytes, tensor, experts)
    if one is None:
        return None
    d = shape_of(config)
    c = 2 if precision == "bf16" else param_bytes
    tokens, h = rows * length, d["hidden"]
    final_norm = tokens * (param_bytes * h + 4 * h + c * h)
    if checkpointed:
        return int(d["layers"] * param_bytes * h * tokens + final_norm)
    return int(d["layers"] * one + final_norm)


def logit_bytes(config, rows, length, precision="fp32", chunked=False, chunk_tokens=CHUNK_TOKENS, head_grad_bytes=0):
    """Bytes of a causal LM's head and loss at their peak, at the start of the backward pass.
    Whole: the logits the model returns (held by its output), their fp32 log-softmax, its gradient
    and the logits' gradient: 16 x tokens x vocabulary bytes in fp32 (torch's profiler on the CPU),
    12 in bf16 (measured on an H200, issue 44). Chunked (kernels/lm_loss.py): one chunk's fp32 logits
    and their gradient, the head's weight gradient, which the chunks add to from the start of the
    backward pass, and under bf16 a chunk's bf16 share of it."""
    d = shape_of(config)
    vocab, tokens = d["vocab"], rows * length
    if not vocab:
        return None
    if chunked:
        return int(8 * min(chunk_tokens, tokens) * vocab + head_grad_bytes
                   + (2 * vocab * d["hidden"] if precision == "bf16" else 0))
    return (12 if precision == "bf16" else 16) * tokens * vocab


def _linear_weights(model):
    """The elements of the fp32 linear weights, which bf16 autocast copies to bf16 for its matmuls
    (and autograd keeps for the backward pass); weights held in bf16 already (--lora's frozen
    base) are used as they are."""
    import torch

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen and m.weight.dtype == torch.float32:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def plan(model, rows, length, precision="fp32", shards=1, device_bytes=None, checkpointed=False, logits=False,
         attention="sdpa", chunked_logits=False, dense_mask=True, chunk_tokens=CHUNK_TOKENS, reference=None,
         cache_tokens=0, reference_copy=False, tensor=1, experts=None):
    """The memory plan of `model` trained with AdamW on `rows` rows of `length` tokens per device,
    its parameters split over `shards` devices (1: every device holds them all), its blocks'
    activations `checkpointed` (recomputed in the backward pass) or kept, computed through the
    `attention` implementation (transformers' name: sdpa, eager, flash_attention_2, ...), with a
    dense 4-D mask passed or not; with `logits`, a vocabulary's logits per token (a causal LM's),
    computed whole or in chunks of `chunk_tokens` (`chunked_logits`); with `reference` ("chunked"
    or "whole"), a second forward pass in the step without gradients (DPO's reference: the model
    with its adapters disabled), whose output lives until the step's backward pass ends: its
    final hidden states, or its whole logits, in the compute dtype. (While it runs, that pass
    also holds every block's output, which transformers returns with the hidden states, beside
    the policy's activations; the plan leaves this moment out: the chunked head's logits, in the
    backward pass, outweigh it for the vocabularies of LLMs.) With `cache_tokens`, a generation in
    the step (GRPO's rollout) holds a key/value cache of that many tokens a row (a sliding layer's
    only its window where shorter: kernels.generate.cache_slots), in the weights' dtype, before the
    update's forward pass begins: a peak of its own (`cache_bytes`). With
    `reference_copy`, a frozen copy of the weights, sharded like them (`reference_param_bytes`).
    Under --tensor-parallel, the `rows` are a tensor group's, whose `tensor` devices split each
    block's heads and MLP columns (`layer_bytes`) and the key/value cache's heads. `experts`: the
    implementation a mixture of experts' experts will run (kernels.experts.planned_experts; None: the
    model's own), which sets what their layers keep.

    The peak (`peak_bytes_estimate`): parameters + AdamW's state + the larger of what the backward
    pass begins with (the activations, the logits at their peak and, under bf16 autocast, the bf16
    copies of the weights the matmuls saved) and what it ends with (the gradients, one block's
    activations, and checkpointed, the blocks' inputs)."""
    from .kernels.generate import cache_slots

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_bytes = params[0].element_size() if params else 4
    config = model.config
    experts = experts or _experts_name(model)
    acts = activation_estimate(config, rows, length, precision, checkpointed, attention, dense_mask, param_bytes,
                               tensor, experts)
    one = layer_bytes(config, rows, length, precision, attention, dense_mask, param_bytes, tensor, experts)
    head = model.get_output_embeddings() if logits and hasattr(model, "get_output_embeddings") else None
    head_grad = (head.weight.numel() * head.weight.element_size()
                 if head is not None and head.weight.requires_grad else 0)
    grads = -(-tensor_bytes(trainable) // shards)
    d = shape_of(config)
    width = {"chunked": d["hidden"], "whole": d["vocab"]}.get(reference, 0)
    out = {
        "param_bytes_total": tensor_bytes(params),
        "param_bytes_per_device": -(-tensor_bytes(params) // shards),
        "reference_param_bytes": -(-tensor_bytes(params) // shards) if reference_copy else 0,
        "grad_bytes_per_device": grads,
        "optimizer_bytes_per_device": -(-2 * tensor_bytes(trainable) // shards),  # AdamW: exp_avg, exp_avg_sq
        "activation_bytes_estimate": acts,
        "layer_bytes": one,
        "logit_bytes": (logit_bytes(config, rows, length, precision, chunked_logits, chunk_tokens, head_grad)
                        if logits else None),
        # sharded like the weights; checkpointed, one block's copies live at a time (recomputed)
        "autocast_copy_bytes": (2 * _linear_weights(model) // shards
                                // (max(1, d["layers"]) if checkpointed else 1)
                                if precision == "bf16" else 0),
        "reference_bytes": rows * length * width * (2 if precision == "bf16" else param_bytes),
        "cache_bytes": 2 * kv_heads_per_device(d["kv_heads"], tensor) * d["head_dim"] * rows * param_bytes
        * (sum(cache_slots(config.get_text_config(decoder=True), cache_tokens)) if cache_tokens else 0),
        "attention": attention,
        "experts": experts,
        "chunked_logits": bool(logits and chunked_logits),
        "gradient_checkpointing": checkpointed,
        "device_bytes": device_bytes,
        "peak_bytes": None,
    }
    out["peak_bytes_estimate"] = needed(out)
    return out, {"trainable_params": sum(p.numel() for p in trainable), "total_params": sum(p.numel() for p in params)}


def _experts_name(model):
    """The implementation a mixture of experts' experts run (kernels.experts), None for a dense model."""
    from .kernels.experts import experts_implementation

    return experts_implementation(model)


def plan_on_paper(cfg, config, shards, device_bytes):
    """The plan a decoder run `cfg` (options.TrainOptions of a causal-lm or grpo recipe) makes on a
    TPU for a model of `config` (a transformers config) with its weights sharded over `shards`
    devices of `device_bytes` each, without weights or a device: the model on torch's meta device,
    its adapters and bf16 base as job.prepare makes them, the Pallas kernel's attention, a mixture
    of experts' grouped matmul (kernels/experts.py, xla_grouped), the chunked head (GRPO: rows a
    completion longer, and the rollout's cache). Returns (plan, counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .kernels.experts import XLA_GROUPED
    from .models import add_adapters, hold_frozen_in_bf16

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.lora:
        model = add_adapters(model, cfg.section("model"), "CAUSAL_LM")
        if cfg.precision == "bf16":
            hold_frozen_in_bf16(model)
    completion = getattr(cfg.kind_options(), "max_completion_length", 0)  # a kind that rolls out completions
    length = cfg.max_length + completion
    return plan(model, cfg.batch_size, length, cfg.precision, shards=shards, device_bytes=device_bytes,
                checkpointed=cfg.gradient_checkpointing, logits=True, attention="xla_flash", dense_mask=False,
                chunked_logits=True, cache_tokens=length if completion else 0, tensor=cfg.tensor_parallel,
                experts=XLA_GROUPED if _experts_name(model) else None)


def needed(memory):
    """Bytes per device at the plan's peak: parameters + optimizer state + the larger of the
    backward pass's start (activations, logits, autocast's weight copies) and its end (gradients
    and one block's activations, the blocks' inputs too where checkpointed), with a reference
    pass's output at both; or, where it is larger, a generation's key/value cache in the step."""
    start = sum(memory.get(k) or 0 for k in ("activation_bytes_estimate", "logit_bytes", "autocast_copy_bytes",
                                             "reference_bytes"))
    end = sum(memory.get(k) or 0 for k in ("grad_bytes_per_device", "layer_bytes", "reference_bytes"))
    if memory.get("gradient_checkpointing"):
        end += memory.get("activation_bytes_estimate") or 0
    rollout = memory.get("cache_bytes") or 0
    weights = memory["param_bytes_per_device"] + (memory.get("reference_param_bytes") or 0)
    return weights + memory["optimizer_bytes_per_device"] + max(start, end, rollout)


def checkpointing_needed(kept, checkpointed):
    """Whether gradient checkpointing must be switched on: the plan of the run as asked (`kept`)
    exceeds the device's memory and the plan with every block checkpointed fits. Returns (the
    decision, the console line that says so, or None)."""
    device = kept.get("device_bytes")
    if not device or kept.get("gradient_checkpointing") or needed(kept) <= device or needed(checkpointed) > device:
        return False, None
    return True, (f"memory plan: {needed(kept) / GIB:.2f} GiB per device with every block's activations kept, more "
                  f"than the device's {device / GIB:.2f} GiB; {needed(checkpointed) / GIB:.2f} GiB with gradient "
                  "checkpointing, which is switched on (--gradient-checkpointing)")


def device_bytes(accelerator):
    """The device's memory: XLA_TRAIN_DEVICE_BYTES if set, else what the accelerator can tell, else None."""
    given = os.environ.get(DEVICE_BYTES)
    if given:
        try:
            return int(float(given))
        except ValueError:
            raise UserError(f"{DEVICE_BYTES} must be a number of bytes, not {given!r}") from None
    return accelerator.device_memory()


def describe(memory, counts):
    def mib(key):
        return f"{memory[key] / MIB:.1f} MiB" if memory[key] is not None else "unknown"

    device = f"{memory['device_bytes'] / GIB:.1f} GiB" if memory["device_bytes"] else "unknown"
    return (f"memory plan per device: parameters {mib('param_bytes_per_device')} (of {mib('param_bytes_total')}), "
            f"gradients {mib('grad_bytes_per_device')}, optimizer {mib('optimizer_bytes_per_device')}, "
            f"activations ~{mib('activation_bytes_estimate')}"
            f"{' (checkpointed)' if memory.get('gradient_checkpointing') else ''}"
            f"{', logits ' + mib('logit_bytes') if memory.get('logit_bytes') else ''}"
            f"{' (chunked)' if memory.get('chunked_logits') else ''}"
            f"{', reference pass ' + mib('reference_bytes') if memory.get('reference_bytes') else ''}"
            f"{', reference weights ' + mib('reference_param_bytes') if memory.get('reference_param_bytes') else ''}"
            f"{', generation cache ' + mib('cache_bytes') if memory.get('cache_bytes') else ''}"
            f"{', experts ' + memory['experts'] if memory.get('experts') else ''}"
            f", peak ~{needed(memory) / MIB:.1f} MiB; "
            f"device {device}; "
            f"{counts['trainable_params']:,} of {counts['total_params']:,} parameters trained")


def check_fits(memory, batch_size, length, checkpointed=False, sharded=False, adapters=False):
    """Stops the run before anything compiles when the plan exceeds the device's memory, naming
    what would make it fit and is not on yet."""
    if memory["device_bytes"] and needed(memory) > memory["device_bytes"]:
        remedies = [f"a smaller --batch-size (now {batch_size})", f"--max-length (batches of up to {length} tokens)"]
        remedies += [] if checkpointed else ["--gradient-checkpointing"]
        remedies += [] if sharded else ["--strategy fsdp (the model sharded over the devices)"]
        remedies += [] if adapters else ["--lora (gradients and AdamW state for adapters only)"]
        raise UserError(f"the memory plan needs {needed(memory) / GIB:.2f} GiB per device, more than the device's "
                        f"{memory['device_bytes'] / GIB:.2f} GiB: try {', '.join(remedies[:-1])} or {remedies[-1]}")


def measure_peak(fn):
    """Bytes that `fn()` allocates at most above what was allocated when it started, on the CPU:
    torch's profiler records every allocation and free of the CPU allocator in order (the same
    numbers every run, unlike the process's resident size)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
                    if e.name() == "[memory]")
    now = peak = 0
    for _, _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak
