"""A LoRA base kept in 8 or 4 bits (--load-in-8bit, --load-in-4bit): which quantization a run asks for.
Imports no torch at module level (the options read `Quant`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        """The option as the library's messages name it (`load_in_8bit`): --load-in-8bit on the command line."""
        return f"`load_in_{self.bits}bit`"


# What a quantized projection keeps, one rule for the memory plan (memory.shape_of) and the benchmarks.
# The layouts are bitsandbytes 0.50's, which the XLA path keeps too:
# - int8 (LLM.int8, bitsandbytes/nn/modules.py Int8Params: CB, SCB from F.int8_vectorwise_quant): the
#   [out, in] weight in int8 and one fp32 scale an output row;
# - 4-bit (bitsandbytes/functional.py quantize_4bit, blocksize 64): two weights a byte and one fp32
#   absmax a block of 64 weights (the XLA path's blocks run over the input dimension, the same count
#   where `in` is a multiple of 64, as in every published model);
# - nested (compress_statistics: QuantState.state2): the absmax of each block quantized to one byte
#   (quantize_blockwise), with one fp32 absmax a block of 256 of those: 0.5 + 1/64 + 4/(64 x 256)
#   bytes a weight, 0.127 bits of scales a weight. The XLA path (kernels.quant_xla) groups them
#   within each output row and takes each row's mean out (bitsandbytes: one offset, groups across
#   rows), so that a host quantizes its rows alone: an fp32 scale per row and per group of 256 of
#   its blocks, 8 bytes a row of Llama 3.1's 4,096 to 14,336 weights where bitsandbytes keeps about
#   one: the plan counts the XLA path's, the larger by at most 8 bytes a row.
#   The per-tensor constants (the 16- and 256-entry code books, the offset) are left out: about
#   1 KiB a projection.


def quantized_weight(module: Any) -> Any:
    """The packed weight of the XLA path's QuantLinear (kernels.quant_xla: its `qweight` buffer), or
    None for any other module: the one rule that tells a projection held quantized on XLA, for the
    memory plan (which imports neither peft nor torch_xla) and the models' checks alike."""
    return getattr(module, "qweight", None)


def projection_bytes(quant: Quant, out_features: int, in_features: int) -> int:
    """Bytes a frozen [out_features, in_features] linear projection is kept in under `quant`, scales
    included (the layouts above)."""
    weights = out_features * in_features
    if quant.bits == 8:
        return weights + 4 * out_features
    row_blocks = -(-in_features // BLOCK)
    blocks = out_features * row_blocks
    scales = blocks + 4 * out_features * (-(-row_blocks // NESTED_BLOCK) + 1) if quant.nested else 4 * blocks
    return -(-weights // 2) + scales
