"""A LoRA base kept in 8 or 4 bits on XLA (TPU, XLA:CPU) and on the plain CPU: the frozen linear
projections quantized on the host as the base loads (kernels.quant_load) or once it is loaded
(`quantize_base`; the same `projections`, the same result), each a `QuantLinear` whose forward
dequantizes inside the graph through the package's own autograd function, with peft's LoRA layer
beside it (`QuantLoraLinear`, through peft's custom-module dispatch).

Layouts (weight [out, in], quantized on the host, once):
- int8: one byte a parameter, a float32 scale per output row (symmetric, absmax / 127).
- 4-bit: two 4-bit codes a byte (uint8 [out, in / 2], low nibble first), a float32 scale per
  block of `BLOCK` inputs of each row (absmax of the block), the codes looked up in a 16-entry
  code book in the graph: NF4 (QLoRA's, `NF4_CODE` in kernels.quant) for `Quant.kind == "nf4"`;
  `nested`: the block scales quantized again to int8 in blocks of `NESTED_BLOCK` (float32 scale
  each, after subtracting their mean: bitsandbytes' double quantization, in its layout's spirit,
  with the groups and the mean each row's own: 8 bytes a row more than bitsandbytes keeps).
Each buffer is a function of its own output rows, so the rows a host reads are quantized alone as
the whole weight would quantize them (`quantize_rows`: under FSDPv2 each host quantizes its devices'
slices, parallel.sharded_load).

Why not torch_xla's own pieces whole (torch_xla 2.9, torch_xla/experimental/xla_quantized_matmul.py):
`torch.ops.xla.quantized_matmul` has no autograd kernel (the input's gradient comes back None, so
adapters below a quantized layer would silently get none): it is called inside `_QuantMatmul`'s
forward only, for int8 on an XLA device, and the backward is ours. Its int4 path
(`int4_weight=True`) copies the whole weight to the host on every call
(`_xla_cast_int4(w, w.cpu()...tolist())`) and keeps one code a byte: not used; 4-bit unpacks its
nibbles with shifts and masks on the device."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

from ..core.errors import UserError
from ..core.roles import blocks_of
from .quant import BLOCK, INT4_CODE, NESTED_BLOCK, NF4_CODE, Quant

# Linear modules inside a block that stay in the training precision: a mixture's router (Qwen2-MoE's
# `gate`, `shared_expert_gate`; transformers 5's Mixtral/Qwen3-MoE routers are no Linear anyway)
KEEP = ("gate", "shared_expert_gate", "router")


def code_book(kind: str) -> tuple[float, ...]:
    """The 16 values a 4-bit code stands for, times its block's scale: "nf4" (QLoRA's NormalFloat)
    or "int4" (symmetric integers -8..7 over 7)."""
    return {"nf4": NF4_CODE, "int4": INT4_CODE}[kind]


def quantize(weight: torch.Tensor, kind: str, block: int = BLOCK, nested: bool = False) -> dict[str, torch.Tensor]:
    """`weight` [out, in] quantized (on its device; the base's are on the host): the buffers of a
    QuantLinear by name. kind "int8": qweight int8 [out, in], scales [out]; "nf4" / "int4": qweight
    uint8 [out, in / 2] (two codes a byte, low nibble first), scales [out, in / block], and with
    `nested` the scales as int8 (scales) with `scale_scales` [out, ceil(in / block / NESTED_BLOCK)] and
    `scale_mean` [out] (`_nest`). Every buffer holds a row per output row, computed from that row alone."""
    w = weight.detach().float()
    if kind == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        return {"qweight": torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), "scales": scale}
    out, n = w.shape
    blocks = w.view(out, n // block, block)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-12)
    code = torch.tensor(code_book(kind))
    midpoints = (code[1:] + code[:-1]) / 2  # the nearest value of the sorted code book
    codes = torch.bucketize((blocks / scale[..., None]).reshape(out, n), midpoints).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"qweight": packed, **(_nest(scale) if nested else {"scales": scale})}


def _nest(scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Double quantization, row by row: each output row's float32 block scales [out, n] as int8 in
    groups of NESTED_BLOCK, each group with a float32 scale [out, ceil(n / NESTED_BLOCK)], after the
    row's mean [out] is taken out (bitsandbytes' `offset`, which is one a tensor over groups that
    run across rows: here every buffer is the rows' own, so a host quantizes the rows it reads alone
    and gets what quantizing the whole weight gives them: parallel.sharded_load)."""
    out, n = scale.shape
    mean = scale.mean(dim=1)
    groups = F.pad(scale - mean[:, None], (0, -n % NESTED_BLOCK)).view(out, -1, NESTED_BLOCK)
    outer = groups.abs().amax(dim=2).clamp(min=1e-12) / 127
    q = torch.round(groups / outer[..., None]).to(torch.int8).view(out, -1)[:, :n]
    return {"scales": q, "scale_scales": outer, "scale_mean": mean}


class QuantLinear(torch.nn.Module):
    """A frozen Linear held quantized (`quantize`'s layouts): buffers only, nothing trainable; the
    bias, if any, a frozen parameter in the training precision. Its forward dequantizes inside the
    graph (`_QuantMatmul`); gradients reach the input, never the weight."""

    qweight: torch.Tensor  # int8 [out, in] or uint8 [out, in / 2]
    scales: torch.Tensor  # float32 [out] or [out, in / block]; int8 where nested
    scale_scales: torch.Tensor  # nested: float32 [out, ceil(in / block / NESTED_BLOCK)]
    scale_mean: torch.Tensor  # nested: float32 [out]
    code: torch.Tensor  # 4-bit: the 16 values of the code book
    bias: torch.nn.Parameter | None

    def __init__(self, linear: torch.nn.Linear, kind: str, block: int = BLOCK, nested: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind, self.nested = kind, nested and kind != "int8"
        self.block = block if kind != "int8" else self.in_features
        # the weight's dtype as loaded: a layer made on the meta device (a model built without its
        # weights) quantizes its rows from the checkpoint in it, as a whole load would (`quantize_rows`)
        self.loaded_dtype = linear.weight.dtype
        for name, value in quantize(linear.weight, kind, self.block, self.nested).items():
            self.register_buffer(name, value.to(linear.weight.device))
        if kind != "int8":  # the code book travels with the layer to its device (16 floats; on the host
            # for a layer on the meta device: it is no checkpoint tensor)
            device = "cpu" if linear.weight.is_meta else linear.weight.device
            self.register_buffer("code", torch.tensor(code_book(kind), device=device))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def ROW_BUFFERS(self) -> tuple[str, ...]:  # noqa: N802  (read as a class's constant, by duck typing)
        """The buffers holding a row per output row (all but the code book): FSDPv2 splits them with
        the rows (XlaFsdp._split_rows), and parallel.sharded_load makes those of a layer on the meta
        device from its devices' rows of the checkpoint's weight (`quantize_rows`)."""
        return tuple(name for name in ("qweight", "scales", "scale_scales", "scale_mean") if hasattr(self, name))

    def quantize_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ROW_BUFFERS of rows `rows` [r, in] of the full-precision weight (read from the
        checkpoint in any dtype): what quantizing the whole weight gives those rows, bit for bit."""
        return quantize(rows.to(self.loaded_dtype), self.kind, self.block, self.nested)

    def row_scales(self) -> torch.Tensor:
        """The scales in float32: [out] (int8) or [out, in / block] (4-bit)."""
        if not self.nested:
            return self.scales
        out, n = self.scales.shape
        groups = F.pad(self.scales.float(), (0, -n % NESTED_BLOCK)).view(out, -1, NESTED_BLOCK)
        return (groups * self.scale_scales[..., None]).view(out, -1)[:, :n] + self.scale_mean[:, None]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in `dtype`, computed from the buffers on their device (shifts, masks
        and a 16-entry lookup: no host transfer). Computed in float32 and rounded to `dtype` once:
        the scales and code values rounded to bf16 before their product would round each weight
        twice (measured: 0.3e-3 more relative error in a bf16 backward's input gradient)."""
        if self.kind == "int8":
            return (self.qweight.float() * self.scales[:, None]).to(dtype)
        packed = self.qweight
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(self.out_features, self.in_features)
        values = self.code[codes.long()].view(self.out_features, -1, self.block)
        return (values * self.row_scales()[..., None]).view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantMatmul.apply(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"block={self.block}, nested={self.nested}, bias={self.bias is not None}")


class _QuantMatmul(torch.autograd.Function):
    """x @ W_deq^T + bias with W_deq = `layer.dequantize()`; backward: the input's gradient grad @ W_deq
    (the dequantized weight computed again, never kept), no weight gradient. Under autocast the
    matmul runs in autocast's dtype, as nn.Linear's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer, ctx.x_dtype = layer, x.dtype
        if layer.kind == "int8" and x.device.type == "xla":
            return _xla_int8(x, layer)
        bias = None if layer.bias is None else layer.bias.to(x.dtype)  # held in bf16 under --precision bf16
        return F.linear(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        w = ctx.layer.dequantize(grad.dtype)
        return (grad @ w).to(ctx.x_dtype), None


def _xla_int8(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """torch_xla's weight-only int8 matmul, per channel (torch_xla 2.9
    experimental/xla_quantized_matmul.py, quantized_matmul_xla: F.linear(x, w_int8) * scale, the
    int8 weight converted inside the graph). The matmul computes in x's dtype, so under autocast x
    goes in autocast's dtype first (as F.linear's autocast would); the product with the float32
    scale comes back float32 and is rounded to that dtype."""
    import torch_xla.experimental.xla_quantized_matmul  # noqa: F401  (defines torch.ops.xla.quantized_matmul)

    dtype = torch.get_autocast_dtype("xla") if torch.is_autocast_enabled("xla") else x.dtype
    # the float32 scale multiplies the matmul's output (F.linear's, in `dtype`) before its rounding
    # to `dtype`: a scale rounded to bf16 would shift every output of its row alike, by up to 0.4%
    out = torch.ops.xla.quantized_matmul(x.to(dtype), layer.qweight, layer.scales).to(dtype)
    return out if layer.bias is None else out + layer.bias.to(dtype)


class QuantLoraLinear(LoraLinear):
    """peft's LoRA Linear over a QuantLinear (peft 0.21.2, tuners/lora/layer.py `Linear`): its forward
    is base_layer(x) + lora_B(lora_A(dropout(x))) * scaling, which needs nothing of the base but its
    call; the adapters keep their own dtype (the base's `qweight` is an integer, which peft's
    `_move_adapter_to_device_of_base_layer` never casts to). Merging is refused: the merge happens
    on the full-precision base, loaded again (models.save_merged)."""

    def _get_in_out_features(self, module: torch.nn.Module) -> tuple[int, int]:
        # peft's module-level _get_in_out_features reads these too, with an "Unsupported layer type" warning
        assert isinstance(module, QuantLinear)  # the only type register_lora maps here
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise UserError("a LoRA adapter over a quantized base is not merged onto the rounded weights: merge it "
                        "onto the full-precision base (`merge_lora` loads it again)")

    def unmerge(self) -> None:
        pass  # never merged


def register_lora(config: Any, model: torch.nn.Module) -> None:
    """peft's LoraConfig `config` told to put QuantLoraLinear on `model`'s QuantLinear modules.
    Private peft API, pinned to peft 0.21.2: `LoraConfig._register_custom_module(mapping)`
    (peft/tuners/lora/config.py) and LoraModel._create_new_module's dynamic dispatch
    (peft/tuners/lora/model.py), which calls `QuantLoraLinear(target, adapter_name, config=config,
    **kwargs)` as dispatch_default calls lora.Linear. The mapping is not written to
    adapter_config.json: the adapter saves as over nn.Linear."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        config._register_custom_module({QuantLinear: QuantLoraLinear})


def layout(quant: Quant) -> str:
    """The QuantLinear layout (`quantize`'s kind) that holds a base under `quant` on XLA; fp4 is one line."""
    if quant.kind == "fp4":
        raise UserError("`bnb_4bit_quant_type` fp4 runs on the cuda and cpu backends (bitsandbytes); the xla "
                        "backend's 4-bit base is nf4")
    return "int8" if quant.bits == 8 else quant.kind


def projections(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """The linear projections a quantized base holds as QuantLinear, one rule for a model loaded whole
    (`quantize_base`) and one quantized while it loads (kernels.quant_load, on the meta device):
    (qualified name, parent, attribute, linear) of each nn.Linear inside `model`'s transformer blocks
    (transformers' `_no_split_modules`: attention and MLP); never the embeddings, the head, a router
    (KEEP), a mixture's stacked experts (3-D parameters, no Linear: they stay in the training
    precision) or an odd width (two 4-bit codes a byte)."""
    inside = {id(m) for b in blocks_of(model) for m in b.modules()}
    return [(f"{path}.{name}" if path else name, parent, name, child)
            for path, parent in model.named_modules() if id(parent) in inside
            for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and name not in KEEP and child.in_features % 2 == 0]


def quantized(linear: torch.nn.Linear, quant: Quant, block: int = BLOCK) -> QuantLinear:
    """`linear` as a QuantLinear under `quant`, in its mode (from_pretrained leaves a model in eval
    mode): 4-bit in blocks of `block` inputs (a row whose width `block` does not divide is one block)."""
    size = block if linear.in_features % block == 0 else linear.in_features
    return QuantLinear(linear, layout(quant), size, quant.nested).train(linear.training)


def nothing_to_quantize(model: torch.nn.Module, quant: Quant) -> UserError:
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return UserError(f"{quant.flag}: {model_type} has no linear projections in its transformer blocks to quantize")


def quantize_base(model: torch.nn.Module, quant: Quant, block: int = BLOCK) -> int:
    """`model`'s `projections` replaced in place by QuantLinear (`quantized`). Returns how many; a
    model with none is one line. (A run loads the base quantized tensor by tensor instead:
    kernels.quant_load; this is the same result from a model already whole.)"""
    layout(quant)
    found = projections(model)
    for _, parent, name, child in found:
        setattr(parent, name, quantized(child, quant, block))
    if not found:
        raise nothing_to_quantize(model, quant)
    return len(found)


def base_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s QuantLinear buffers (weights, scales, code books)."""
    return sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantLinear)
               for b in m.buffers())
