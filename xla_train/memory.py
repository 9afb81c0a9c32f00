"""The memory plan: what each device holds for the model, its gradients and AdamW's state (exact,
from the parameters' shapes, dtypes and how the strategy lays them out), an estimate of the
activations, and the device's memory where the backend can tell. Printed at the start of every
run, written to the metrics JSON as `memory`, and checked before the first step compiles.
"""

import os

from .core.errors import UserError

DEVICE_BYTES = "XLA_TRAIN_DEVICE_BYTES"  # the device's memory, where the backend cannot tell (or to plan for another)
MIB, GIB = 2**20, 2**30


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_estimate(config, rows, length, precision, checkpointed=False):
    """Bytes of activations one device keeps for the backward pass of a transformer encoder or
    decoder: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", eq. 1), s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations (twice that in
    fp32), for `rows` rows of `length` tokens. Checkpointed (full recomputation, their section 5):
    each layer keeps only its input, 4*s*b*h bytes (fp32: autocast keeps the residual stream in
    fp32), and one layer's activations live again while it is recomputed. An estimate: attention
    implementations that do not keep the score matrix (flash, XLA's fusions) keep less."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "dim", 0)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
    if not hidden or not layers:
        return None
    per_layer = length * rows * hidden * (34 + 5 * heads * length / hidden)
    scale = 1 if precision == "bf16" else 2  # the paper counts 16-bit values
    if checkpointed:
        return int(layers * 4 * length * rows * hidden + per_layer * scale)
    return int(layers * per_layer * scale)


def logit_bytes(config, rows, length):
    """Bytes of a causal LM's logits at the loss: vocabulary x tokens x 4 bytes for the fp32 logits,
    and as much again for their log-softmax, which the backward pass keeps (then their gradient
    takes its place). Often the largest activation: Llama-3's 128,256 tokens x 8 rows x 2,048
    tokens are 7.8 GiB."""
    vocab = getattr(config, "vocab_size", None)
    return 2 * 4 * vocab * rows * length if vocab else None


def plan(model, rows, length, precision="fp32", shards=1, device_bytes=None, checkpointed=False, logits=False):
    """The memory plan of `model` trained with AdamW on `rows` rows of `length` tokens per device,
    its parameters split over `shards` devices (1: every device holds them all), its blocks'
    activations `checkpointed` (recomputed in the backward pass) or kept; with `logits`, a
    vocabulary's logits per token (a causal LM's) are counted too."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    out = {
        "param_bytes_total": tensor_bytes(params),
        "param_bytes_per_device": -(-tensor_bytes(params) // shards),
        "grad_bytes_per_device": -(-tensor_bytes(trainable) // shards),
        "optimizer_bytes_per_device": -(-2 * tensor_bytes(trainable) // shards),  # AdamW: exp_avg, exp_avg_sq
        "activation_bytes_estimate": activation_estimate(model.config, rows, length, precision, checkpointed),
        "logit_bytes": logit_bytes(model.config, rows, length) if logits else None,
        "gradient_checkpointing": checkpointed,
        "device_bytes": device_bytes,
        "peak_bytes": None,
    }
    return out, {"trainable_params": sum(p.numel() for p in trainable), "total_params": sum(p.numel() for p in params)}


def needed(memory):
    """Bytes per device the plan adds up to."""
    keys = ("param_bytes_per_device", "grad_bytes_per_device", "optimizer_bytes_per_device",
            "activation_bytes_estimate", "logit_bytes")
    return sum(memory[k] or 0 for k in keys)


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
            f"{', logits ' + mib('logit_bytes') if memory.get('logit_bytes') else ''}; device {device}; "
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
