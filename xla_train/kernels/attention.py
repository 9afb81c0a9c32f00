"""Packed causal-LM rows: every document attends causally to itself only, with or without an L x L
mask, chosen per device.

A packed row carries `segments` ([rows, length] integers: 1..k for its documents, 0 for padding).
`document_inputs(model, segments)` returns the extra keyword arguments of `model(**inputs, **extra)`
that keep the documents apart, by one of three paths (`PATHS`):

    mask    the reference, and the fallback everywhere: a 4-D boolean mask [rows, 1, L, L] (same
            segment and causal), a float bias (0 / finfo.min) for eager attention. It defines the
            semantics; padding (segment 0) attends to earlier padding, so no row of it is empty.
    flex    torch's FlexAttention with a document block mask built from the segments (causal
            within a document, the family's sliding window, Gemma 2's soft-capping as a score_mod,
            grouped-query attention by enable_gqa). Compiled (`torch.compile(flex_attention)`, the
            fused kernel) on CUDA; eager elsewhere (an unfused reference that runs on the CPU).
    pallas  on a TPU only, each layer through the Pallas kernel one rule picks (core.xla.pallas_layer:
            which kernel serves the layer's row length, heads, window, soft cap and sinks, and at what
            cost): torch_xla's flash attention with segment ids (torch_xla/experimental/custom_kernel.py,
            flash_attention), or jax's splash attention through torch_xla's call_jax (`splash_attention`:
            segment ids, the layer's window, soft-capping, gpt-oss's sinks); a layer neither serves
            takes the mask path, windowed.

A model whose layers have a sliding window shorter than the row gets one mask per window: a dict
keyed by layer type where the config names them (`config.layer_types`; transformers 5.24's
Gemma 2/3, gpt-oss and Qwen2 take `attention_mask` as such a dict, `causal_mask_mapping`), else
one windowed mask (Mistral: every layer has the window). flex applies each layer's window itself.

Which device runs which kernel is its role's to say (roles.serve, roles.Kernel: core.xla declares pallas
on a TPU with the rule for its layers, gpu_fallback flex on CUDA and the CPU).
`attention="auto"` takes the kernel a device declares for it where the model and the rows' length
can be served (`why_not`), otherwise the mask (the CPU, XLA:CPU, TorchTPU; `fallback_note` says
why on the console). An explicit path that cannot serve raises UserError with the reason.

How the segment paths reach the attention (transformers 5.24): keyword arguments given to
`model(...)` travel as `**kwargs: Unpack[TransformersKwargs]` through the model, each decoder
layer and its attention module into the attention function named by
`config._attn_implementation` (LlamaAttention.forward: `attention_interface(self, q, k, v,
attention_mask, dropout=..., scaling=..., **kwargs)`; Qwen2 and Mistral add `sliding_window`,
Gemma 2 `sliding_window` and `softcap`). The model is switched once to `xla_train_documents_over_<its
implementation>`, an attention function registered here (one name per former implementation, so
a copy of the model knows it too) that serves a call carrying `documents=` with the kernel and
hands every other call (generation after training, a plain forward) to the implementation the
model had before, with that implementation's own mask function. A segment call passes a 4-D
`attention_mask` that is only the segments' view [rows, 1, 1, L]: masking_utils returns a 4-D
mask as it is (`_preprocess_mask_arguments`: "If the mask is already 4D, simply return as-is"),
so no L x L mask is built, in any layer or for any layer type.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import UserError
from ..parallel.mesh import rows_entry

if TYPE_CHECKING:
    import torch

PATHS = ("auto", "mask", "flex", "pallas")
# the transformers attention implementations registered here, one per former implementation, whose
# name says it (`xla_train_documents_over_sdpa`): a copy of a switched model (copy.deepcopy, a
# reference model) still knows what to run for calls without documents
DOCUMENT_ATTENTION = "xla_train_documents"
_OVER = DOCUMENT_ATTENTION + "_over_"


# ---------------------------------------------------------------------------------------------
# Which path


def kind_of(tensor: torch.Tensor) -> str:
    """Where `tensor` lives, as the paths tell devices apart: "xla-tpu" (torch_xla on a TPU),
    "xla" (torch_xla elsewhere: XLA:CPU, XLA:GPU), "cuda", "cpu", or the torch device type
    (TorchTPU's "tpu", ...)."""
    kind = tensor.device.type
    if kind == "xla":
        import torch_xla.runtime as xr

        return "xla-tpu" if xr.device_type() == "TPU" else "xla"  # PJRT's device type
    return kind


def unwrapped(model):
    """The transformers model inside the wrappers (DDP, FSDP, torch.compile, peft)."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif hasattr(model, "get_base_model") and not hasattr(model, "set_attn_implementation"):
            model = model.get_base_model()
        elif not hasattr(model, "config") and hasattr(model, "module"):  # DDP, FSDP
            model = model.module
        else:
            return model


def _implementation(config) -> str | None:
    """The implementation a config runs for calls without documents: its own, or for a switched
    one the former implementation its name carries."""
    name = getattr(config, "_attn_implementation", None)
    return name[len(_OVER):] if name and name.startswith(_OVER) else name


def switched(config) -> bool:
    """Whether a config runs the documents' attention (use_documents switched it)."""
    return str(getattr(config, "_attn_implementation", None) or "").startswith(_OVER)


def _config_value(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


# what each kernel is, for the messages (where it runs is its device roles' to declare: roles.serve)
_WHAT = {"flex": "torch's FlexAttention", "pallas": "Pallas flash and splash attention, TPU kernels"}


def _kernels():
    """The kernels the device roles declared (roles.KERNELS; imported here, not at the top: the
    options import this module, and `--help` imports no torch)."""
    from ..core.roles import KERNELS

    return KERNELS


def _head_dim(config) -> int | None:
    heads = _config_value(config, "num_attention_heads", "n_head")
    width = _config_value(config, "hidden_size", "n_embd")
    return getattr(config, "head_dim", None) or (width // heads if width and heads else None)


def _has_sinks(model) -> bool:
    """Whether the attention adds learned sinks to the softmax (gpt-oss's `sinks`, passed to the
    attention function as `s_aux`: transformers 5.24 modeling_gpt_oss.py, GptOssAttention)."""
    import torch

    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())


def why_not(path: str, kind: str, model, length: int | None = None) -> str | None:
    """Why `path` cannot keep `model`'s documents apart on a `kind` device (see `kind_of`)
    for rows of `length` tokens, or None where it can. The mask path always can."""
    if path not in PATHS:
        return f"attention {path!r} is none of {', '.join(PATHS)}"
    if path in ("mask", "auto"):
        return None
    kernel = _kernels().get((kind, path))
    if kernel is None:
        where = sorted(k for k, p in _kernels() if p == path)
        return (f"{path} ({_WHAT[path]}) does not run on {kind} devices"
                + (f" (it runs on {', '.join(where)})" if where else ""))
    hf = unwrapped(model)
    config = getattr(hf, "config", None)
    # the family's attention goes through transformers' attention functions with their keywords
    if config is None or not getattr(hf, "_supports_attention_backend", False):
        return f"{type(hf).__name__}'s attention does not take a registered attention function"
    if _implementation(config) not in ("sdpa", "eager", "xla_sdpa"):
        return f"the model runs {_implementation(config)} attention"
    if _has_sinks(hf) and kernel.layer is None:
        return f"the model adds attention sinks (gpt-oss's s_aux), which {path} does not take"
    reason = _config_refusal(kernel, config)
    if reason:
        return reason
    reason = kernel.refusal(length, _head_dim(config)) if kernel.refusal else None
    if reason or length is None or kernel.layer is None:
        return reason
    plans = layer_plans(kernel, config, length)
    # a layer no kernel serves takes the mask path inside this one (Documents.attend); none served: the mask
    return None if any(plan.kernel for plan, _ in plans.values()) else next(iter(plans.values()))[0].reason


def choose(attention: str, kind: str, model, length: int | None = None) -> str:
    """The path that keeps documents apart: `attention` itself where it can serve (else
    UserError), or for "auto" the kernel the device's role declares for auto (roles.serve: pallas
    on a TPU through torch_xla, flex on CUDA) where it can serve, otherwise the mask."""
    if attention == "auto":
        wanted = auto_kernel(kind)
        return wanted if wanted and why_not(wanted, kind, model, length) is None else "mask"
    reason = why_not(attention, kind, model, length)
    if reason:
        raise UserError(f"attention {attention}: {reason}")
    return attention


def auto_kernel(kind: str) -> str | None:
    """The kernel `attention="auto"` takes on a `kind` device where it can serve, or None."""
    return next((path for (k, path), kernel in _kernels().items() if k == kind and kernel.auto), None)


def fallback_note(attention: str, kind: str, model, length: int | None) -> str | None:
    """The console's line where "auto" takes the mask path although the device has a kernel, or where
    the kernel's path leaves some layers on it (Kernel.layer: no kernel serves them)."""
    wanted = auto_kernel(kind) if attention == "auto" else None if attention == "mask" else attention
    reason = why_not(wanted, kind, model, length) if wanted else None
    if reason:  # auto took the mask (choose refuses an explicit path that cannot serve)
        return f"attention: the mask path ({length} x {length} per row), not {wanted}: {reason}"
    kernel = _kernels().get((kind, wanted)) if wanted else None
    if kernel is None or kernel.layer is None or length is None:
        return None
    config = unwrapped(model).config
    masked = {w: plan for w, (plan, n) in layer_plans(kernel, config, length).items() if plan.kernel is None and n}
    return "; ".join(f"attention: {'layers with a window of ' + str(w) if w else 'full layers'} on the mask path "
                     f"({length} x {length} per row): {plan.reason}" for w, plan in masked.items()) or None


def _config_refusal(kernel, config) -> str | None:
    """The reasons of `why_not` that the config alone tells (row_length asks before the model loads)."""
    if _config_value(config, "attention_dropout", "attn_pdrop"):  # neither kernel drops attention weights
        return "the model drops attention weights (attention dropout > 0), which the kernels do not"
    if not kernel.softcap and getattr(config, "attn_logit_softcapping", None):
        return f"the model soft-caps its attention scores (Gemma 2), which {kernel.path} does not"
    return None


def _config_sinks(config) -> bool:
    """Whether a config's attention has learned sinks: gpt-oss's always does (transformers 5.24
    modeling_gpt_oss.py, GptOssAttention.sinks), which a config says by its model type only."""
    return getattr(config, "model_type", None) == "gpt_oss"


def _layer_count(config) -> int:
    return _config_value(config, "num_hidden_layers", "n_layer") or 0


def layer_plans(kernel, config, length: int) -> dict[int | None, tuple[Any, int]]:
    """The kernel's rule (Kernel.layer) for each sliding window of the config's layers at rows of
    `length` tokens (None: the full ones): window -> (roles.LayerPlan, how many layers have it)."""
    windows = layer_windows(config, length)
    types = getattr(config, "layer_types", None) or [None] * _layer_count(config)
    softcap = getattr(config, "attn_logit_softcapping", None)
    plans: dict[int | None, tuple[Any, int]] = {}
    for window in dict.fromkeys(windows.values()):
        plan = kernel.layer(length, _head_dim(config), window, softcap, _config_sinks(config))
        plans[window] = (plan, sum(windows.get(t) == window for t in types))
    return plans


def _flops(config, length: int, kernel=None) -> float:
    """Training FLOPs of one token in a row of `length`: 6 per weight (PaLM's count,
    core.peaks.flops_per_token) and the attention of each layer on the path it takes there, the kernel's
    (Kernel.layer's cost: its blocks, forward and backward) or, without a kernel or where it serves no
    layer, the mask path's (every score: PaLM's 12 x width x length). A first-order count, not a TPU
    measurement: it leaves out memory traffic, where the mask path's L x L mask and scores cost most."""
    width = _config_value(config, "hidden_size", "n_embd") or 0
    layers = _layer_count(config)
    heads = _config_value(config, "num_attention_heads", "n_head") or 1
    kv = _config_value(config, "num_key_value_heads") or heads
    head_dim = _head_dim(config) or 0
    inner = _config_value(config, "intermediate_size", "n_inner") or 4 * width
    weights = layers * (2 * width * heads * head_dim + 2 * width * kv * head_dim + 3 * width * inner)
    if kernel is None or kernel.layer is None:
        products = layers * 6 * length * length
    else:
        products = sum(plan.cost * n for plan, n in layer_plans(kernel, config, length).values())
    return 6 * weights + 2 * heads * head_dim * products / length


def row_length(attention: str, kind: str, config, length: int, packed: bool) -> int:
    """The row length to use for rows of `length` tokens: `length`, or where `attention` would
    take the device's kernel but no kernel serves `length`, the next length one serves
    (Kernel.round_up), where that costs fewer FLOPs than `length` does (`_flops`, each layer on the
    path it takes at each length): per token for packed rows, whose added tokens are documents; per
    row for padded ones, whose added tokens are padding. Not measured on a TPU: a first-order count."""
    path = auto_kernel(kind) if attention == "auto" else attention
    kernel = _kernels().get((kind, path)) if path not in (None, "mask") else None
    if kernel is None or kernel.round_up is None or kernel.layer is None or _config_refusal(kernel, config):
        return length
    if kernel.refusal and kernel.refusal(length, _head_dim(config)):
        return length

    def served(n):
        return any(plan.kernel for plan, _ in layer_plans(kernel, config, n).values())

    longer = length if served(length) else kernel.round_up(length)
    if longer == length or not served(longer):
        return length
    rows = (1, 1) if packed else (length, longer)  # tokens a row costs, at `length` and at `longer`
    return longer if rows[1] * _flops(config, longer, kernel) < rows[0] * _flops(config, length, kernel) else length


def row_lengths_line(attention: str, kind: str, lengths: list[int], rounded: list[int]) -> str | None:
    """The console's line where `row_length` rounded any of `lengths` up."""
    if lengths == rounded:
        return None
    path = auto_kernel(kind) if attention == "auto" else attention
    pairs = ", ".join(f"{a} -> {b}" for a, b in zip(lengths, rounded) if a != b)
    return f"attention: rows rounded up to lengths {path} serves ({pairs}), fewer FLOPs than the mask path at theirs"


def layer_windows(config, length: int) -> dict[str | None, int | None]:
    """Each layer type's sliding window where it is shorter than `length` (else None): keyed by
    the types a config names (transformers' `config.layer_types`: "full_attention",
    "sliding_attention"; Gemma 2/3, gpt-oss, Qwen2 take a mask per type), or {None: window} for
    a model whose every layer has the config's window (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if not window or window >= length or not getattr(config, "use_sliding_window", True):
        window = None
    types = getattr(config, "layer_types", None)
    if not types:
        return {None: window}
    return {t: window if t == "sliding_attention" else None for t in dict.fromkeys(types)}


# ---------------------------------------------------------------------------------------------
# The entry point


def document_inputs(model, segments: torch.Tensor, device_kind: str | None = None, attention: str = "auto", *,
                    compiled: bool | None = None, kernels: dict[str, Callable] | None = None) -> dict[str, Any]:
    """The keyword arguments that keep a packed batch's documents apart in `model(**inputs,
    **extra)`: `segments` [rows, length] (1..k per document, 0 for padding); `device_kind` as
    `kind_of` names it (None: the segments' device); `attention` one of PATHS.

    mask:   {"attention_mask": the 4-D mask (boolean; a float bias for eager attention)}
    flex, pallas: {"attention_mask": the segments as [rows, 1, 1, L] (transformers builds no
            mask from a 4-D one), "documents": Documents} with the model switched to
            DOCUMENT_ATTENTION (once; other calls run its former attention unchanged).
    `compiled`: flex through torch.compile (None: on CUDA). `kernels`: Pallas functions to call instead
    of the package's ("flash": torch_xla's flash_attention, "splash": `splash_attention`), with their
    signatures (tests run them interpreted and record their arguments)."""
    kind = device_kind or kind_of(segments)
    length = segments.shape[1]
    path = choose(attention, kind, model, length)
    config = unwrapped(model).config
    if path == "mask":
        eager = eager_attention(config)
        windows = layer_windows(config, length)
        if len(set(windows.values())) == 1:  # one mask serves every layer
            return {"attention_mask": document_mask(segments, eager, next(iter(windows.values())))}
        masks: dict[int | None, torch.Tensor] = {}  # one a window, shared by the layer types that have it
        for window in windows.values():
            if window not in masks:
                masks[window] = document_mask(segments, eager, window)
        return {"attention_mask": {t: masks[w] for t, w in windows.items()}}
    use_documents(model)
    documents = Documents(path, segments, compiled=segments.device.type == "cuda" if compiled is None else compiled,
                          kernels=kernels or {}, rule=_kernels()[(kind, path)].layer)
    if path == "flex":
        documents.block_mask(None)  # built here, once per forward, not in every layer
        window = getattr(config, "sliding_window", None)
        if window is not None and window < length:
            documents.block_mask(window)
    return {"attention_mask": segments[:, None, None, :], "documents": documents}


def document_mask(segments: torch.Tensor, eager: bool = False, window: int | None = None) -> torch.Tensor:
    """The reference: [rows, 1, L, L], True where a token may attend (same segment, not later,
    and with `window` fewer than `window` tokens back, as transformers' sliding window:
    masking_utils.sliding_window_overlay); with `eager`, eager attention's additive bias (0 where
    it may, finfo(float32).min where not; sdpa takes the booleans)."""
    import torch
    positions = torch.arange(segments.shape[1], device=segments.device)
    mask = (segments[:, None, :, None] == segments[:, None, None, :]) & (positions[:, None] >= positions[None, :])
    if window is not None:
        mask = mask & (positions[:, None] - positions[None, :] < window)
    return mask_for(mask, eager)


def mask_for(mask: torch.Tensor, eager: bool) -> torch.Tensor:
    """A boolean attention mask as an implementation takes it: the booleans (sdpa), or with `eager`
    eager attention's additive bias (0 where a token may attend, finfo(float32).min where not)."""
    import torch
    if not eager:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)


def eager_attention(config) -> bool:
    """Whether a config runs eager attention for calls without documents (its own or, switched,
    its former implementation): its masks are then additive biases (`mask_for`)."""
    return _implementation(config) == "eager"


def use_documents(model) -> None:
    """Switches `model` (through its wrappers) to the documents' attention over its former
    implementation; idempotent. Call it before torch.compile traces the model where the step is
    compiled (document_inputs calls it before the first forward)."""
    hf = unwrapped(model)
    if switched(hf.config):
        return
    hf.set_attn_implementation(register(hf.config._attn_implementation or "eager"))


# ---------------------------------------------------------------------------------------------
# The kernels


@dataclass
class Documents:
    """One forward's packed documents, handed to every attention layer (kwarg `documents`)."""

    path: str  # "flex" | "pallas"
    segments: torch.Tensor  # [rows, length]
    compiled: bool = False  # flex: torch.compile'd kernel and block mask
    kernels: dict = field(default_factory=dict)  # pallas: "flash", "splash" -> the function to call instead
    rule: Callable | None = None  # pallas: which kernel serves a layer (roles.Kernel.layer)
    # flex: sliding window (None: whole document) -> BlockMask; ("mask", window) -> a windowed layer's mask
    masks: dict = field(default_factory=dict)

    def block_mask(self, window: int | None):
        """FlexAttention's block mask: same document, not later, within `window` tokens."""
        length = self.segments.shape[1]
        key = window if window is not None and window < length else None
        if key not in self.masks:
            from torch.nn.attention.flex_attention import create_block_mask

            segments = self.segments

            def same_document(b, h, q, kv):
                keep = (segments[b, q] == segments[b, kv]) & (q >= kv)
                # transformers' sliding window: kv > q - window (masking_utils.sliding_window_overlay)
                return keep & (q - kv < key) if key is not None else keep

            build = _compiled_block_mask() if self.compiled else create_block_mask
            self.masks[key] = build(same_document, segments.shape[0], None, length, length, device=segments.device)
        return self.masks[key]

    def attend(self, module, query, key, value, **kwargs):
        """[rows, heads, L, d] q and [rows, kv heads, L, d] k, v -> ([rows, L, heads, d], None), as
        transformers' attention functions return. Pallas: each layer through the kernel its rule picks
        (flash, splash), or where none serves it the mask path."""
        import torch
        scaling, sliding_window, softcap, sinks = (kwargs.get(k) for k in ("scaling", "sliding_window", "softcap",
                                                                           "s_aux"))
        if kwargs.get("dropout"):
            raise ValueError("the document kernels do not drop attention weights (choose the mask path)")
        length = self.segments.shape[1]
        window = sliding_window if sliding_window is not None and sliding_window < length else None
        kernel = None
        if self.path == "pallas":
            assert self.rule is not None
            kernel = self.rule(length, query.shape[-1], window, softcap, sinks is not None).kernel
            if kernel is None:
                return self._masked(module, query, key, value, window, kwargs)
        elif sinks is not None:
            raise ValueError("flex takes no attention sinks (s_aux; choose the mask path)")
        device = query.device.type
        if torch.is_autocast_enabled(device):  # one dtype, as xla_sdpa does (see core.xla._register_attention)
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        else:
            key, value = key.to(query.dtype), value.to(query.dtype)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.path == "flex":
            out = _flex(self.compiled)(query, key, value, score_mod=_softcap(softcap) if softcap else None,
                                       block_mask=self.block_mask(sliding_window), scale=scale,
                                       enable_gqa=query.shape[1] != key.shape[1])
        elif kernel == "splash":
            out = self._splash(query, key, value, scale, window, softcap, sinks)
        else:
            out = self._pallas(query, key, value, scale, softcap)
        return out.transpose(1, 2).contiguous(), None

    def _masked(self, module, query, key, value, window, kwargs):
        """A layer no Pallas kernel serves, on the mask path: the model's former implementation with the
        documents' mask within `window` tokens (None: the whole document), built once per forward."""
        eager = eager_attention(module.config)
        if ("mask", window) not in self.masks:
            self.masks[("mask", window)] = document_mask(self.segments, eager, window)
        base = _base_attention(module, _implementation(module.config))
        return base(module, query, key, value, self.masks[("mask", window)], **kwargs)

    def _splash(self, query, key, value, scale, window, softcap, sinks):
        """jax's splash attention (core.xla: the rule; `splash_attention`: the call) with the documents'
        segment ids, the layer's window and soft-capping, the model's sinks, k and v as they are."""
        import torch
        segment_ids = self.segments.to(torch.int32)
        spec, _ = _spmd_layout() if query.device.type == "xla" else (None, None)
        groups = query.shape[1] // key.shape[1]
        if spec is not None and spec[1] is not None and groups > 1:
            # heads split over `tensor`: key/value heads that the axis does not divide are kept whole
            # (parallel.tensor_parallel), so they go as the query heads' copies, as flash takes them
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        kernel = self.kernels.get("splash") or splash_attention
        return kernel(query, key, value, segment_ids, sinks, scale=scale, window=window, softcap=softcap)

    def _pallas(self, query, key, value, scale, softcap):
        """torch_xla's Pallas flash attention (torch_xla/experimental/custom_kernel.py,
        flash_attention: q, k, v [batch, heads, length, head_dim], causal, q_segment_ids and
        kv_segment_ids [batch, length], sm_scale, partition_spec and mesh under SPMD)."""
        import torch
        if softcap:
            raise ValueError("flash attention has no soft-capping (choose the mask path)")
        # The kernel takes as many key/value heads as query heads: FlashAttention.forward hands
        # q, k and v to jax's _flash_attention_impl, which reads batch and heads from q's shape
        # (torch_xla's splash test repeats them for its reference, test/test_splash_attention.py,
        # maybe_repeat_kv: repeat_interleave on the head axis, as transformers' repeat_kv).
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # Segment ids as torch_xla's own tests build them: float32 [batch, length], one number per
        # document (test/test_pallas.py, test_flash_attention_wrapper_segment_ids_1 and _2,
        # test_flash_attention_backward_segment_ids; test/test_pallas_spmd.py,
        # test_flash_attention_wrapper_segment_ids_spmd). Padding (0) is a segment of its own, and
        # causal=True masks by position in the row, as the reference mask does.
        segment_ids = self.segments.to(torch.float32)
        kernel = self.kernels.get("flash") or _flash_attention()
        spec, mesh = _spmd_layout() if query.device.type == "xla" else (None, None)
        extra = {"partition_spec": spec, "mesh": mesh} if spec is not None else {}
        return kernel(query, key, value, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                      sm_scale=scale, **extra)


def _flash_attention():
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention


def _spmd_layout():
    """Under SPMD: the batch split by rows over the mesh's first axis, (axis, None, None, None),
    and the mesh (the global one, else one axis over every device, as XlaSpmd's mesh is): what
    test/test_pallas_spmd.py passes (test_flash_attention_wrapper_segment_ids_spmd:
    partition_spec=("data", None, None, None) over xs.get_1d_mesh("data")). The segment ids are
    split by rows the same way (custom_kernel.py, fa_custom_forward: segment_id_partition_spec =
    (partition_spec[0], partition_spec[2])). A mesh with a `tensor` axis (XlaFsdp's under
    --tensor-parallel, which sets it global) splits the heads over it too, as the q, k and v
    projections split them. Outside SPMD: (None, None)."""
    from .megablox import spmd_mesh

    mesh = spmd_mesh()
    if mesh is None:
        return None, None
    heads = "tensor" if "tensor" in mesh.axis_names else None  # parallel.tensor_parallel.TENSOR
    # rows over the row axes (fsdp, and expert where the mesh has it); a row's tokens whole: under
    # context parallelism the partitioner gathers them for the kernel
    return (rows_entry(mesh.axis_names), heads, None, None), mesh


def splash_forward(q, k, v, segment_ids, sinks, scale: float, window: int | None, softcap: float | None, block: int):
    """jax: the function torch_xla's call_jax runs for a splash layer (and tests/splash_interpret.py in TPU
    interpret mode). q [rows, heads, L, d], k and v [rows, kv heads, L, d] (grouped-query heads as they
    are: make_splash_mha takes heads a multiple of k's), segment_ids int32 [rows, L], sinks [rows, heads]
    or None, the rest static. Every document causal, within `window` tokens where given: splash's
    LocalMask((w_left, w_right)) keeps q - w_left <= k <= q + w_right, transformers' window q - k < window
    (masking_utils.sliding_window_overlay), so w_left = window - 1 and w_right = 0 (LocalMask((w, w)) would
    keep one token more). The scale is applied to q, as splash has none (MaxText scales q the same way);
    the soft cap then applies to the scaled scores, as Gemma 2 caps them."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    heads, length = q.shape[1], q.shape[2]
    shape = (length, length)
    mask = sm.LocalMask(shape, (window - 1, 0), 0) if window else sm.CausalMask(shape)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    kernel = sk.make_splash_mha(sm.MultiHeadMask((mask,) * heads), block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, attn_logits_soft_cap=softcap)

    def row(q, k, v, ids, sinks):
        return kernel(q * scale, k, v, sk.SegmentIds(ids, ids), sinks)

    # one row at a time (lax.map: a loop around one kernel call), not jax.vmap as torch_xla's wrapper does:
    # vmap adds a grid dimension that jax 0.7.1's TPU interpret mode cannot run (interpret.py,
    # _get_randomized_grid_coordinates: the dimension semantics do not count it), so the kernel tested here
    # would not be the one a TPU runs. Each call still spans the row's heads and blocks.
    return jax.lax.map(lambda a: row(*a), (q, k, v, segment_ids, sinks))


def splash_backward(q, k, v, segment_ids, sinks, scale, window, softcap, block, do):
    """jax: the gradients of `splash_forward`'s output against `do`: (dq, dk, dv, dsinks or None), by jax.vjp,
    as torch_xla's own splash wrapper takes them (_jax_grad_f): the forward runs again inside."""
    import jax

    def forward(q, k, v, sinks):
        return splash_forward(q, k, v, segment_ids, sinks, scale, window, softcap, block)

    return jax.vjp(forward, q, k, v, sinks)[1](do)


def _run_jax(function, args: tuple, outputs: int):
    """torch_xla's call_jax (torch_xla/core/xla_builder.py) of `function` on `args` (tensors, and static
    values it caches a compilation per). Under SPMD each device runs it on its rows (and heads, split over
    a `tensor` axis), through torch_xla's manual sharding as its flash wrapper does (custom_kernel.py,
    _shard_map in fa_custom_forward): `outputs` tensors come back, each laid out like q or, the sinks'
    gradient, [rows, heads]. Not run here: call_jax lowers a Mosaic call only a TPU executes."""
    from torch_xla.core.xla_builder import call_jax

    spec, mesh = _spmd_layout()
    if spec is None:
        return call_jax(function, args)
    import torch
    from torch_xla.experimental.custom_kernel import _shard_map

    rows = (spec[0], spec[2])  # segment ids, as fa_custom_forward lays them out
    heads = (spec[0], spec[1])  # sinks and their gradient: [rows, heads]
    inputs = [spec, spec, spec, rows, heads, None, None, None, None] + [spec] * (len(args) - 9)
    specs = [spec, spec, spec, heads][:outputs]
    # manual sharding marks its input in place: the tensors autograd saved keep their layout (fa_custom_forward)
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    return _shard_map(lambda *a: call_jax(function, a), mesh, inputs, specs)(*args)


@functools.cache
def _splash_function():
    """The autograd of a splash layer (a class made once: this module imports no torch at import)."""
    import torch

    class Splash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, segment_ids, static, run):
            ctx.save_for_backward(q, k, v, sinks, segment_ids)
            ctx.static, ctx.run = static, run
            return run(splash_forward, (q, k, v, segment_ids, sinks, *static), 1)

        @staticmethod
        def backward(ctx, do):
            q, k, v, sinks, segment_ids = ctx.saved_tensors
            dq, dk, dv, dsinks = ctx.run(splash_backward, (q, k, v, segment_ids, sinks, *ctx.static, do.contiguous()),
                                         4)
            return dq, dk, dv, dsinks, None, None, None

    return Splash


def splash_attention(query, key, value, segment_ids, sinks=None, *, scale: float, window: int | None = None,
                     softcap: float | None = None, run: Callable | None = None):
    """jax's splash attention of one layer, differentiable: q [rows, heads, L, d], k and v [rows, kv heads,
    L, d], segment_ids int32 [rows, L], sinks [heads] or None (gpt-oss's, a parameter: its gradient is
    summed over the rows by autograd), the blocks core.xla.splash_block gives the row. `run`: what runs
    the jax functions (tests: in TPU interpret mode), torch_xla's call_jax unless given."""
    from ..core.xla import splash_block

    rows = query.shape[0]
    sinks_rows = None if sinks is None else sinks[None].expand(rows, -1).contiguous()
    static = (scale, window, softcap, splash_block(query.shape[2]))
    return _splash_function().apply(query.contiguous(), key.contiguous(), value.contiguous(), sinks_rows,
                                    segment_ids, static, run or _run_jax)


@functools.cache
def _flex(compiled: bool):
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    # transformers compiles it the same way (integrations/flex_attention.py, WrappedFlexAttention)
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.cache
def _compiled_block_mask():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    # compiled, it evaluates the mask function block by block instead of over all L x L pairs
    return torch.compile(create_block_mask)


@functools.cache
def _softcap(cap: float):
    """Gemma 2's soft-capping of the scaled scores, cap * tanh(score / cap), as a score_mod
    (Gemma2's eager_attention_forward does it before the mask is added)."""
    import torch

    def score_mod(score, b, h, q, kv):
        return cap * torch.tanh(score / cap)

    return score_mod


# ---------------------------------------------------------------------------------------------
# The transformers registration


def _base_attention(module, name: str | None) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name and name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    # eager: the family's own function, beside its attention class (Gemma 2's soft-caps)
    return sys.modules[type(module).__module__].eager_attention_forward


def documents_attention(module, query, key, value, attention_mask, *args, documents: Documents | None = None,
                        **kwargs):
    """DOCUMENT_ATTENTION: a call with `documents` runs its kernel (the 4-D attention_mask is
    only the segments' view); any other runs the model's former implementation."""
    if documents is not None:
        return documents.attend(module, query, key, value, **kwargs)
    base = _base_attention(module, _implementation(module.config))
    return base(module, query, key, value, attention_mask, *args, **kwargs)


def documents_mask(*args, config=None, **kwargs):
    """DOCUMENT_ATTENTION's mask function: the former implementation's (never reached by a
    segment call, whose 4-D attention_mask masking_utils returns as it is)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = _implementation(config) if config is not None else None
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None  # as masking_utils does for an implementation without a mask function
    return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, config=config, **kwargs)


def register(base: str) -> str:
    """Registers the documents' attention over the implementation `base` with transformers
    (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = _OVER + base
    AttentionInterface.register(name, documents_attention)
    AttentionMaskInterface.register(name, documents_mask)
    return name
