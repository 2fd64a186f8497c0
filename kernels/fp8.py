"""float8_e4m3fn in Triton: the encoder the cache-write kernel stores with.

Reading fp8 needs nothing here: the attention kernels load the cache as ``float8e4nv`` and widen it
with ``.to()`` (a native conversion on compute capability 8.9+, exact in Triton's CPU interpreter).

Writing is done in integer arithmetic instead of ``.to(tl.float8e4nv)``: Triton's CPU interpreter
rounds float32 -> e4m3 wrongly whenever rounding carries into the exponent (0.0305 becomes 2^-6
instead of 2^-5, measured on triton 3.9), so the interpreter tests could not check the GPU's
rounding.  The integer encoder below is round-to-nearest-even, identical to torch's
``.to(torch.float8_e4m3fn)`` on every input (checked exhaustively over random float32/bf16/fp16
in tests/kernels/test_fp8_kv.py), the same on every device.  It costs ~10 integer operations per
element, in a kernel that writes one token per sequence per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def e4m3_bits(x):
    """The float8_e4m3fn bit pattern (uint8) of float32 ``x``: clamped to +-448, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    # Normal range (>= 2^-6): drop 20 of float32's 23 mantissa bits, rounding half to even; a carry
    # out of the mantissa lands in the exponent, which is what rounding up to the next binade means.
    # Then rebias the exponent from 127 to 7 (120 << 3 in the shifted pattern).
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals (< 2^-6) are multiples of 2^-9: a * 512 rounded to an integer; adding and removing
    # 2^23 rounds it half to even (float32 addition does).  A result of 8 is the smallest normal, 0x08.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)
