"""Approximation error of attention outputs, rank-m floors, trivial baselines, stable rank.

Every function works on batches ``[..., N, D]`` (e.g. ``[B, H, N, D]``: one value per
matrix, i.e. per head) and computes in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_TINY = torch.finfo(torch.float64).tiny


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def spectral_norm(x: Tensor) -> Tensor:
    """Largest singular value of every matrix in ``x: [..., N, D]``: ``[...]``."""
    return torch.linalg.matrix_norm(_f64(x), ord=2)


def singular_values(x: Tensor) -> Tensor:
    """Singular values, descending, of every matrix in ``x: [..., N, D]``: ``[..., min(N, D)]``."""
    return torch.linalg.svdvals(_f64(x))


def stable_rank(x: Tensor) -> Tensor:
    """Stable rank ||x||_F^2 / ||x||_2^2 of every matrix in ``x: [..., N, D]``: ``[...]``
    (KDEformer section 2; always between 1 and the rank; 0 for a zero matrix)."""
    return stable_rank_from_singular_values(singular_values(x))


def stable_rank_from_singular_values(s: Tensor) -> Tensor:
    """Stable rank sum(s^2) / max(s)^2 from singular values ``s: [..., r]``: ``[...]``."""
    s = _f64(s)
    top = s.amax(dim=-1)
    return (s * s).sum(dim=-1) / (top * top).clamp_min(_TINY)


def relative_error(approx: Tensor, exact: Tensor, ord: int | str = 2) -> Tensor:
    """||approx - exact|| / ||exact|| per matrix, for ``[..., N, D]`` inputs: ``[...]``.

    ``ord=2``: spectral norm (largest singular value), the error of Skyformer's
    Definition 2 (Section 3.3; its Figure 1 plots the error without the division) and of
    KDEformer; ``ord="fro"``: Frobenius norm. Computed in float64. A
    matrix with a non-finite entry (in either input) has error NaN: the SVD of the
    spectral norm would refuse it, and the call it belongs to is not stopped for it.

    The norms are taken of both matrices divided by the largest entry of ``exact``
    (the ratio does not change): the Gaussian target's output on queries far from every
    key can have entries of 1e-200, whose squares underflow. An ``exact`` whose
    entries are all zero or subnormal (every kernel entry underflowed) has no relative
    error: NaN.
    """
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(approx.shape)} vs {tuple(exact.shape)}.")
    a = _f64(approx)
    e = _f64(exact)
    finite = (torch.isfinite(a) & torch.isfinite(e)).flatten(-2).all(-1)  # [...]
    if not bool(finite.all()):
        a, e = (torch.where(finite[..., None, None], t, 0.0) for t in (a, e))
    scale = e.abs().flatten(-2).amax(-1)  # [...]
    defined = finite & (scale >= _TINY)
    scale = torch.where(defined, scale, 1.0)[..., None, None]
    num = torch.linalg.matrix_norm((a - e) / scale, ord=ord)
    den = torch.linalg.matrix_norm(e / scale, ord=ord)  # >= 1 where defined
    return torch.where(defined, num / den.clamp_min(_TINY), float("nan"))


def rank_m_floor(basis: Tensor, exact: Tensor, ranks: list[int], ord: int | str = 2) -> Tensor:
    """Relative error of ``A_m V`` against ``A V`` for each rank m in ``ranks``.

    A_m is the best rank-m approximation of the attention matrix A (truncated SVD,
    Eckart-Young), so ``A_m V = U_m U_m^T (A V)`` with U_m the top-m left singular
    vectors of A.

    Args:
        basis: top left singular vectors of A, ``[..., N, k]`` with ``k >= max(ranks)``
            (e.g. ``linalg.top_singular_subspace(A, k).u``).
        exact: the exact output ``A V``, ``[..., N, Dv]``.
    Returns:
        ``[len(ranks), ...]``.
    """
    if max(ranks) > basis.shape[-1]:
        raise ValueError(f"basis has {basis.shape[-1]} vectors, ranks need {max(ranks)}.")
    u = _f64(basis)
    o = _f64(exact)
    coeff = u.transpose(-1, -2) @ o  # [..., k, Dv]
    out = []
    for m in ranks:
        projected = u[..., :m] @ coeff[..., :m, :]
        out.append(relative_error(projected, o, ord=ord))
    return torch.stack(out)


def constant_row_error(exact: Tensor, row: Tensor | None = None, ord: int | str = 2) -> Tensor:
    """Relative error of the answer whose every row is ``row`` (``[..., Dv]``).

    With ``row=None`` the row is the mean of the exact output's rows, the best
    constant-row answer in Frobenius norm (the projection of ``exact`` onto matrices
    with equal rows). ``row = mean of V`` is uniform attention's answer.
    """
    o = _f64(exact)
    r = o.mean(dim=-2) if row is None else _f64(row)
    return relative_error(r[..., None, :].expand_as(o), o, ord=ord)


def trivial_error(v: Tensor, exact: Tensor, *, causal: bool = False) -> float:
    """Mean relative spectral error of the better trivial answer against ``exact``
    ``[B, H, N, Dv]``: every row = the mean of ``v`` (the softmax target's constant; with
    ``causal``, row i = the mean of v_0..v_i), or all zeros (error 1; the Gaussian
    target's rows are not weighted means); NaN where a head has no relative error (an
    all-zero exact output), as the methods' errors there."""
    if causal:
        count = torch.arange(1, v.shape[-2] + 1, dtype=exact.dtype, device=v.device)[:, None]
        mean_v = v.to(exact.dtype).cumsum(-2) / count
    else:
        mean_v = v.to(exact.dtype).mean(dim=-2, keepdim=True).expand_as(exact)
    error = relative_error(mean_v, exact, ord=2).mean().item()
    return error if math.isnan(error) else min(1.0, error)  # a NaN head: NaN, as methods'


def sample_statistics(values: Tensor) -> dict[str, float]:
    """Mean, std, quartiles and range of the samples (per head errors of ``approx`` and
    ``compare``); NaN where any sample is not finite
    (a method that fails on its hardest heads must not read as if it had none; the
    row's ``nonfinite`` says how many)."""
    v = values.detach().to(torch.float64).flatten()
    finite = v[torch.isfinite(v)]
    if finite.numel() == 0 or finite.numel() < v.numel():
        return dict.fromkeys(("mean", "std", "median", "q25", "q75", "min", "max"), math.nan)
    q = torch.quantile(finite, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return {
        "mean": finite.mean().item(),
        "std": finite.std().item() if finite.numel() > 1 else 0.0,
        "median": q[1].item(),
        "q25": q[0].item(),
        "q75": q[2].item(),
        "min": finite.min().item(),
        "max": finite.max().item(),
    }


def worse_than_trivial(error: float | None, trivial: float | None) -> bool:
    """Whether a method's ``error`` exceeds the trivial answer's, or is not finite (NaN
    compares as neither: a method that failed must not read as a good one); False where
    either is unknown (``trivial`` NaN: the target gives no head an error, so no method
    has one to compare)."""
    if error is None or trivial is None or math.isnan(trivial):
        return False
    return not math.isfinite(error) or error > trivial
