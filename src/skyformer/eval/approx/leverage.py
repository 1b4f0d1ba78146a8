"""Ridge leverage scores and statistical dimension of the lifted kernel matrix
(Skyformer Theorem 2 and Appendices C-D).

With Q^ = Q p^-1/4, K^ = K p^-1/4 and X = [Q^; K^] (2n rows), the lifted matrix is the
PSD Gaussian kernel matrix C_bar = kappa(X, X), whose off-diagonal block is the
kernelized attention matrix C = kappa(Q^, K^). For a relative error eps:

    lambda  = eps ||C||_2
    l_i     = [C_bar (C_bar + lambda I)^-1]_ii      (ridge leverage scores, i = 1..2n)
    d_stat  = sum_i l_i = Tr(C_bar (C_bar + lambda I)^-1)
    beta    = d_stat / (2n max_i l_i)               (the largest beta the theorem allows)

Theorem 2: uniform sub-sampling of d >= C d_stat/beta log(n/delta) rows gives
||C~ - C||_2 <= lambda with probability 1 - delta. The paper leaves C unspecified; the
proof fixes it. Lemma C.2 (matrix Bernstein, dimension 2n) needs
d >= 28/3 (s/beta) ln(2 (2n)/delta), applied to Psi with stable rank s <= 2 d_stat, so

    d_theorem = 56/3 * d_stat/beta * ln(4n/delta).

We report d_theorem (that constant) and, for the shape alone, d_stat/beta ln(n/delta)
(C = 1). Note d_stat/beta = 2n max_i l_i: uniform sampling pays for the most
"coherent" row. Both are often above 2n, the number of rows there are: then the
theorem only guarantees what using every row gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_block, kernel_scale
from ..measure.metrics import spectral_norm

THEOREM_CONSTANT = 56.0 / 3.0  # 28/3 from Lemma C.2 times 2 from s <= 2 d_stat


def lifted_kernel(q: Tensor, k: Tensor) -> Tensor:
    """C_bar = kappa([Q^; K^], [Q^; K^]) for ``q: [..., n, p]``, ``k: [..., n, p]``:
    ``[..., 2n, 2n]`` float64 (Skyformer eq. (4) with the Gaussian kernel)."""
    scale = kernel_scale(q.shape[-1])
    x = torch.cat([q, k], dim=-2).to(torch.float64) * scale
    return gaussian_kernel_block(x, x, flush=False)  # every entry, as the exact output's


def ridge_leverage_scores(cbar: Tensor, lam: Tensor | float) -> Tensor:
    """l_i = [C_bar (C_bar + lambda I)^-1]_ii for PSD ``cbar: [..., N, N]``: ``[..., N]``.

    ``lam``: a positive number or ``[...]`` tensor. Through one Cholesky factorisation
    (O(N^3 / 3)); the result lies in [0, 1] and sums to d_stat.
    """
    c = cbar.to(torch.float64)
    lam_t = torch.as_tensor(lam, dtype=torch.float64, device=c.device)
    if not bool((lam_t > 0).all()):
        raise ValueError("the ridge lambda must be positive.")
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
    factor = torch.linalg.cholesky(c + lam_t[..., None, None] * eye)
    inverse = torch.cholesky_inverse(factor)  # (C_bar + lambda I)^-1, symmetric
    # diag(A B) = row sums of A * B^T; both factors are symmetric.
    return (inverse * c).sum(dim=-1).clamp_(0.0, 1.0)


@dataclass(frozen=True)
class LeverageResult:
    """Theorem 2 quantities for one epsilon, per head (``[H]`` tensors)."""

    eps: float
    delta: float
    n: int
    norm_c: Tensor  # ||C||_2
    lam: Tensor  # eps ||C||_2
    d_stat: Tensor
    max_leverage: Tensor
    beta: Tensor
    d_theorem: Tensor  # 56/3 d_stat/beta ln(4n/delta)
    d_shape: Tensor  # d_stat/beta ln(n/delta)
    leverage: Tensor  # [H, 2n], sorted descending


def theorem2_sample_sizes(
    d_stat: Tensor, max_leverage: Tensor, n: int, delta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(beta, d_theorem, d_shape) from d_stat and max_i l_i (module docstring)."""
    beta = d_stat / (2 * n * max_leverage)
    ratio = d_stat / beta  # = 2n max_i l_i
    d_theorem = THEOREM_CONSTANT * ratio * math.log(4 * n / delta)
    d_shape = ratio * math.log(n / delta)
    return beta, d_theorem, d_shape


def leverage_analysis(q: Tensor, k: Tensor, eps: float, *, delta: float = 0.1) -> LeverageResult:
    """Skyformer Theorem 2 for ``q, k: [H, n, p]`` (H heads of one sequence); NaN on a
    head whose C is zero in float64 (every kernel entry underflowed: lambda = 0)."""
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1) (Theorem 2), got {eps}.")
    if not 0 < delta < 0.5:
        raise ValueError(f"delta must be in (0, 1/2) (Theorem 2), got {delta}.")
    n = q.shape[-2]
    cbar = lifted_kernel(q, k)  # [H, 2n, 2n]
    norm_c = spectral_norm(cbar[..., :n, n:])  # C = kappa(Q^, K^), the off-diagonal block
    lam = eps * norm_c
    # Every entry of C underflowed (queries far from every key): lambda = 0 and the
    # theorem says nothing; those heads' quantities are NaN (``vanished_heads``).
    vanished = lam < torch.finfo(torch.float64).tiny
    scores = ridge_leverage_scores(cbar, torch.where(vanished, 1.0, lam))
    scores = scores.masked_fill(vanished[..., None], math.nan)
    d_stat = scores.sum(dim=-1)
    max_lev = scores.amax(dim=-1)
    beta, d_theorem, d_shape = theorem2_sample_sizes(d_stat, max_lev, n, delta)
    return LeverageResult(
        eps=eps, delta=delta, n=n, norm_c=norm_c, lam=lam, d_stat=d_stat,
        max_leverage=max_lev, beta=beta, d_theorem=d_theorem, d_shape=d_shape,
        leverage=scores.sort(dim=-1, descending=True).values,
    )
