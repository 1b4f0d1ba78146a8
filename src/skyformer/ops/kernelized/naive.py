"""Naive kernelized attention, from explicit pairwise differences (Skyformer eq. (3))."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg import gaussian_scores
from ..shared.inputs import check_attention_inputs, zero_padded_queries


def reference_kernelized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """C V with C_ij = exp(-s |q_i - k_j|^2 / 2), s = ``scale`` or 1/sqrt(p) (that is
    exp(-|q_i - k_j|^2 / (2 sqrt(p)))), formed from the pairwise differences
    ``[B, H, Nq, Nk, D]``. ``[B, H, Nq, Dv]``; rows of padded queries (self-attention)
    are zero. For tests only."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="kernelized reference")
    s = q.shape[-1] ** -0.5 if scale is None else scale
    diff = q[..., :, None, :] - k[..., None, :, :]
    c = torch.exp(-(diff * diff).sum(-1) * (s / 2.0))
    if key_padding_mask is not None:
        c = c * key_padding_mask[:, None, None, :].to(c.dtype)
    if causal:
        c = torch.tril(c)
    return zero_padded_queries(c @ v, info.query_valid)


def reference_materialised_kernelized_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Kernelized attention through the materialised ``[B, H, Nq, Nk]`` matrix C: the
    straightforward O(N^2)-memory implementation, kept for memory comparisons."""
    return gaussian_scores(q, k) @ v
