"""Flushing negligible entries to zero, so that CPU matrix products stay at full speed.

Far landmarks give Gaussian kernel entries that underflow to subnormal numbers (below
1.2e-38 in float32), and the iterates of the Lemma 3 inverse of a nearly block-diagonal
landmark matrix fill with them by cancellation. CPUs multiply subnormal operands one
to two orders of magnitude slower (microcode assists): on pretrained MiniLM Q/K,
Skyformer's forward at N = 512 took 10x as long as on random inputs. GPUs compute with subnormals
at full speed, so callers flush CPU tensors only.

The threshold is sqrt(tiny) (1.1e-19 in float32, 1.5e-154 in float64): the product of
two kept entries is then a normal number, and what is dropped is below the rounding
of any sum that also holds an entry of order eps * sqrt(tiny) or more.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def negligible_exponent(dtype: torch.dtype, *, base2: bool = False) -> float:
    """log (or log2) of ``negligible``: exponents below it give flushed entries."""
    return math.log2(negligible(dtype)) if base2 else math.log(negligible(dtype))


def flush_exponent_on_cpu_(e: Tensor, *, base2: bool = False) -> Tensor:
    """Exponents of CPU tensors at or below ``negligible_exponent`` set to -inf, in
    place, so that ``exp`` (or ``exp2``) gives exact zeros there: computing a subnormal
    result is slow too. One vectorised pass (``threshold_``); a NaN exponent stays NaN
    (its comparison is false), as on other devices: it comes from a non-finite input
    (inf - inf), and the methods' non-finite guard (``registry/guard.py``) marks every
    row such an input reaches. Other devices are left as they are."""
    if e.device.type != "cpu":
        return e
    return torch.nn.functional.threshold_(e, negligible_exponent(e.dtype, base2=base2),
                                          float("-inf"))


def flush_exponent_on_cpu(e: Tensor, *, base2: bool = False) -> Tensor:
    """``flush_exponent_on_cpu_`` into a new tensor."""
    if e.device.type != "cpu":
        return e
    return torch.nn.functional.threshold(e, negligible_exponent(e.dtype, base2=base2),
                                         float("-inf"))


def negligible(dtype: torch.dtype) -> float:
    """sqrt(tiny) of ``dtype``: entries below it in magnitude are flushed."""
    return math.sqrt(torch.finfo(dtype).tiny)


def flush_negligible_(x: Tensor) -> Tensor:
    """``x`` with entries below ``negligible`` in magnitude set to 0, in place (one pass;
    NaN stays NaN)."""
    return torch.hardshrink(x, negligible(x.dtype), out=x)


def flush_on_cpu_(x: Tensor) -> Tensor:
    """``flush_negligible_`` for CPU tensors; others are returned as they are."""
    return flush_negligible_(x) if x.device.type == "cpu" else x


def flush_on_cpu(x: Tensor) -> Tensor:
    """A flushed copy of a CPU tensor (differentiable: the kept entries pass gradients);
    others are returned as they are."""
    return torch.hardshrink(x, negligible(x.dtype)) if x.device.type == "cpu" else x
