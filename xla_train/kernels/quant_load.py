"""A LoRA base quantized while it loads, on XLA (TPU, XLA:CPU): transformers' `from_pretrained` is
given a `quantization_config` (`loading`), as the bitsandbytes path is on CUDA and the CPU
(kernels.bnb), and its quantizer (`XlaQuantizer`) turns each projection's weight into the package's
QuantLinear as it is read: the process never holds the base in full precision beyond one tensor.

The pieces of transformers 5.24 it takes, as transformers' own on-the-fly quantizers (quanto,
bitsandbytes) take them; pinned here, read in quantizers/auto.py, quantizers/base.py and
core_model_loading.py:
- `register_quantizer` / `register_quantization_config` (quantizers/auto.py): the method
  `METHOD`, which `AutoHfQuantizer.from_config` finds for `XlaQuantConfig`;
- `HfQuantizer.preprocess_model`, called by from_pretrained on the model built on the meta device
  before any weight is read: which weights to quantize, `kernels.quant_xla.projections` (the one
  rule, shared with `quantize_base`);
- `param_needs_quantization` and `get_quantize_ops`: `convert_and_load_state_dict_in_model`
  (core_model_loading.py) hands each such weight, read alone and cast to the load's dtype, to the
  op's `convert(input_dict, model=, full_layer_name=, missing_keys=)` instead of setting it; an
  error there is re-raised after the load report (`log_conversion_errors`, `log_state_dict_report`).
  With a quantizer that quantizes on the fly transformers reads without its thread pool, each
  tensor when it is converted (`has_on_the_fly_quantization`: deferred callables, not futures);
- `postprocess_model`, after the missing keys are initialised and the weights tied.
Everything else is from_pretrained's own (key renames, the new head's seeded initialisation,
non-persistent buffers such as the rotary inv_freq, ties, missing keys), so the model comes out as
a whole load followed by `quantize_base` leaves it, buffer for buffer, with no quantizer recorded on
it (tests/test_quant_load.py).

What it does not change: transformers maps the safetensors files (safe_open, backend "mmap"), and the
pages read stay in the page cache, counted in the process's resident set (RssFile) until the files
are closed at the end of the load: reclaimable, not the process's own memory
(benchmarks/bench_quant_load.py measures both). Under `--strategy fsdp` (FSDPv2) the base is not
loaded here but into its shards, each host quantizing its devices' rows (job.pretrained,
parallel.sharded_load), except where a run loads it whole: a resume, a folder sharded_load cannot
read, a model whose tensors transformers converts (sharded_load.converts: stacked experts)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..parallel.sharded_load import trim
from .quant import Quant
from .quant_xla import QuantLinear, layout, nothing_to_quantize, projections, quantized

METHOD = "xla_train"  # the quantization_config's quant_method (never saved: `postprocess_model` removes it)


class XlaQuantConfig(QuantizationConfigMixin):
    """The `quantization_config` that loads a base held as QuantLinear: `Quant`'s fields."""

    def __init__(self, bits: int = 8, kind: str = "int8", nested: bool = False, **kwargs: Any) -> None:
        self.quant_method = METHOD
        self.bits, self.kind, self.nested = bits, kind, nested

    @property
    def quant(self) -> Quant:
        return Quant(self.bits, self.kind, self.nested)


class XlaQuantizer(HfQuantizer):
    """Quantizes the base's `projections` as they are read (see the module's docstring)."""

    requires_calibration = False
    quantization_config: XlaQuantConfig

    def __init__(self, quantization_config: XlaQuantConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.targets: set[str] = set()

    def preprocess_model(self, model: Any, dtype: Any = None, **kwargs: Any) -> None:
        """Before any weight is read (the model on the meta device): the weights to quantize. Unlike
        the base class's, nothing is marked on the model (`is_quantized`, `quantization_method`)."""
        self.targets = {f"{name}.weight" for name, *_ in projections(model)}
        if not self.targets:
            raise nothing_to_quantize(model, self.quantization_config.quant)

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        return param_name in self.targets

    def get_quantize_ops(self) -> ConversionOps:
        return _QuantizeOnLoad(self.quantization_config.quant)

    def postprocess_model(self, model: Any, **kwargs: Any) -> Any:
        """After the load: a projection left a Linear (its bias read after its weight, which
        `_QuantizeOnLoad` leaves to here) quantized now; the biases frozen (transformers makes each
        parameter it loads trainable: set_param_for_module); no record of the quantizer left, which
        from_pretrained has just set (`hf_quantizer`; get_hf_quantizer's `config.quantization_config`):
        the run records the quantization itself (models.record_quantization)."""
        quant = self.quantization_config.quant
        for _, parent, name, linear in projections(model):
            setattr(parent, name, quantized(linear, quant))
        for m in model.modules():
            if isinstance(m, QuantLinear) and m.bias is not None:
                m.bias.requires_grad_(False)
        for holder, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
            if hasattr(holder, attr):
                delattr(holder, attr)
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return True


class _QuantizeOnLoad(ConversionOps):
    """One projection's weight, read from the checkpoint in the load's dtype: its Linear (on the meta
    device) replaced by the QuantLinear `quantized` makes of it; the full-precision tensor is freed
    when this returns."""

    def __init__(self, quant: Quant) -> None:
        self.quant = quant

    def convert(self, input_dict: dict[str, Any], source_patterns: Any = None, target_patterns: Any = None,
                model: Any = None, full_layer_name: str = "", missing_keys: set[str] | None = None,
                **kwargs: Any) -> dict[str, Any]:
        (value,) = input_dict.values()
        weight = value[0] if isinstance(value, list) else value
        path, _, _ = full_layer_name.rpartition(".")
        parent, _, attr = path.rpartition(".")
        linear = model.get_submodule(path)
        assert type(linear) is torch.nn.Linear, (full_layer_name, type(linear))  # one of `projections`
        if linear.bias is not None and linear.bias.is_meta:
            # transformers loads a module's bias before its weight (its keys sorted); a bias read later
            # or missing from the checkpoint: the weight is loaded as it is, quantized in postprocess_model
            return input_dict
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer = quantized(linear, self.quant)
        # transformers' initialisation leaves it alone (a loaded module); a plain attribute, which
        # nn.Module.__setattr__'s annotation (tensors and modules) does not allow for
        layer._is_hf_initialized = True  # type: ignore[assignment]
        setattr(model.get_submodule(parent), attr, layer)
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        # the previous tensor's freed memory handed back to the system: glibc keeps it otherwise (its
        # mmap threshold grows with the first large free), and the process grew to the fp32 model's
        # size over the load (benchmarks/bench_quant_load.py, a 134M Llama: 0.7 to 0.9 GiB of anonymous
        # memory at the end against 0.2 with it)
        trim()
        return {}


@functools.cache
def _registered() -> None:
    """`METHOD` in transformers' registries, once per process."""
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantization_config(METHOD)(XlaQuantConfig)
        register_quantizer(METHOD)(XlaQuantizer)


def loading(quant: Quant) -> dict[str, Any]:
    """`from_pretrained`'s arguments that load the base with its projections quantized as they are
    read (QuantLinear: kernels.quant_xla); fp4 is one line (bitsandbytes' only)."""
    layout(quant)
    _registered()
    return {"quantization_config": XlaQuantConfig(quant.bits, quant.kind, quant.nested)}
