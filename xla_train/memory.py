"""The memory plan: what each device holds for the model, its gradients and AdamW's state (exact,
from the parameters' shapes, dtypes and how the strategy lays them out), an estimate of the
activations, and the device's memory where the backend can tell. Printed at the start of every
run, written to the metrics JSON as `memory`, and checked before the first step compiles.

    plan(mesh, step, shape) -> Plan     the mesh (parallel.mesh.Mesh), the step (tasks.base.PassInputs:
                                        the kind's passes and the run's rows), the model (shape_of)
    plan_on_paper(cfg, config, devices, device_bytes)   the same for a recipe, without weights or a device
"""

import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .core.errors import UserError
from .core.peaks import experts_of
from .kernels.lm_loss import CHUNK_TOKENS
from .kernels.quant import Quant, projection_bytes, quantized_weight
from .parallel.mesh import Mesh
from .parallel.tensor_parallel import kv_heads_per_device
from .tasks.base import PassInputs

DEVICE_BYTES = "XLA_TRAIN_DEVICE_BYTES"  # the device's memory, where the backend cannot tell (or to plan for another)
MIB, GIB = 2**20, 2**30


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert", "deberta", "deberta-v2",
            "gpt2")  # families whose MLP is one activation between two linears (not gated)
O_S_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "xla_sdpa", "xla_flash")
NATIVE_GQA = ("flash_attention_2", "flash_attention_3", "flex_attention")  # K and V never copied per query head
LONGEST = 2**62  # a row longer than any: each layer's cache slots then its sliding window where it has one


@dataclass(frozen=True)
class Weights:
    """A model's parameters as the plan counts them, exact from their shapes and dtypes: bytes of
    them all (`total`) and of those that train; an element's bytes in the weights' dtype (the first
    parameter's); the head's weight gradient where the head trains (the chunked head adds to it
    from the start of the backward pass); the elements of the fp32 linear weights, which bf16
    autocast copies to bf16 for its matmuls (and autograd keeps for the backward pass; weights held
    in bf16 already, --lora's frozen base, are used as they are); and the parameter counts.
    A quantized base (--load-in-8bit, --load-in-4bit: `quant`): its frozen linear projections
    counted at kernels.quant.projection_bytes (`quantized` of the `total`, scales included, for
    `quantized_params` parameters), and the elements of the largest (`tile`), which a matmul holds
    dequantized while it runs."""

    total: int = 0
    trainable: int = 0
    element: int = 4
    head_grad: int = 0
    fp32_linear: int = 0
    params: int = 0
    trainable_params: int = 0
    quant: Quant | None = None
    quantized: int = 0
    quantized_params: int = 0
    tile: int = 0


@dataclass(frozen=True)
class Shape:
    """The sizes the plan reads of a model (`shape_of`): hidden width, layers, query and key/value
    heads (GQA), head width, the MLP's width and kind, the vocabulary; a mixture of experts'
    (experts, per token, an expert's width, layers with experts: core.peaks.experts_of) and the
    implementation its config names; each decoder layer's key/value cache slots for a row longer
    than any (a sliding layer's ring: kernels.generate.cache_slots); and, of a model, its
    `weights` (a config alone: none)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool
    vocab: int
    model_type: str | None = None
    experts: tuple[int, int, int, int] | None = None
    experts_implementation: str | None = None
    slots: tuple[int, ...] = ()
    weights: Weights = Weights()

    def cache_slots(self, tokens: int) -> int:
        """Every layer's key/value cache slots for rows of `tokens` tokens, added up."""
        return sum(min(s, tokens) for s in self.slots)


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    return default


def shape_of(source: Any, quant: Quant | None = None) -> Shape:
    """The `Shape` of a transformers config (its family's flags), or of a model: its config's and
    its parameters' (`Weights`), its frozen base's linear projections kept as `quant` says
    (TrainOptions.quantization(); None: as they are)."""
    from .kernels.generate import cache_slots

    model = source if hasattr(source, "parameters") else None
    config = model.config if model is not None else source
    hidden = _get(config, "hidden_size", "n_embd", "dim", default=0)
    heads = _get(config, "num_attention_heads", "n_head", default=1)
    layers = _get(config, "num_hidden_layers", "n_layer", default=0)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", None)
    shape = Shape(hidden=hidden, layers=layers, heads=heads,
                  kv_heads=_get(config, "num_key_value_heads", default=heads),
                  head_dim=_get(config, "head_dim", default=hidden // heads if heads else 0),
                  intermediate=_get(config, "intermediate_size", "n_inner", default=4 * hidden),
                  gated=kind not in ENCODERS, vocab=_get(config, "vocab_size", default=0), model_type=kind,
                  experts=experts_of(config),
                  experts_implementation=getattr(config, "_experts_implementation", None),
                  slots=tuple(cache_slots(text, LONGEST)) if layers else ())
    if model is None:
        return shape
    return replace(shape, experts_implementation=_experts_name(model), weights=_weights(model, quant))


def _weights(model, quant: Quant | None = None) -> Weights:
    import torch

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base, held = _quantized_projections(model, head) if quant else ({}, set())
    kept = [p for p in params if id(p) not in held]  # as they are: all but the quantized projections
    seen, linear = set(), 0
    for m in model.modules():
        if (isinstance(m, torch.nn.Linear) and id(m.weight) not in seen and id(m.weight) not in held
                and m.weight.dtype == torch.float32):
            seen.add(id(m.weight))
            linear += m.weight.numel()
    quantized = sum(projection_bytes(quant, *shape) for shape in base.values()) if quant else 0
    return Weights(total=tensor_bytes(kept) + quantized, trainable=tensor_bytes(trainable),
                   element=kept[0].element_size() if kept else 4,
                   head_grad=(head.weight.numel() * head.weight.element_size()
                              if head is not None and head.weight.requires_grad else 0),
                   fp32_linear=linear, params=sum(p.numel() for p in kept) + sum(o * i for o, i in base.values()),
                   trainable_params=sum(p.numel() for p in trainable), quant=quant, quantized=quantized,
                   quantized_params=sum(o * i for o, i in base.values()),
                   tile=max((o * i for o, i in base.values()), default=0))


def _quantized_projections(model, head) -> tuple[dict[int, tuple[int, int]], set[int]]:
    """The frozen base's linear projections a quantized base keeps in 8 or 4 bits: id of the weight ->
    (out_features, in_features), for every module with those two sizes and a frozen `weight` but
    the head (whose weight a tied model shares with its embeddings); and the ids of the parameters
    that `projection_bytes` counts for them (the weight and, once quantized, any frozen scales the
    module holds as parameters; not the bias). Read from the module, not the weight's shape, so that it
    counts the same before quantization and after: bitsandbytes' Linear8bitLt and Linear4bit keep
    nn.Linear's sizes over their packed weight (Params4bit is [out x in / 2, 1]), the XLA path's
    QuantLinear its sizes over its packed weight (kernels.quant.quantized_weight), and peft's LoRA layer gives its
    base layer's `weight` and sizes."""
    import torch

    head_weight = getattr(head, "weight", None)
    found, held = {}, set()
    for m in model.modules():
        weight, out_features, in_features = (getattr(m, n, None) for n in ("weight", "out_features", "in_features"))
        weight = quantized_weight(m) if weight is None else weight  # the XLA path's QuantLinear: buffers
        if (isinstance(weight, torch.Tensor) and isinstance(out_features, int) and isinstance(in_features, int)
                and not weight.requires_grad and weight is not head_weight):
            found[id(weight)] = (out_features, in_features)
            held |= {id(weight)} | {id(p) for n, p in m.named_parameters(recurse=False)
                                    if n != "bias" and not p.requires_grad}
    return found, held


def _shape(config_or_shape: Any) -> Shape:
    return config_or_shape if isinstance(config_or_shape, Shape) else shape_of(config_or_shape)


def _share(length: int, context: int) -> int:
    """A device's tokens of a row of `length` under context parallelism over `context` devices."""
    return -(-length // context)


def layer_bytes(config, rows, length, precision="fp32", attention="sdpa", dense_mask=True, param_bytes=4, tensor=1,
                experts=None, context=1):
    """Bytes one block keeps for its backward pass: what autograd saves, tensor by tensor, for
    `rows` rows of `length` tokens, the matmuls in bf16 under bf16 autocast (else in the weights'
    dtype, `param_bytes` a value), the residual stream in the weights' dtype. `config`: a
    transformers config or a `Shape`. Per token:
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
    its share of the MLP's; the norms and the residual stream stay whole on each. Split over
    `context` devices (--context-parallel): a device keeps 1/context of each row's tokens, whose
    queries still see the whole row's keys (the eager softmax and a dense mask's bias a token stay
    `length` wide; the rest of the row's keys and values, gathered for one block's kernel at a time:
    `gathered_bytes`)."""
    d = _shape(config)
    h, heads, inter = d.hidden, d.heads // tensor, d.intermediate // tensor
    if not h or not d.layers:
        return None
    c = 2 if precision == "bf16" else param_bytes  # what the matmuls write
    r = param_bytes
    q_width, kv_width = heads * d.head_dim, _kv_width(d, attention, dense_mask, tensor)
    per_token = 2 * (r * h + 4 * h + c * h)  # two norms
    per_token += c * (q_width + 2 * kv_width + 2 * q_width)  # q, k, v, the kernel's output and o_proj's input
    if attention in O_S_ATTENTION:
        per_token += 4 * heads  # log-sum-exp
        if dense_mask and attention.endswith("sdpa"):
            per_token += c * length  # the mask made a bias, [rows, 1, length, length], in every block
    else:  # eager (or math): the fp32 softmax, and its cast where the matmul reads another dtype
        per_token += heads * length * (4 + (c if c != 4 else 0))
    if d.experts:
        per_token += _experts_bytes(d, c, r, h, experts)
    else:
        per_token += (4 if d.gated else 2) * c * inter
    return int(per_token * rows * _share(length, context))


def _kv_width(d: Shape, attention: str, dense_mask: bool, tensor: int) -> int:
    """The width of the keys (and of the values) a device's attention keeps a token: its key/value
    heads', or its query heads' where the path repeats K and V to them: eager attention and sdpa
    with a dense mask, and the Pallas path (kernels.attention.Documents._pallas: torch_xla's flash
    attention takes as many)."""
    heads, kv = d.heads // tensor, kv_heads_per_device(d.kv_heads, tensor)
    repeated = kv < heads and (attention not in NATIVE_GQA) and (
        attention not in O_S_ATTENTION or dense_mask or attention == "xla_flash")
    return (heads if repeated else kv) * d.head_dim


def gathered_bytes(config, rows, length, precision="fp32", attention="sdpa", dense_mask=True, param_bytes=4,
                   tensor=1, context=1):
    """Under context parallelism over `context` devices, the keys and values of the rest of each
    row that one block's attention gathers for its local queries (the whole row's less the
    device's own share, which `layer_bytes` counts): live while that block's kernel runs, in the
    forward pass and again in the backward pass. 0 without context parallelism."""
    if context == 1:
        return 0
    d = _shape(config)
    c = 2 if precision == "bf16" else param_bytes
    return 2 * c * _kv_width(d, attention, dense_mask, tensor) * rows * (length - _share(length, context))


def _experts_bytes(config, c, r, h, implementation=None):
    """What a mixture of experts' layer keeps per token, by the implementation its experts run
    (config._experts_implementation; `config` a transformers config or a `Shape`): the router's fp32
    logits and probabilities, and a gated MLP's four values an expert wide (gate and up, the
    activation, the product; gpt-oss's gate seven) for each expert the token passes through: its
    top-k (transformers' grouped_mm and eager, the package's xla_grouped, with each (token, expert)
    pair's gathered input and output, 2 x hidden), or every expert (xla_dense, which runs them all,
    and keeps their products weighted by the routing too, one more value each). batched_mm gathers
    a copy of its experts' weights for every pair besides (kernels/experts.py). The experts are kept
    whole under --tensor-parallel (tensor_parallel.KEPT_WHOLE)."""
    d = _shape(config)
    assert d.experts is not None
    experts, top_k, width, _ = d.experts
    implementation = implementation or d.experts_implementation
    router = 2 * 4 * experts
    # gpt-oss's clamped, interleaved gate keeps 7 values an expert wide (measured within 1%: benchmarks/bench_moe.py)
    kept = 7 if d.model_type == "gpt_oss" else 4
    if implementation == "xla_dense":
        return router + experts * (kept + 1) * c * width
    pairs = top_k * (kept * c * width + 2 * c * h)
    if implementation == "batched_mm":
        pairs += top_k * 3 * h * width * r
    return router + pairs


def activation_estimate(config, rows, length, precision="fp32", checkpointed=False, attention="sdpa",
                        dense_mask=True, param_bytes=4, tensor=1, experts=None, context=1):
    """Bytes of activations the backward pass finds kept: every block's (`layer_bytes`) and the final
    norm's; checkpointed (full recomputation), each block's input only (the residual stream, in
    the weights' dtype) and the final norm's; the block recomputed in the backward pass is the
    plan's `layer_bytes`, counted where it lives (beside the gradients). Under context parallelism
    a device's 1/context of each row's tokens."""
    one = layer_bytes(config, rows, length, precision, attention, dense_mask, param_bytes, tensor, experts, context)
    if one is None:
        return None
    d = _shape(config)
    c = 2 if precision == "bf16" else param_bytes
    tokens, h = rows * _share(length, context), d.hidden
    final_norm = tokens * (param_bytes * h + 4 * h + c * h)
    if checkpointed:
        return int(d.layers * param_bytes * h * tokens + final_norm)
    return int(d.layers * one + final_norm)


def logit_bytes(config, rows, length, precision="fp32", chunked=False, chunk_tokens=CHUNK_TOKENS, head_grad_bytes=0):
    """Bytes of a causal LM's head and loss at their peak, at the start of the backward pass, for
    `rows` rows of `length` tokens on the device (`config`: a transformers config or a `Shape`).
    Whole: the logits the model returns (held by its output), their fp32 log-softmax, its gradient
    and the logits' gradient: 16 x tokens x vocabulary bytes in fp32 (torch's profiler on the CPU),
    12 in bf16 (measured on an H200, issue 44). Chunked (kernels/lm_loss.py): one chunk's fp32 logits
    and their gradient, the head's weight gradient, which the chunks add to from the start of the
    backward pass, and under bf16 a chunk's bf16 share of it."""
    d = _shape(config)
    vocab, tokens = d.vocab, rows * length
    if not vocab:
        return None
    if chunked:
        return int(8 * min(chunk_tokens, tokens) * vocab + head_grad_bytes
                   + (2 * vocab * d.hidden if precision == "bf16" else 0))
    return (12 if precision == "bf16" else 16) * tokens * vocab


@dataclass(frozen=True)
class Plan:
    """What each device holds at the step's peak (`total`), in bytes; `plan` makes it. The fields:
    - `weights` a device's parameters (of `weights_total` in all), `gradients` and AdamW's
      `optimizer` state (exact: only what trains has the last two), each split over the mesh's
      parameter axes and its tensor axis;
    - `activations` what the blocks keep for the backward pass (an estimate; checkpointed, the
      blocks' inputs), `layer` one block's (recomputed in the backward pass where checkpointed),
      `logits` the head and loss at their peak (None without a head per token), `autocast_copies`
      bf16 autocast's copies of the fp32 linear weights;
    - `gathered` one block's keys and values of the rest of each row under context parallelism
      (`gathered_bytes`: live while that block's attention runs, counted beside the recomputed block);
    - the step's other passes: `reference` the output of a forward without gradients (DPO's
      reference with adapters) that lives through the backward pass, `reference_weights` a frozen
      copy of the weights (GRPO's reference without adapters), `cache` a generation's key/value
      cache in the step (GRPO's rollouts);
    - a quantized base (`quant`): `quantized` the bytes of its projections with their scales (of
      `weights_total`), `dequantized` the largest projection a matmul holds dequantized in the
      compute dtype, one at a time (forward and backward: kernels.quant dequantizes in the graph a
      layer at a time; bitsandbytes' MatMul4Bit saves the packed weight, never the dequantized one);
    - `step` the pass it plans (its experts named), `mesh` the layout, `device_bytes` the device's
      memory where known, `params`/`trainable_params` the parameter counts.
    `metrics()` gives it under the metrics JSON's names (`memory`)."""

    weights: int
    weights_total: int
    gradients: int
    optimizer: int
    activations: int | None
    layer: int | None
    logits: int | None
    autocast_copies: int
    reference: int
    reference_weights: int
    cache: int
    gathered: int
    step: PassInputs
    mesh: Mesh
    device_bytes: int | None = None
    params: int = 0
    trainable_params: int = 0
    quant: Quant | None = None
    quantized: int = 0
    dequantized: int = 0

    @property
    def total(self) -> int:
        """Bytes per device at the peak: parameters + optimizer state + the larger of the backward
        pass's start (activations, logits, autocast's weight copies) and its end (gradients and
        one block's activations and, under context parallelism, its gathered keys and values; the
        blocks' inputs too where checkpointed), with a reference pass's output and a quantized
        base's dequantized projection at both; or, where it is larger, a generation's key/value
        cache in the step."""
        start = (self.activations or 0) + (self.logits or 0) + self.autocast_copies + self.reference
        end = self.gradients + (self.layer or 0) + self.gathered + self.reference
        start, end = start + self.dequantized, end + self.dequantized
        if self.step.checkpointed:
            end += self.activations or 0
        return self.weights + self.reference_weights + self.optimizer + max(start, end, self.cache)

    @property
    def shards(self) -> int:
        """Devices each parameter is split over: the mesh's parameter axes and its tensor axis."""
        return self.mesh.param_shards * self.mesh.tensor

    def counts(self) -> dict[str, int]:
        return {"trainable_params": self.trainable_params, "total_params": self.params}

    def metrics(self) -> dict[str, Any]:
        """The plan as the metrics JSON's `memory` (docs/observability.md): the names it has had."""
        return {
            "param_bytes_total": self.weights_total, "param_bytes_per_device": self.weights,
            "reference_param_bytes": self.reference_weights, "grad_bytes_per_device": self.gradients,
            "optimizer_bytes_per_device": self.optimizer, "activation_bytes_estimate": self.activations,
            "layer_bytes": self.layer, "logit_bytes": self.logits, "autocast_copy_bytes": self.autocast_copies,
            "reference_bytes": self.reference, "cache_bytes": self.cache, "gathered_bytes": self.gathered,
            "attention": self.step.attention,
            "experts": self.step.experts, "chunked_logits": self.step.logits == "chunked",
            "gradient_checkpointing": self.step.checkpointed, "device_bytes": self.device_bytes, "peak_bytes": None,
            "peak_bytes_estimate": self.total, "quantization": quant_label(self.quant),
            "quantized_base_bytes": self.quantized, "dequantized_bytes": self.dequantized}


def plan(mesh: Mesh, pass_: PassInputs, shape: Shape, device_bytes: int | None = None) -> Plan:
    """The memory plan of a model of `shape` (`shape_of(model)`) trained with AdamW through the
    step `pass_` (tasks.base.PassInputs: `rows` rows of `length` tokens a device, their attention
    path and mask, the head's logits whole or in chunks, checkpointed or kept blocks, and every
    other pass the step makes) on `mesh` (parallel.mesh.Mesh, laid over the devices):
    - the parameters, gradients and AdamW state split over the mesh's parameter axes
      (`mesh.param_shards`: fsdp, expert, context) and its `tensor` axis; 1: every device holds
      them all;
    - the `rows` are a tensor and context group's: its `tensor` devices split each block's heads
      and MLP columns (`layer_bytes`) and the key/value cache's heads, its `context` devices each
      row's tokens (a device keeps 1/context of every row's activations, logits and reference
      output, and gathers the rest of the row's keys and values for one block's attention at a
      time; the rollouts' cache stays whole: generation does not split a row);
    - `pass_.reference` ("chunked" or "whole"): a second forward pass in the step without gradients
      (DPO's reference: the model with its adapters disabled), whose output lives until the step's
      backward pass ends: its final hidden states, or its whole logits, in the compute dtype. (While
      it runs, that pass also holds every block's output, which transformers returns with the
      hidden states, beside the policy's activations; the plan leaves this moment out: the chunked
      head's logits, in the backward pass, outweigh it for the vocabularies of LLMs.)
    - `pass_.cache_tokens`: a generation in the step (GRPO's rollout) holds a key/value cache of that
      many tokens a row (a sliding layer's only its ring, where shorter: kernels.generate.slots_of), in
      the weights' dtype, before the update's forward pass begins: a peak of its own (`Plan.cache`);
    - `pass_.reference_copy`: a frozen copy of the weights, sharded like them;
    - `pass_.experts`: the implementation a mixture of experts' experts will run
      (kernels.experts.planned_experts; None: the model's own), which sets what their layers keep.
    The peak (`Plan.total`): parameters + AdamW's state + the larger of what the backward pass
    begins with (the activations, the logits at their peak and, under bf16 autocast, the bf16
    copies of the weights the matmuls saved) and what it ends with (the gradients, one block's
    activations, and checkpointed, the blocks' inputs)."""
    if pass_.length is None:
        raise ValueError("the memory plan needs the step's row length (PassInputs.length)")
    w, step = shape.weights, replace(pass_, experts=pass_.experts or shape.experts_implementation)
    rows, length, precision, context, tensor = step.rows, step.length, step.precision, mesh.context, mesh.tensor
    assert length is not None
    compute = 2 if precision == "bf16" else w.element  # the bytes of a value the matmuls write
    kept = (shape, rows, length, precision)
    path = (step.attention, step.dense_mask, w.element, tensor, step.experts, context)
    shards = mesh.param_shards * tensor
    width = {"chunked": shape.hidden, "whole": shape.vocab}.get(step.reference or "", 0)
    return Plan(
        weights=-(-w.total // shards), weights_total=w.total,
        gradients=-(-w.trainable // shards),
        optimizer=-(-2 * w.trainable // shards),  # AdamW: exp_avg, exp_avg_sq
        activations=activation_estimate(*kept, step.checkpointed, *path),
        layer=layer_bytes(*kept, *path),
        logits=(logit_bytes(shape, rows, _share(length, context), precision, step.logits == "chunked",
                            step.chunk_tokens or CHUNK_TOKENS, w.head_grad if step.logits else 0)
                if step.logits else None),
        # sharded like the weights; checkpointed, one block's copies live at a time (recomputed)
        autocast_copies=(2 * w.fp32_linear // shards // (max(1, shape.layers) if step.checkpointed else 1)
                         if precision == "bf16" else 0),
        reference=rows * _share(length, context) * width * compute,
        reference_weights=-(-w.total // shards) if step.reference_copy else 0,
        # the rollouts run under the update's autocast: the values in its dtype, the keys in the
        # weights' (RoPE multiplies them by the fp32 residual stream's cos and sin; an over-count
        # for learned positions)
        cache=(kv_heads_per_device(shape.kv_heads, tensor) * shape.head_dim * rows * (w.element + compute)
               * shape.cache_slots(step.cache_tokens) if step.cache_tokens else 0),
        gathered=gathered_bytes(*kept, step.attention, step.dense_mask, w.element, tensor, context),
        step=step, mesh=mesh, device_bytes=device_bytes, params=w.params, trainable_params=w.trainable_params,
        # the whole projection under fsdp (gathered to run), its share of rows or columns under --tensor-parallel
        quant=w.quant, quantized=w.quantized, dequantized=compute * -(-w.tile // tensor))


def _experts_name(model):
    """The implementation a mixture of experts' experts run (kernels.experts), None for a dense model."""
    from .kernels.experts import experts_implementation

    return experts_implementation(model)


def paper_mesh(cfg, devices: int) -> Mesh:
    """The mesh a run of `cfg` (options.TrainOptions) lays over `devices` devices: its named axes
    (TrainOptions.mesh), the rest fsdp under --strategy fsdp, else data."""
    from .core.select import shards_parameters

    return cfg.mesh().resolve(devices, sharded=shards_parameters(cfg.strategy))


def plan_on_paper(cfg, config, devices: int, device_bytes: int | None, device_kind: str = "xla-tpu") -> Plan:
    """The plan a decoder run `cfg` (options.TrainOptions of a causal-lm, dpo or grpo recipe) makes
    on a TPU of `devices` chips of `device_bytes` each for a model of `config` (a transformers
    config), without weights or a device, through the trainer's own code: the model on torch's
    meta device, its adapters and bf16 base as job.prepare makes them, its base's projections
    counted quantized where `cfg` asks (--load-in-8bit, --load-in-4bit); the step as the kind
    describes it on a TPU (its Objective.memory_inputs: the Pallas kernel's attention, the chunked
    head, DPO's reference pass with adapters, GRPO's rows a completion longer, its rollouts' cache
    and its frozen reference with --beta); a mixture of experts' grouped matmul (kernels/experts.py,
    xla_grouped); the mesh of the options (`paper_mesh`). `device_kind` "cuda": the step as the
    kind runs it on a GPU instead (kernels.attention.kind_of's names), the experts the model's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from .core import xla  # noqa: F401  (declares the TPU's kernels, which the kind's path chooses from)
    from .core.select import registered_roles
    from .kernels.experts import XLA_GROUPED
    from .models import add_adapters, hold_frozen_in_bf16

    with torch.device("meta"):  # the adapters too: peft would make them on the CPU first (seconds for a 70B)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if cfg.lora:
            model = add_adapters(model, cfg.section("model"), "CAUSAL_LM")
    if cfg.lora and cfg.precision == "bf16":
        hold_frozen_in_bf16(model)
    if device_kind == "cuda":  # CUDA's kernels are declared by its roles (gpu_fallback: flex), as in a run
        registered_roles("cuda")
    step = _objective_of(cfg).memory_inputs(model, device_kind, cfg.max_length)
    step = replace(step, length=step.length or cfg.max_length, rows=cfg.batch_size, precision=cfg.precision,
                   checkpointed=cfg.gradient_checkpointing, adapters=cfg.lora,
                   experts=XLA_GROUPED if _experts_name(model) and device_kind == "xla-tpu" else None)
    return plan(paper_mesh(cfg, devices), step, shape_of(model, cfg.quantization()), device_bytes)


def _objective_of(cfg):
    """The kind's objective as `cfg` makes it, without its rows: the kind's task built from the
    options it takes (its attention path, its own options: DPO's flat, GRPO's as `settings`)."""
    from .tasks import kind_of

    kind = kind_of(cfg.problem)
    own = cfg.kind_options()
    given = {"attention": cfg.attention, "settings": own, **(asdict(own) if own is not None else {})}
    names = {f.name for f in fields(kind)}
    return kind("custom", None, max_length=cfg.max_length, **{k: v for k, v in given.items() if k in names}).objective


def checkpointing_needed(kept: Plan, checkpointed: Plan) -> tuple[bool, str | None]:
    """Whether gradient checkpointing must be switched on: the plan of the run as asked (`kept`)
    exceeds the device's memory and the plan with every block checkpointed fits. Returns (the
    decision, the console line that says so, or None)."""
    device = kept.device_bytes
    if not device or kept.step.checkpointed or kept.total <= device or checkpointed.total > device:
        return False, None
    return True, (f"memory plan: {kept.total / GIB:.2f} GiB per device with every block's activations kept, more "
                  f"than the device's {device / GIB:.2f} GiB; {checkpointed.total / GIB:.2f} GiB with gradient "
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


def quant_label(quant: Quant | None) -> str | None:
    """A quantized base's name in the plan's line and metrics: int8, nf4, fp4, "nf4 double-quantized"."""
    return quant.kind + (" double-quantized" if quant.nested else "") if quant else None


def describe(memory: Plan) -> str:
    """The plan's console line."""
    def mib(value):
        return f"{value / MIB:.1f} MiB" if value is not None else "unknown"

    step = memory.step
    device = f"{memory.device_bytes / GIB:.1f} GiB" if memory.device_bytes else "unknown"
    quantized = (f"; its {quant_label(memory.quant)} base {mib(memory.quantized)} with the scales, one projection "
                 f"dequantized {mib(memory.dequantized)}" if memory.quant else "")
    split = ", ".join(f"{a} {n}" for a, n in memory.mesh.split.items())
    return (f"memory plan per device: parameters {mib(memory.weights)} (of {mib(memory.weights_total)}"
            f"{quantized}), "
            f"gradients {mib(memory.gradients)}, optimizer {mib(memory.optimizer)}, "
            f"activations ~{mib(memory.activations)}"
            f"{' (checkpointed)' if step.checkpointed else ''}"
            f"{', logits ' + mib(memory.logits) if memory.logits else ''}"
            f"{' (chunked)' if memory.logits and step.logits == 'chunked' else ''}"
            f"{', reference pass ' + mib(memory.reference) if memory.reference else ''}"
            f"{', reference weights ' + mib(memory.reference_weights) if memory.reference_weights else ''}"
            f"{', generation cache ' + mib(memory.cache) if memory.cache else ''}"
            f"{', gathered keys and values ' + mib(memory.gathered) if memory.gathered else ''}"
            f"{', experts ' + step.experts if step.experts else ''}"
            f"{' (mesh: ' + split + ')' if split else ''}"
            f", peak ~{memory.total / MIB:.1f} MiB; "
            f"device {device}; "
            f"{memory.trainable_params:,} of {memory.params:,} parameters trained")


def check_fits(memory: Plan) -> None:
    """Stops the run before anything compiles when the plan exceeds the device's memory, naming
    what would make it fit and is not on yet."""
    step = memory.step
    if memory.device_bytes and memory.total > memory.device_bytes:
        remedies = [f"a smaller --batch-size (now {step.rows})",
                    f"--max-length (batches of up to {step.length} tokens)"]
        remedies += [] if step.checkpointed else ["--gradient-checkpointing"]
        remedies += [] if memory.shards > 1 else ["--strategy fsdp (the model sharded over the devices)"]
        remedies += [] if step.adapters else ["--lora (gradients and AdamW state for adapters only)"]
        remedies += [] if not step.adapters or memory.quant else ["--load-in-4bit (the frozen base in 4 bits)"]
        raise UserError(f"the memory plan needs {memory.total / GIB:.2f} GiB per device, more than the device's "
                        f"{memory.device_bytes / GIB:.2f} GiB: try {', '.join(remedies[:-1])} or {remedies[-1]}")


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
