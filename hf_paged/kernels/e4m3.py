"""Rounding to float8_e4m3fn in float32 arithmetic, shared by the kernels that quantize (the
FP8 KV cache's store, the activations of the w8a8 GEMM).

The hardware conversion rounds to nearest, ties to even; Triton's interpreter, which the CPU
tests run, rounds ties up and does not carry a rounded-up mantissa into the exponent (124.3
became 64). Rounding first makes the conversion that follows exact on both."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_e4m3(v):
    """``v`` (float32, within float8_e4m3fn's range) rounded to the nearest float8_e4m3fn
    value, ties to even, with its sign kept (a negative value rounding to zero is -0, as the
    cast gives)."""
    bits = v.to(tl.int32, bitcast=True)
    # The spacing of e4m3 values around v: 3 mantissa bits below its leading one, and 2**-9
    # (the subnormals') below 2**-6; as a biased float32 exponent.
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6) - 3
    step = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
    # Adding and taking away 1.5 * 2**23 rounds |v| / step <= 16 to an integer, ties to even.
    rounded = ((tl.abs(v) * inverse + 12582912.0) - 12582912.0) * step
    # The sign put back as a bit: negation compiles to 0 - x on the GPU, which turns -0 to +0.
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
