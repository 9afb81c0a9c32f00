"""The routers' load-balancing loss of a mixture-of-experts decoder (Switch Transformer's auxiliary
loss, transformers' `load_balancing_loss_func`), over a batch's real tokens only.

TRL 1.16 adds it for every model whose config has `output_router_logits` (Qwen3-MoE, Mixtral,
gpt-oss), weighted by the config's `router_aux_loss_coef` unless told another weight, 0 turning it
off (SFTTrainer, DPOTrainer and GRPOTrainer alike), and logs it as `aux_loss`. transformers computes
it inside the causal LM's forward from the `attention_mask` it was given, which it takes for a 2-D
padding mask: the package's is a 4-D document mask (a per-layer-type dict of them, or on the kernels'
paths the segments as [rows, 1, 1, L]), and the model's own loss fails on it ("The size of tensor a
(512) must match the size of tensor b (32768)") or, where a flattened size happens to fit, weights
tokens by their document's number without any error. So the package never lets the model compute
it (`models_own_off`, at load) and computes it here, from the routers' logits collected during the
forward (`collected`), with the family's own function given a 2-D mask of the real tokens.

Everything stays on the device: the function counts with fixed shapes (scatter_add over the
routing, sums of the mask), no `.item()`, no branch on a value.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

HOOKED = "_xla_train_router_sink"  # the attribute a hooked model keeps its collector under
LOADED_ON = "_xla_train_router_logits_on"  # set on a model whose config had output_router_logits on at load


def coefficient(config: Any, asked: float | None = None) -> float:
    """The weight of the routers' loss in the training loss, by TRL 1.16's rule: `asked` (the
    router_aux_loss_coef option) or else the config's own `router_aux_loss_coef`, for a model whose
    (text) config has `output_router_logits`; 0.0 (off) for any other model or where the weight is 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text, "output_router_logits"):
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) if asked is None else asked)


def has_routers(config: Any) -> bool:
    """Whether a model of `config` returns router logits (a mixture of experts, as TRL tells one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hasattr(text, "output_router_logits")


def models_own_off(model: Any) -> Any:
    """`model` with its own load-balancing loss off (config.output_router_logits False): a forward
    of the package's (training, evaluation, generation) hands the model a mask it would misread
    (see the module docstring); `collected` and `load_balancing_loss` compute it instead."""
    text = model.config.get_text_config()
    if getattr(text, "output_router_logits", False):
        text.output_router_logits = False
        setattr(model, LOADED_ON, True)  # on the model, not the config: config.json would show it
    return model


@contextmanager
def as_loaded(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s config (through wrappers and adapters) with output_router_logits as it was loaded
    while the block saves it: the folder a run writes keeps the flag its model came with, as TRL's
    saved models keep it on where the loss was on."""
    found: Any = next((m for m in model.modules() if getattr(m, LOADED_ON, False)), None)
    text = found.config.get_text_config() if found is not None else None
    if text is not None:
        text.output_router_logits = True
    try:
        yield
    finally:
        if text is not None:
            text.output_router_logits = False


class _Sink:
    """Where a hooked model's routers put their logits while a `collected` block runs (None: not
    collecting: evaluation, the reference passes, activation checkpointing's recomputation)."""

    logits: list[torch.Tensor] | None = None


def _router_classes(model: torch.nn.Module) -> list[tuple[type, int]]:
    """(module class, index in its output) of the routers, as transformers records them for
    `output_router_logits` (each model class's `_can_record_outputs["router_logits"]`)."""
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import OutputRecorder

    found = []
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        specs = (type(module)._can_record_outputs or {}).get("router_logits")
        for spec in specs if isinstance(specs, list) else [specs] if specs is not None else []:
            if isinstance(spec, OutputRecorder) and spec.target_class is not None:
                found.append((spec.target_class, spec.index))
            elif isinstance(spec, type):  # a bare class: transformers records its output 1 (capture_outputs)
                found.append((spec, 1))
    return found


class _Keep:
    """A router's forward hook: its logits (output `index`) into the model's sink while one collects.
    A class, not a closure, so that a hooked model still pickles and deep-copies (each copy's
    routers then reach the copy's own sink)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        sink = getattr(module, HOOKED)
        if sink.logits is not None:
            sink.logits.append(output[self.index] if isinstance(output, tuple) else output)


def _sink(model: torch.nn.Module) -> _Sink:
    """The model's collector, its routers hooked once (before any torch.compile traces them)."""
    sink = getattr(model, HOOKED, None)
    if sink is not None:
        return sink
    sink = _Sink()
    classes = _router_classes(model)
    for module in model.modules():
        for cls, index in classes:
            if isinstance(module, cls):
                setattr(module, HOOKED, sink)  # not a submodule, not a parameter: nothing saved
                module.register_forward_hook(_Keep(index))
                break
    setattr(model, HOOKED, sink)
    return sink


@contextmanager
def collected(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that receives the logits of every router of `model` (the transformers model, not its
    wrappers; [rows x length, experts] each, in layer order) while the block runs, as
    `output_router_logits=True` would return them."""
    sink = _sink(model)
    logits: list[torch.Tensor] = []
    sink.logits = logits
    try:
        yield logits
    finally:
        sink.logits = None


def loss_function(model: torch.nn.Module) -> Any:
    """transformers' `load_balancing_loss_func` of the model's family (its modeling module's own),
    or Mixtral's, which the families copy, where the module has none."""
    own = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if own is not None:
        return own
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func


def load_balancing_loss(model: Any, logits: Sequence[torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """The routers' load-balancing loss of `model` (the transformers model) from its routers'
    `logits` over the tokens where `real` ([rows, length]: a document's, a pair's, a rollout's
    tokens, not padding) is true, as the model's forward computes it with a 2-D padding mask:
    its `num_experts` and `num_experts_per_tok`, fp32, a 0-d tensor."""
    if not logits:  # a count of modules, not a value: no sync
        raise RuntimeError(f"no router logits collected from {type(model).__name__}: its routers are not the modules "
                           "its _can_record_outputs['router_logits'] names")
    if torch.is_grad_enabled() and not any(t.requires_grad for t in logits):  # a flag of the graph, not a value
        # torch_xla's checkpoint is reentrant only: its first forward runs without gradients, and the
        # routers' logits recorded there are constants (the recomputation in the backward pass is not seen)
        warnings.warn("the routers' logits carry no gradient (activation checkpointing on XLA: torch_xla's checkpoint "
                      "runs the first forward without gradients): the routers' loss is reported and added, but does "
                      "not train the routers", stacklevel=3)
    text = model.config.get_text_config()
    experts = getattr(model, "num_experts", None) or text.num_experts
    top_k = getattr(model, "num_experts_per_tok", None) or text.num_experts_per_tok
    return loss_function(model)(tuple(logits), experts, top_k, real)
