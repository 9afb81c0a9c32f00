"""A LoRA base kept in 8 or 4 bits on the torch-native backends (--backend cuda, cpu): bitsandbytes
through transformers' `BitsAndBytesConfig` and peft's own bnb LoRA layers, as TRL users run QLoRA.

transformers quantizes tensor by tensor as it loads (`replace_with_bnb_linear` puts bnb's
`Linear8bitLt` / `Linear4bit` in place of every `nn.Linear`, and of GPT-2's `Conv1D`, transposed:
transformers/integrations/bitsandbytes.py); peft's `get_peft_model` then wraps those in its
`peft.tuners.lora.bnb.Linear8bitLt` / `Linear4bit`. The head stays in full precision and trains:
`HEADS` is passed as `llm_int8_skip_modules`, because transformers' default skip list
(quantizers/base.py, get_keys_to_not_convert) names the last parameter without its ".weight" only, so a
head with a bias (BERT's `classifier.bias`) would be quantized. Embeddings are `nn.Embedding`, never
converted. Imports no torch at module level (the options check reads `refusal`)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from ..core.errors import UserError
from .quant import Quant

# bitsandbytes' warnings a user can do nothing about, quiet from this module's import on (peft imports
# bitsandbytes where it is installed): LLM.int8 quantizes fp16 activations by design ("inputs will be
# cast ... to float16", every eval forward: autograd/_functions.py), and its CPU backend's optional
# kernels package (backends/cpu/ops.py, at import)
for _name in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_name).setLevel(logging.ERROR)

EXTRA = "pip install 'xla-train[quant]'"  # setup.py's extra that brings bitsandbytes
BACKENDS = ("cuda", "cpu")  # where bitsandbytes holds the base (the XLA backend has its own quantized linear)
# The heads a task trains (peft's modules_to_save for SEQ_CLS: PeftModelForSequenceClassification's
# classifier_module_names; a causal LM's lm_head): never quantized
HEADS = ["classifier", "score", "lm_head"]


def require(module: str = "bitsandbytes") -> None:
    """Stops in one line, naming the extra, where `module` (bitsandbytes) is not installed."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"`load_in_8bit` and `load_in_4bit` on the cuda and cpu backends need {module}, which is "
                        f"not installed: {EXTRA}")


def refusal(quant: Quant, backend: str, sharded: bool) -> str | None:
    """Why the torch-native `backend`, its strategy splitting the parameters or not (`sharded`),
    cannot hold a bitsandbytes base, or None (None too for the xla backend, whose quantized linear
    is its own)."""
    if backend == "tpu":  # TorchTPU: bitsandbytes has no tpu backend (bitsandbytes/backends: cpu, cuda, xpu, ...)
        return f"{quant.flag} runs on the xla, cuda and cpu backends; TorchTPU (`backend` tpu) has no bitsandbytes"
    if backend not in BACKENDS:
        return None
    if sharded:
        # FSDP2's fully_shard replaces every parameter by a plain nn.Parameter around a DTensor shard
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, FSDPParam._init_sharded_param and
        # init_unsharded_param), which drops Params4bit's quant_state and Int8Params' SCB scales
        # (--tensor-parallel, --expert-parallel and --context-parallel run under fsdp only)
        return (f"{quant.flag} on the {backend} backend runs under `strategy` ddp: FSDP2 (`strategy` fsdp) shards "
                "plain tensors and would drop bitsandbytes' scales")
    return None


def check_roles(quant: Quant | None, roles: Any) -> None:
    """`refusal` of the run's roles (core.roles.Roles) as a UserError, before the model loads."""
    line = quant and refusal(quant, roles.name, roles.strategy.sharded)
    if line:
        raise UserError(line)


def loading(quant: Quant | None, backend: str, precision: str) -> dict[str, Any]:
    """`from_pretrained`'s arguments that load the base quantized on a torch-native `backend`
    ({} without a quantization, or on the xla backend). 4-bit computes in the training precision
    (bf16 under --precision bf16, else fp32); LLM.int8 keeps its outlier threshold (6.0)."""
    if quant is None or backend not in BACKENDS:
        return {}
    require()
    import torch
    from transformers import BitsAndBytesConfig

    keep_kind_when_pickled()

    if quant.bits == 8:
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=HEADS)}
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant.kind, bnb_4bit_use_double_quant=quant.nested,
        bnb_4bit_compute_dtype=compute, llm_int8_skip_modules=HEADS)}


def _rebuilt(cls: type, data: Any, requires_grad: bool) -> Any:
    import torch

    return torch.Tensor._make_subclass(cls, data, requires_grad)


def _set_attributes(param: Any, attributes: dict[str, Any]) -> None:
    param.__dict__.update(attributes)


def _reduce_param(param: Any) -> tuple:
    # the attributes as pickle's state, set once the parameter exists (its `module` refers back to it)
    return _rebuilt, (type(param), param.data, param.requires_grad), dict(param.__dict__), None, None, _set_attributes


def keep_kind_when_pickled() -> None:
    """bitsandbytes' quantized parameters (Params4bit with its quant_state, Int8Params with its SCB
    scales) stay of their kind when the job is pickled to spawned workers (CUDA's, and the CPU's
    where forking is unsafe: gpu_fallback/launcher.py). torch's Parameter.__reduce_ex__
    (torch/nn/parameter.py, torch._utils._rebuild_parameter_with_state) rebuilds a plain Parameter,
    whose .to("cuda") would leave the scales behind; their own .to() moves them. Registered with
    multiprocessing's ForkingPickler, which torch.multiprocessing's spawn pickles with (the data
    through torch's shared-memory reducers)."""
    from multiprocessing.reduction import ForkingPickler

    import bitsandbytes as bnb

    for cls in (bnb.nn.Params4bit, bnb.nn.Int8Params):
        ForkingPickler.register(cls, _reduce_param)


def quantized_modules(model: Any) -> list[str]:
    """The names of `model`'s bitsandbytes linear layers (the base's quantized projections)."""
    import bitsandbytes as bnb

    return [name for name, m in model.named_modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]


def settle(model: Any) -> Any:
    """`model`'s 4-bit layers kept in one weight layout for training and evaluation. bitsandbytes'
    Linear4bit.forward (nn/modules.py) repacks its weight for AVX512-BF16 CPUs the first time it runs
    in eval mode without grad (_convert_weight_packed_for_cpu), and from then on computes through
    F.gemv_4bit, which has no backward: training after an evaluation would silently stop the
    gradients at every 4-bit layer (and the repacking fails on widths below its 64-wide blocks)."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def check_quantized(model: Any, quant: Quant, name: str) -> None:
    """Stops in one line where loading quantized nothing: the model has no linear projection
    outside its head."""
    if not quantized_modules(model):
        raise UserError(f"{quant.flag}: model {name} has no linear projection to quantize outside its head "
                        f"({', '.join(HEADS)}); train it without {quant.flag}")
    settle(model)


def record(quant: Quant) -> dict[str, Any]:
    """`quant` as transformers records a bitsandbytes base in config.json (BitsAndBytesConfig.to_dict's
    keys that say the layout)."""
    return {"quant_method": "bitsandbytes", "load_in_8bit": quant.bits == 8, "load_in_4bit": quant.bits == 4,
            "bnb_4bit_quant_type": quant.kind if quant.bits == 4 else "nf4",
            "bnb_4bit_use_double_quant": quant.nested}


def recorded(config: Any) -> Quant | None:
    """An adapter folder's quantized base (`config`, its config.json: transformers records the
    quantization_config of a model it loaded quantized, `record` that of an XLA run's), or None.
    The record is taken off `config`, which would otherwise make transformers read the base as a
    checkpoint saved quantized."""
    saved = getattr(config, "quantization_config", None)
    if not saved:
        return None
    del config.quantization_config
    saved = saved if isinstance(saved, dict) else saved.to_dict()
    if saved.get("load_in_8bit"):
        return Quant(8, "int8")
    return Quant(4, saved.get("bnb_4bit_quant_type", "nf4"), bool(saved.get("bnb_4bit_use_double_quant")))
