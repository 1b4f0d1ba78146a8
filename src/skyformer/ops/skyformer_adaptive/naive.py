"""Naive ``skyformer_adaptive``: Skyformer eqs. (5)-(6) for landmarks X = [member means of
the queries' clusters; chosen keys], one batch element and head at a time, with the
kernel blocks from explicit pairwise distances. For tests."""

from __future__ import annotations

import torch
from torch import Tensor

from ..shared.nystrom_naive import naive_lemma3_inverse


def _kernel(s: Tensor, t: Tensor) -> Tensor:
    return torch.exp(-torch.cdist(s, t) ** 2 / 2)


def reference_skyformer_adaptive_attention(
    q: Tensor, k: Tensor, v: Tensor, assignment: Tensor, key_index: Tensor, key_live: Tensor,
    key_padding_mask: Tensor | None, gamma: float, pinv: str, pinv_iterations: int,
    scale: float | None = None,
) -> Tensor:
    """C(Q, X) W C(X, K) V for given landmarks.

    Args:
        q, k, v: ``[B, H, N, D]`` (self-attention).
        assignment: ``[B, H, N]`` cluster of each query (the centres are the member
            means of the scaled real queries).
        key_index, key_live: ``[B, H, s]`` chosen keys and which slots hold one.
        key_padding_mask: ``[B, N]`` bool or None.
        gamma, pinv, pinv_iterations: of the Lemma 3 inverse (identity start).
        scale: s of the kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(D).
    Returns:
        ``[B, H, N, Dv]``; padded query rows zero.
    """
    scale = (q.shape[-1] ** -0.5 if scale is None else scale) ** 0.5
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for b in range(q.shape[0]):
        mask = key_padding_mask
        rows = torch.arange(q.shape[2]) if mask is None else mask[b].nonzero()[:, 0]
        keys = torch.arange(k.shape[2]) if mask is None else mask[b].nonzero()[:, 0]
        for h in range(q.shape[1]):
            qh, kh = q[b, h] * scale, k[b, h] * scale
            a = assignment[b, h][rows]
            centres = [qh[rows][a == c].mean(0) for c in sorted(set(a.tolist()))]
            chosen = [kh[j] for j, alive in zip(key_index[b, h].tolist(),
                                                key_live[b, h].tolist(), strict=True) if alive]
            x = torch.stack(centres + chosen)
            w = naive_lemma3_inverse(_kernel(x, x), gamma, pinv, pinv_iterations, "identity")
            out[b, h, rows] = _kernel(qh[rows], x) @ w @ _kernel(x, kh[keys]) @ v[b, h][keys]
    return out
