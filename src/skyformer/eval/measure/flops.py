"""Arithmetic a method must do at a shape, and the device's measured matmul throughput.

Together they give a "speed of light" time: the matrix-product FLOPs of one call
divided by what a large square matmul reaches on the same device in the same run. The
counts are the minimum (no recomputation, elementwise work and exp not counted), and
a backward pass is counted as twice the forward products (each product C = A B needs
dA = dC B^T and dB = A^T dC), so forward + backward = 3x forward; but the Lemma 3
core differentiated implicitly (``pinv_gradient="implicit"``) takes two m x m products
backward, whatever its forward steps (``BACKWARD_FLOPS``), and its forward pass is a
Cholesky factorisation where the call factorises (``factorised_core``: float32 and
float64 CPU calls, ``linalg.implicit_inverse.factorises``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...linalg import implicit_iterations
from ...registry.variants import base_name
from .timing import interleaved_median_seconds


def _exact_flops(nq: int, nk: int, d: int, dv: int, options: dict[str, Any],
                 factorised_core: bool = False, dtype: torch.dtype = torch.float32) -> float:
    """Q K^T and P V of exact attention (softmax or Gaussian): 2 Nq Nk (D + Dv), or for
    ``causal`` (Nq == Nk = N) the N (N + 1) / 2 pairs a causal kernel visits."""
    if options.get("causal"):
        return float(nq * (nq + 1) * (d + dv))
    return 2.0 * nq * nk * (d + dv)


def _nystrom_flops(nq: int, nk: int, d: int, dv: int, options: dict[str, Any],
                   factorised_core: bool = False, dtype: torch.dtype = torch.float32
                   ) -> float | None:
    """Skyformer eqs. (5)-(6) with the Lemma 3 iterative inverse (per head; the modified
    Nystrom softmax has one or two more value columns, not counted). None for
    ``causal``: another construction (a Cholesky core, triangular transforms, local
    blocks; ``ops/skyformer/README.md``), not counted."""
    if options.get("causal"):
        return None
    core = _core_flops(nq, nk, options, factorised_core, dtype)
    if core is None:
        return None  # an SVD: no meaningful product count
    m = min(options.get("num_features", 128), nq + nk)
    return (
        2.0 * nk * m * (d + dv)  # C(K, X) and C(X, K) V
        + 2.0 * m * m * (d + dv)  # C(X, X) and W (C(X, K) V)
        + core  # the iterative inverse
        + 2.0 * nq * m * (d + dv)  # C(Q, X) and C(Q, X) Z
    )


def _core_flops(nq: int, nk: int, options: dict[str, Any],
                factorised_core: bool = False, dtype: torch.dtype = torch.float32
                ) -> float | None:
    """The core's m x m products (None for the exact pinv): Razavi's steps; for the
    implicit gradient the scaled Newton steps Lemma 3's bound needs (2K - 2 products,
    ``linalg/newton_inverse.py``), or with ``factorised_core`` the Cholesky
    factorisation and the inverse from it that replace them (m^3 / 3 + 2 m^3 / 3)."""
    if options.get("pinv", "iterative") != "iterative":
        return None
    m = min(options.get("num_features", 128), nq + nk)
    iterations = options.get("pinv_iterations", 6)
    if options.get("pinv_gradient") == "implicit" and factorised_core:
        return float(m**3)
    if options.get("pinv_gradient") == "implicit":  # the steps Lemma 3's bound needs
        iterations = implicit_iterations(m, options.get("gamma", 0.1), dtype,
                                         at_least=iterations)
        return 2.0 * max(2 * iterations - 2, 0) * m**3
    # 4 products of m x m per Razavi step; 2 in the first step from the identity.
    steps = 4 * iterations - (
        2 if options.get("pinv_init", "identity") == "identity" and iterations else 0
    )
    return 2.0 * steps * m**3


def _nystrom_backward_flops(nq: int, nk: int, d: int, dv: int, options: dict[str, Any],
                            factorised_core: bool = False, dtype: torch.dtype = torch.float32
                            ) -> float | None:
    """Twice the forward's products, but for the implicit gradient the core's backward
    is two products, -V^T G V^T, whatever its steps."""
    forward = _nystrom_flops(nq, nk, d, dv, options, factorised_core, dtype)
    if forward is None or options.get("pinv_gradient") != "implicit":
        return None if forward is None else 2.0 * forward
    core = _core_flops(nq, nk, options, factorised_core, dtype) or 0.0
    m = min(options.get("num_features", 128), nq + nk)
    return 2.0 * (forward - core) + 2.0 * 2.0 * m**3


FlopCount = Callable[[int, int, int, int, dict[str, Any], bool, torch.dtype], float | None]
FORWARD_FLOPS: dict[str, FlopCount] = {
    "softmax": _exact_flops,
    "kernelized": _exact_flops,
    "skyformer": _nystrom_flops,
    "nystrom_softmax": _nystrom_flops,
}
# Backward passes counted otherwise than twice the forward's products.
BACKWARD_FLOPS: dict[str, FlopCount] = {
    "skyformer": _nystrom_backward_flops,
    "nystrom_softmax": _nystrom_backward_flops,
}


def attention_flops(
    method: str, *, batch: int, heads: int, nq: int, nk: int, d: int, dv: int,
    options: dict[str, Any] | None = None, backward: bool = False,
    factorised_core: bool = False, dtype: torch.dtype = torch.float32,
) -> float | None:
    """Matrix-product FLOPs of one call of ``method`` (None if not known for it; a
    variant, ``name[...]``, counts as its method with ``options``); ``factorised_core``:
    the call forms the implicit core's inverse by a Cholesky factorisation
    (``linalg.implicit_inverse.factorises``); ``dtype``: the call's compute dtype (the
    implicit core's Newton steps depend on it)."""
    name = base_name(method)
    count = FORWARD_FLOPS.get(name)
    if count is None:
        return None
    options = options or {}
    per_head = count(nq, nk, d, dv, options, factorised_core, dtype)
    if per_head is None:
        return None
    if backward:
        backward_count = BACKWARD_FLOPS.get(name)
        per_head += (2 * per_head if backward_count is None
                     else backward_count(nq, nk, d, dv, options, factorised_core, dtype))
    return per_head * batch * heads


def matmul_flops_per_second(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
    repeats: int = 5,
    clock: str = "wall",
) -> float:
    """Attainable throughput: a square ``size x size`` matmul on ``device``, the fastest
    of ``repeats`` runs (on a shared machine the fastest is the least disturbed), timed
    with the same ``clock`` as the measurements it is compared with."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=g, device=device).to(dtype)
    b = torch.randn(size, size, generator=g, device=device).to(dtype)
    seconds = min(
        interleaved_median_seconds({"mm": lambda: a @ b}, device=device, warmup=1 if i == 0 else 0,
                                   repeats=1, clock=clock)["mm"]
        for i in range(repeats)
    )
    return 2.0 * size**3 / seconds
