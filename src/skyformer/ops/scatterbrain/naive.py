"""Naive Scatterbrain: A~ = phi(Q) phi(K)^T + S materialised (Algorithm 1).

S = (A - phi(Q) phi(K)^T) restricted to the sparse support (the LSH block pattern of
``kdeformer.naive.reference_block_pattern``, or the local band of
``reference_local_pattern`` over ranks among the real tokens), then D~^-1 A~ V with
D~ = diag(A~ 1).
Memory O(N^2): for tests only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ...sketch.rng import valid_rank
from ..kdeformer.naive import reference_block_pattern
from ..performer.naive import performer_scores
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from .scatterbrain import ScatterbrainConfig


def reference_local_pattern(q_rank: Tensor, k_rank: Tensor, window: int) -> Tensor:
    """``[..., Nq, Nk]`` bool: key j is in query i's window, -(w // 2) <= r_j - r_i <
    (w + 1) // 2, with ``q_rank [..., Nq]``, ``k_rank [..., Nk]`` the ranks among the real
    queries and keys (positions without padding)."""
    d = k_rank[..., None, :] - q_rank[..., :, None]
    return (d >= -(window // 2)) & (d < (window + 1) // 2)


def reference_scatterbrain_attention(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, hyperplanes: Tensor | None, *,
    key_padding_mask: Tensor | None = None, **options,
) -> Tensor:
    """D~^-1 (phi(Q) phi(K)^T + S) V. ``projection [m, D]``, ``hyperplanes [B, H, D, r]``
    as drawn by ``draw_scatterbrain`` (None for the local support). Returns ``[B, H, Nq, Dv]``."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="scatterbrain reference")
    cfg = ScatterbrainConfig(**options)
    s = logit_scale(q.shape[-1], cfg.scale)
    low_rank = performer_scores(q, k, projection, key_padding_mask=key_padding_mask, scale=s)
    exact = torch.exp(s * q @ k.transpose(-1, -2))
    if key_padding_mask is not None:
        exact = exact * key_padding_mask[:, None, None, :].to(exact.dtype)
    support = torch.zeros_like(exact)
    if cfg.blocks > 0 and cfg.support == "local":
        q_rank = valid_rank(info.query_valid, info.batch, info.query_len, q.device)
        k_rank = valid_rank(info.key_valid, info.batch, info.key_len, q.device)
        support = support + reference_local_pattern(q_rank, k_rank, cfg.blocks)[:, None].to(
            q.dtype)
    elif cfg.blocks > 0:
        support = reference_block_pattern(
            q.detach(), k.detach(), hyperplanes, cfg.blocks, key_padding_mask=key_padding_mask
        ).to(q.dtype)
    approx = low_rank + (exact - low_rank) * support
    total = approx.sum(-1, keepdim=True)
    if info.key_valid is not None:  # an element without a real key: zeros, as softmax's
        total = torch.where(info.key_valid.any(-1)[:, None, None, None], total, 1.0)
    out = (approx @ v) / total
    return zero_padded_queries(out, info.query_valid)
