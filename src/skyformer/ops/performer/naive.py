"""Naive Performer: the materialised random-feature estimate A^ = phi(Q') phi(K')^T.

Written from Lemma 1 without any stabilisation: phi(x) = m^-1/2 exp(W x - |x|^2/2).
Memory O(N^2): for tests (float64, moderate norms) only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..shared.inputs import check_attention_inputs, zero_padded_queries


def positive_features(x: Tensor, projection: Tensor) -> Tensor:
    """phi(x) = m^-1/2 exp(W x - |x|^2/2): ``[..., N, D] -> [..., N, m]`` (Lemma 1)."""
    m = projection.shape[0]
    wx = torch.einsum("...nd,fd->...nf", x, projection.to(x.dtype))
    return torch.exp(wx - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)


def performer_scores(
    q: Tensor, k: Tensor, projection: Tensor, *, key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The estimate A^ of exp(s Q K^T): ``[B, H, Nq, Nk]``, columns of padded keys zero."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    a = positive_features(q * math.sqrt(s), projection) @ positive_features(
        k * math.sqrt(s), projection
    ).transpose(-1, -2)
    if key_padding_mask is not None:
        a = a * key_padding_mask[:, None, None, :].to(a.dtype)
    return a


def reference_performer_attention(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, *,
    key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """diag(A^ 1)^-1 A^ V (Performer eq. (6)) through the materialised A^. ``[B, H, Nq, Dv]``."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="performer reference")
    a = performer_scores(q, k, projection, key_padding_mask=key_padding_mask, scale=scale)
    out = (a @ v) / a.sum(-1, keepdim=True)
    return zero_padded_queries(out, info.query_valid)
