"""Peak dense matmul FLOP/s of the devices whose figures are published, for model FLOPs
utilisation (MFU). A device not listed gets None: MFU is then left out, never guessed.

TPUs by PJRT's device kind (`torch_xla.core.xla_model.xla_device_kind`), per device as torch_xla
counts them (TPU v2 and v3 show each chip's two cores as two devices; v4 and later one device per
chip), bf16 (Google Cloud's TPU system architecture pages). GPUs by torch's device name, bf16 on
tensor cores and fp32 without TF32 (torch's default for matmuls), dense (NVIDIA's data sheets).
"""

TPU_BF16 = {  # device kind: FLOP/s per device
    "TPU v2": 22.5e12,
    "TPU v3": 61.5e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5p": 459e12,
    "TPU v5": 459e12,  # v5p's device kind
    "TPU v6 lite": 918e12,  # v6e (Trillium)
}
GPU = {  # a part of the device name: {precision: FLOP/s}
    "H100 PCIe": {"bf16": 756e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "fp32": 66.9e12},  # SXM
    "H200": {"bf16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
}


def peak_flops(kind, precision):
    """The device's peak FLOP/s at `precision` ("bf16" or "fp32"), or None where not known."""
    if not kind:
        return None
    if kind in TPU_BF16:
        return TPU_BF16[kind] if precision == "bf16" else None  # fp32's speed depends on XLA's matmul precision
    return next((peaks.get(precision) for part, peaks in GPU.items() if part in kind), None)


def experts_of(config):
    """(experts, per token, an expert's MLP width, layers with experts) of a mixture of experts'
    config (Qwen3-MoE, Mixtral, gpt-oss: transformers' names), or None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", None)
    if not experts or not top_k:
        return None
    layers = getattr(config, "num_hidden_layers", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1  # Qwen3-MoE: every step-th layer, but mlp_only_layers
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return experts, top_k, width, moe_layers


def inactive_expert_params(config):
    """The experts' weights a token does not pass through: (experts - top-k) of every MoE layer's
    experts, each a gated MLP (3 x hidden x width, gpt-oss's biases 2 x width + hidden)."""
    moe = experts_of(config)
    if moe is None:
        return 0
    experts, top_k, width, layers = moe
    hidden = config.hidden_size
    per_expert = 3 * hidden * width + (2 * width + hidden if getattr(config, "model_type", "") == "gpt_oss" else 0)
    return layers * (experts - top_k) * per_expert


def flops_per_token(config, params, length):
    """Training FLOPs per token of a transformer: 6 per parameter a token passes through (forward and
    backward; a mixture of experts' active ones: the inactive experts' left out) plus attention's
    12 x layers x hidden x length (Chowdhery et al. 2022, PaLM, appendix B). `params` 0: attention's
    part alone (kernels.attention._flops)."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 0
    active = params - inactive_expert_params(config) if params else 0
    return 6 * active + 12 * layers * hidden * length
