"""Conversions to bfloat16 in the Triton kernels, rounded as a GPU rounds them.

A GPU converts float32 to bfloat16 to nearest, ties to even. Triton's interpreter
truncates (Triton 3.6 and 3.9, stores into a bfloat16 tensor included, whatever
``fp_downcast_rounding`` says), and loses bfloat16's subnormal numbers. Truncation is
biased toward zero: under the interpreter, Skyformer's bfloat16 outputs were twice as
far from float64 as the PyTorch path's (3.3e-3 against 1.7e-3), exact kernelized
attention's 2.5x as far as when rounded to nearest (6.2e-3 against 2.5e-3), and
Skyformer's dq on repeated tokens up to 7x as far as the PyTorch path's
(docs/gpu-record.md, "Conversions to bfloat16 under the interpreter"). The kernels'
tests and accuracy measurements run under the interpreter, so every conversion to a
half type inside the kernels goes through ``to_dtype`` (and ``bf16_values``): under
the interpreter they round to nearest by the bits; compiled for a GPU they are
``a.to(DTYPE)``, the same code as before. Half-type inputs are read with the
interpreter's own conversion (a subnormal bfloat16 input, below 1.2e-38, reads wrong
there, not on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_backend import interpreter_on

# Whether this module's kernels run under the interpreter: decided when they are
# decorated, at import, as Triton itself decides it.
INTERPRETED = tl.constexpr(interpreter_on())


@triton.jit
def _rounded_bits(a):
    """The int32 bits of float32 ``a`` rounded to the nearest bfloat16 number, ties to
    even (low 16 bits zero; finite numbers past bfloat16's largest give inf, as on a
    GPU; NaN gives the quiet NaN)."""
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(a != a, 0x7FC00000, bits)


@triton.jit
def bf16_values(a):
    """Float32 ``a`` rounded to bfloat16, held as float32."""
    if INTERPRETED:
        return _rounded_bits(a).to(tl.float32, bitcast=True)
    else:
        return a.to(tl.bfloat16).to(tl.float32)


@triton.jit
def to_dtype(a, DTYPE: tl.constexpr):
    """``a`` converted to ``DTYPE``, rounded to nearest, ties to even, under the
    interpreter too (module docstring): there by the bits alone, since its conversion
    also loses bfloat16's subnormal numbers. Float16 needs nothing: the interpreter
    converts it with NumPy, which rounds to nearest."""
    if INTERPRETED and a.dtype == tl.float32 and tl.bfloat16 == DTYPE:
        return (_rounded_bits(a) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return a.to(DTYPE)
