"""A LoRA base kept in 8 or 4 bits (--load-in-8bit, --load-in-4bit): which quantization a run asks for.
Imports no torch at module level (the options read `Quant`)."""

from __future__ import annotations

from dataclasses import dataclass

FOUR_BIT_TYPES = ("nf4", "fp4")  # bitsandbytes' 4-bit types (TRL's --bnb_4bit_quant_type)
BLOCK = 64  # 4-bit: inputs per scale (bitsandbytes' default blocksize for NF4)
NESTED_BLOCK = 256  # double quantization: 4-bit scales per int8 scale (bitsandbytes' nested blocksize)

# QLoRA's NormalFloat4 code book, as bitsandbytes 0.50.2 publishes it (bitsandbytes/functional.py,
# get_4bit_type("nf4"): quantiles of N(0, 1), create_normal_map(offset=0.9677083, use_extra_value=True)),
# in increasing order; a code is its index. The XLA path (kernels.quant_xla) looks it up in the graph.
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
# Symmetric int4 (-8..7, the absmax at 7), measured against NF4 in blocks of 64 (2026-12-01): the
# projections' relative RMS error 0.115 (int4) and 0.094 (NF4) on the bundled MiniLM's pretrained
# weights, 0.105 and 0.092 on a tiny Llama's random normal ones; so `kind` "nf4" is NF4 on XLA too.
INT4_CODE = tuple((i - 8) / 7 for i in range(16))


@dataclass(frozen=True)
class Quant:
    """The frozen base's linear projections held in `bits` (8 or 4) bits: `kind` "int8" (8 bits),
    "nf4" or "fp4" (4 bits); `nested`: the 4-bit scales quantized too (double quantization)."""

    bits: int
    kind: str
    nested: bool = False

    @property
    def flag(self) -> str:
        return f"--load-in-{self.bits}bit"

    def weight_bytes(self, out_features: int, in_features: int, block: int = BLOCK) -> int:
        """The bytes a Linear [out, in] takes quantized on XLA (kernels.quant_xla.QuantLinear's buffers):
        int8 one byte a weight and a float32 scale a row; 4-bit half a byte a weight, a float32 scale
        per `block` inputs of a row (a row `block` does not divide: one), nested: those scales in
        int8 with a float32 scale per NESTED_BLOCK and their mean, and the 16 floats of the code book."""
        if self.bits == 8:
            return out_features * in_features + 4 * out_features
        scales = out_features * (in_features // block if in_features % block == 0 else 1)
        scale_bytes = scales + 4 * -(-scales // NESTED_BLOCK) + 4 if self.nested else 4 * scales
        return out_features * in_features // 2 + scale_bytes + 4 * 16
