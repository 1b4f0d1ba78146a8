"""Random features for the softmax kernel (Performer, Choromanski et al. ICLR 2021).

Positive random features (FAVOR+, Lemma 1): for w ~ N(0, I_D),

    exp(x.y) = E_w[ exp(w.x - |x|^2/2) exp(w.y - |y|^2/2) ],

so phi(x) = m^-1/2 (exp(w_f.x - |x|^2/2))_{f=1..m} gives an unbiased, strictly
positive estimate phi(x).phi(y) of exp(x.y).

Orthogonal random features (Section 2.4): the m rows are drawn in blocks of D
mutually orthogonal directions (QR of a Gaussian matrix, sign-corrected so that each
block is Haar distributed), each row rescaled by the norm of an independent D-dim
Gaussian vector (chi distributed with D degrees of freedom). Every row is then
marginally N(0, I_D), so the estimate stays unbiased, with lower variance.

Draws are counter-based (``rng.normal``) in float32 with shapes that depend only on
(m, D), so the same key gives the same features for every sequence length, dtype and
device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..linalg import half_sq_norm
from .rng import bulk_normal, normal, random_key, stream


def gaussian_projection(
    num_features: int, dim: int, *, orthogonal: bool = True,
    device: torch.device | str = "cpu", generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Random feature directions ``[num_features, dim]`` (float32), rows marginally N(0, I).

    ``orthogonal=True``: block-orthogonal rows with chi-distributed norms (Performer
    Section 2.4); ``False``: i.i.d. Gaussian rows. ``generator``: a generator or a
    random key (``rng.random_key``).
    """
    key = random_key(generator, device)
    if not orthogonal:
        return normal(stream(key, "features/iid"), (num_features, dim))
    blocks = math.ceil(num_features / dim)
    g = normal(stream(key, "features/directions"), (blocks, dim, dim))
    norms = normal(stream(key, "features/norms"), (blocks, dim, dim)).norm(dim=-1)
    # Householder QR leaves a sign per column tied to R's diagonal; fixing it makes Q Haar.
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    rows = q.transpose(-1, -2) * norms[..., None]  # [blocks, D, D], rows orthogonal in a block
    return rows.reshape(blocks * dim, dim)[:num_features]


def softmax_log_features(x: Tensor, projection: Tensor) -> Tensor:
    """Log of the positive features up to the constant -log(m)/2 (Performer Lemma 1).

    ``x: [..., N, D]`` (already scaled so that x.y is the logit), ``projection:
    [m, D]`` -> ``[..., N, m]`` with entries w_f.x - |x|^2/2.
    """
    return x @ projection.to(x.dtype).transpose(-1, -2) - half_sq_norm(x)[..., None]


def gaussian_columns(
    rows: tuple[int, ...], n: int, generator: torch.Generator | Tensor | None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Standard normal matrix ``[*rows, n]`` (float32) whose column j depends only on the
    key and on j: the first ``n'`` columns are the same for every ``n >= n'`` (Linformer's
    Gaussian Johnson-Lindenstrauss projections, one column per position)."""
    key = stream(random_key(generator, device), "gaussian-columns")
    return bulk_normal(key, (n, *rows)).movedim(0, -1)
