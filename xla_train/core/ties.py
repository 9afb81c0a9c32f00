"""Tied parameters (a decoder's output projection that is its input embedding: Llama 3.2, Qwen2.5's
small models, Gemma, GPT-2): one tensor under several names, which must stay one tensor when the
model moves to a device and be written once.

Moving a module to an XLA device gives each module a new Parameter (`Module._apply` cannot swap
the data of an XLA tensor into a CPU Parameter), so a tie made on the CPU comes apart: two
tensors that train apart. `ties` records the tie before the move, `retie` makes it again."""

import torch


def ties(model):
    """Groups of (module, parameter name) that hold one Parameter, for `retie` after a move."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def retie(groups):
    """Every holder of a group points at its first holder's Parameter again (a no-op where the
    move kept them one, as on CUDA and the CPU)."""
    for (first, first_name), *rest in groups:
        for module, name in rest:
            module._parameters[name] = first._parameters[first_name]


def untied(state):
    """A state dict (`keep_vars=True`) with each tied tensor under its first key only: what a
    checkpoint writes (safetensors refuses two names for one storage). Loading it into a model
    whose tie is made by its config fills both names."""
    seen, out = set(), {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and id(value) in seen:
            continue
        seen.add(id(value))
        out[key] = value
    return out


def first_names_only(model, weights):
    """`weights` (a state dict read back) without `model`'s later names of a tied tensor, and those
    of them that held other values than the first name. A checkpoint written before ties were kept
    (an XLA run before 2026-11-26) holds both names apart, the first one trained: loaded whole,
    the later name's stale values would overwrite it in the one tensor."""
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for key, value in state.items():
        first.setdefault(id(value), key)
    later = {k for k, v in state.items() if first[id(v)] != k and k in weights}
    differing = [k for k in sorted(later) if first[id(state[k])] in weights
                 and not torch.equal(weights[k], weights[first[id(state[k])]])]
    return {k: v for k, v in weights.items() if k not in later}, differing
