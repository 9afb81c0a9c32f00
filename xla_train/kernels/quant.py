"""A LoRA base kept in 8 or 4 bits (--load-in-8bit, --load-in-4bit): which quantization a run asks for.
Imports no torch at module level (the options read `Quant`)."""

from __future__ import annotations

from dataclasses import dataclass

FOUR_BIT_TYPES = ("nf4", "fp4")  # bitsandbytes' 4-bit types (TRL's --bnb_4bit_quant_type)


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
