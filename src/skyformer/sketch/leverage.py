"""Approximate ridge leverage scores of the key columns of a kernel matrix, from a sketch.

For the Q-vs-K kernel matrix C (``[Nq, Nk]``) the ridge leverage score of key column j is

    tau_j = c_j^T (C C^T + lambda I)^-1 c_j     (Alaoui & Mahoney 2015; Musco & Musco 2017),

the importance sampling weights that Skyformer's conclusion (section 6) proposes for the
Nystrom method. Computing them exactly costs O(Nq^2 Nk). We replace the rows of C by a
row sketch S C with s << Nq rows (e.g. the kernel rows of the s k-means centres of the
queries, each weighted by the square root of its cluster size, so that S^T S approximates
the query distribution): by the push-through identity

    tau~_j = (S c_j)^T (S C C^T S^T + lambda I)^-1 (S c_j),

which costs O(s^2 Nk + s^3). ``lambda`` is ``ridge`` times the mean diagonal of S C C^T S^T.
Scores carry no gradient (selection is piecewise constant).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg.top_k import top_k


def sketched_ridge_leverage(
    sketch: Tensor, ridge: float, key_valid: Tensor | None = None
) -> Tensor:
    """Approximate ridge leverage scores of the columns of the sketch ``[B, H, s, Nk]``.

    Returns ``[B, H, Nk]`` scores, -inf for padded keys.
    """
    with torch.no_grad():
        p = sketch.detach().double()  # s x s systems: double precision costs nothing here
        if key_valid is not None:
            p = p * key_valid[:, None, None, :]  # padded keys take no part in the Gram
        gram = p @ p.transpose(-1, -2)  # [B, H, s, s]
        s = gram.shape[-1]
        scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(p.dtype).tiny)
        eye = torch.eye(s, dtype=p.dtype, device=p.device)
        system = gram + (ridge * scale)[..., None, None] * eye
        # SPD (a ridge on a Gram): Cholesky, unchecked (a checked solve waits on a GPU),
        # and (S c_j)^T (L L^T)^-1 (S c_j) = |L^-1 S c_j|^2
        chol = torch.linalg.cholesky_ex(system).L
        root = torch.linalg.solve_triangular(chol, p, upper=False)  # [B, H, s, Nk]
        scores = root.square().sum(-2).to(sketch.dtype)  # [B, H, Nk]
        if key_valid is not None:
            scores = scores.masked_fill(~key_valid[:, None, :], float("-inf"))
    return scores


def top_keys(scores: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` highest-scoring keys per head: (index ``[B, H, count]``, live mask);
    slots beyond the number of real keys are marked dead."""
    count = min(count, scores.shape[-1])
    values, index = top_k(scores, count)  # ties by position, whatever the padding
    return index, torch.isfinite(values)
