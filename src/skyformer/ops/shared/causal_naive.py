"""Naive causal modified Nystrom, one query at a time (for tests; O(N^2 m^3)).

For every query i, written from the construction itself (``ops/skyformer/README.md``,
"Causal"), with none of the fast path's devices (no Cholesky nesting, no prefix sums,
no shifts): the landmarks available at i, their ridge inverse W_i = (C(X_i, X_i) +
gamma I)^-1 by ``torch.linalg.inv``, the far keys (before i's chunk, or every key j <= i
without the local part) through C(q_i, X_i) W_i C(X_i, k_j), the near keys exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .causal_nystrom import CausalLandmarks
from .causal_prefix import CAUSAL_CHUNK


def _kernel(x: Tensor, y: Tensor) -> Tensor:
    """exp(-|x_a - y_b|^2 / 2) from pairwise differences: ``[a, D], [b, D] -> [a, b]``."""
    return torch.exp(-0.5 * ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1))


def reference_causal_nystrom(
    q: Tensor, k: Tensor, v: Tensor, landmarks: CausalLandmarks, *,
    key_padding_mask: Tensor | None, scale: float, gamma: float, local: bool,
    softmax: bool = False, chunk: int = CAUSAL_CHUNK,
) -> Tensor:
    """Causal Skyformer (``softmax=False``: sum_j a_ij v_j, a ~ C(q_i, k_j)) or causal
    Nystrom softmax (``softmax=True``: a_ij ~ exp(s q_i.k_j) up to a factor of row i,
    out_i = sum_j a_ij v_j / sum_j a_ij, the mean of the real v_j, j <= i, where that
    sum is not positive). ``q, k: [B, H, N, D]`` unscaled; ``scale``
    multiplies them (p^-1/4 for the Gaussian kernel, sqrt(s) for softmax).
    ``[B, H, N, Dv]``; rows of padded queries are zero."""
    b, h, n, _ = q.shape
    valid = (torch.ones(b, n, dtype=torch.bool) if key_padding_mask is None
             else key_padding_mask)
    qs, ks = q * scale, k * scale
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            rows = [(qs if landmarks.from_query[s] else ks)[bi, hi, int(landmarks.position[bi, s])]
                    for s in range(landmarks.position.shape[1])]
            for i in range(n):
                if not valid[bi, i]:
                    continue
                start = (i // chunk) * chunk if local else i + 1
                far = [j for j in range(min(start, i + 1)) if valid[bi, j]]
                near = [j for j in range(start, i + 1) if valid[bi, j]]
                avail = [s for s in range(len(rows)) if landmarks.live[bi, s]
                         and landmarks.position[bi, s] <= i]
                weights = torch.zeros(n, dtype=q.dtype)
                qi = qs[bi, hi, i][None]
                if far and avail:
                    x = torch.stack([rows[s] for s in avail])
                    w = torch.linalg.inv(_kernel(x, x) + gamma * torch.eye(len(avail),
                                                                            dtype=q.dtype))
                    weights[far] = (_kernel(qi, x) @ w @ _kernel(x, ks[bi, hi, far]))[0]
                if near:
                    weights[near] = _kernel(qi, ks[bi, hi, near])[0]
                if softmax:  # exp(q.k) = exp(|q|^2/2) C(q, k) exp(|k|^2/2); the first cancels
                    weights = weights * torch.exp(0.5 * (ks[bi, hi] ** 2).sum(-1))
                    if weights.sum() > 0:
                        out[bi, hi, i] = weights @ v[bi, hi] / weights.sum()
                    else:  # no normaliser (no landmark yet, no near key): uniform
                        out[bi, hi, i] = v[bi, hi, far + near].mean(0)
                else:
                    out[bi, hi, i] = weights @ v[bi, hi]
    return out
