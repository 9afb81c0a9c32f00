"""What a checkpoint or a saved model holds of a model, independent of where it is written."""

import torch

from ..core.ties import untied


def trained_state(model, live=False):
    """What a checkpoint keeps of `model`: its whole state, or, when part of it is frozen (LoRA's
    base), the trained parameters only; the frozen ones come again from the model's own files.
    Which are trained is read from the state's own values (`keep_vars`), so the keys may differ
    from `named_parameters()`' (under FSDPv2 the state's keys lose the wrappers' `_orig_module.`,
    parallel.xla_strategies._drop_wrapper_keys; the parameters' names keep it). A tied parameter (an output
    projection that is the input embedding) appears once, under its first key (`core.ties.untied`).
    `live`: the parameters and buffers themselves (to load into in place), not detached views."""
    state = untied(model.state_dict(keep_vars=True))
    keep = (lambda v: v) if live else (lambda v: v.detach())
    if all(v.requires_grad for v in state.values() if isinstance(v, torch.nn.Parameter)):
        return {k: keep(v) for k, v in state.items()}
    return {k: keep(v) for k, v in state.items() if isinstance(v, torch.nn.Parameter) and v.requires_grad}


def whole_state(model):
    """The model's whole state, detached, a tied tensor once under its first key (what a saved
    model holds: transformers' save_pretrained writes a tie once and makes it again on load)."""
    return {k: v.detach() for k, v in untied(model.state_dict(keep_vars=True)).items()}

