"""What a checkpoint or a saved model holds of a model, independent of where it is written."""

import contextlib

import torch

from .ties import untied


def trained_state(model, live=False):
    """What a checkpoint keeps of `model`: its whole state, or, when part of it is frozen (LoRA's
    base), the trained parameters only; the frozen ones come again from the model's own files.
    Which are trained is read from the state's own values (`keep_vars`), so the keys may differ
    from `named_parameters()`' (under FSDPv2 the state's keys lose the wrappers' `_orig_module.`,
    core.xla._drop_wrapper_keys; the parameters' names keep it). A tied parameter (an output
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


@contextlib.contextmanager
def dcp_errors():
    """torch.distributed.checkpoint without its warnings (that no process group is used, on
    purpose: each host writes and reads its own shards; torch's TypedStorage deprecation, once per
    tensor), and with its failure as the error that caused it (a full disk, a damaged file): it
    wraps them in a CheckpointException, which is a BaseException, not an Exception."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            yield
        except CheckpointException as e:
            raise next(exc for exc, _ in e.failures.values()) from None
