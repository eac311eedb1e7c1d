"""fp32 <-> bf16 / fp16 conversions for the kernels, exact under Triton's interpreter too.

On the GPU :func:`to_f32` and :func:`cast` are plain ``x.to(...)`` casts: the hardware widens exactly and
rounds to nearest even, subnormals included.

Under Triton's interpreter (:data:`INTERPRETED`, CPU tensors) numpy has no bf16, so the interpreter holds
bf16 tensors as their raw uint16 bits and converts them with its own bit arithmetic, which truncates
fp32 -> bf16 instead of rounding and gets subnormals wrong both ways (a silent wrong answer, contract
section 8). There the bf16 conversions are integer operations: widening moves the 16 bits into the top half
of an fp32 pattern (what the hardware does); narrowing rounds the fp32 pattern to nearest even. fp16 is a
numpy dtype, whose casts are already exact, so it takes the plain cast everywhere.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def to_f32(x):
    """fp32 value of a bf16 / fp16 / fp32 tile, exactly."""
    if INTERPRETED:
        if x.dtype == tl.bfloat16:
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def cast(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest even); NaN stays NaN."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            # Adding 0x7FFF plus the kept part's lowest bit rounds to nearest, ties to even; a carry out of
            # the mantissa moves to the next binade (or to inf past the largest bf16), as it should.
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            y = tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


# Whether Triton's interpreter runs the kernels: triton.jit made them InterpretedFunctions (TRITON_INTERPRET=1
# when this module was imported). A module constant, not a kernel argument: on the GPU the branches above are
# not compiled, and the kernels' signatures, launch arguments and code stay as they are.
INTERPRETED = tl.constexpr(isinstance(to_f32, InterpretedFunction))
