"""Dominant left singular subspace of a batch of matrices, exactly or by randomized
subspace iteration (Halko, Martinsson & Tropp 2011, Algorithm 4.4).

Used for the rank-m floors of the approximation study: the best rank-m approximation
of A (Eckart-Young, spectral and Frobenius norm) is U_m U_m^T A, so only the top-m
left singular vectors U_m are needed, never the full SVD. A full SVD of an n x n
matrix costs O(n^3) with a large constant (about 100 s at n = 4096 on 2 CPU cores);
subspace iteration costs ``2 q + 1`` products with an n x (k + p) block; with
p = 64, q = 3 the rank-m floors it gives on MiniLM attention matrices agree with the
full SVD's to within 1% (docs/approximation.md, ``tests/eval/test_approx.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Subspace:
    """Top-k left singular vectors ``u: [..., N, k]`` and singular values ``s: [..., k]``
    (descending). ``exact`` tells whether they come from a full SVD."""

    u: Tensor
    s: Tensor
    exact: bool


def _orthonormal(x: Tensor) -> Tensor:
    return torch.linalg.qr(x, mode="reduced").Q


def takes_full_svd(n: int, m: int, k: int, *, oversample: int = 64,
                   exact_below: int = 1024) -> bool:
    """Whether ``top_singular_subspace`` of ``[N, M]`` matrices takes the full SVD: the
    smaller side at most ``exact_below``, or a block of k + p columns covering half of it."""
    return min(n, m) <= exact_below or 2 * (k + max(0, oversample)) >= min(n, m)


def top_singular_subspace(
    a: Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    oversample: int = 64,
    power_iterations: int = 3,
    exact_below: int = 1024,
) -> Subspace:
    """Top-``k`` left singular vectors of every matrix in ``a: [..., N, M]``.

    Args:
        k: number of singular vectors (``k <= min(N, M)``).
        generator: source of the Gaussian test matrix (randomized path).
        oversample: extra columns p of the test matrix; the block has k + p columns.
        power_iterations: q, the number of (A A^T) applications after the first product.
        exact_below: matrices with ``min(N, M) <= exact_below``, or whose block k + p
            would cover half the smaller side, use the full SVD instead.
    Returns:
        ``Subspace`` with ``u: [..., N, k]``, ``s: [..., k]``, in ``a``'s dtype.
    """
    n, m = a.shape[-2], a.shape[-1]
    if not 1 <= k <= min(n, m):
        raise ValueError(f"k must be in 1..{min(n, m)} for {n} x {m} matrices, got {k}.")
    width = k + max(0, oversample)
    if takes_full_svd(n, m, k, oversample=oversample, exact_below=exact_below):
        u, s, _ = torch.linalg.svd(a, full_matrices=False)
        return Subspace(u[..., :k], s[..., :k], exact=True)
    omega = torch.randn(
        (*a.shape[:-2], m, width), generator=generator, dtype=a.dtype, device=a.device
    )
    at = a.transpose(-1, -2)
    basis = _orthonormal(a @ omega)  # [..., N, k + p]
    for _ in range(power_iterations):
        # Re-orthonormalise after every product: without it the columns collapse onto
        # the top singular vector in floating point.
        basis = _orthonormal(a @ _orthonormal(at @ basis))
    small = basis.transpose(-1, -2) @ a  # [..., k + p, M]
    u_small, s, _ = torch.linalg.svd(small, full_matrices=False)
    return Subspace((basis @ u_small)[..., :k], s[..., :k], exact=False)
