"""Naive Performer: the materialised random-feature estimate A^ = phi(Q') phi(K')^T.

Written from Lemma 1 without any stabilisation: phi(x) = m^-1/2 exp(W x - |x|^2/2).
Memory O(N^2): for tests (float64, moderate norms) only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries


def positive_features(x: Tensor, projection: Tensor) -> Tensor:
    """phi(x) = m^-1/2 exp(W x - |x|^2/2): ``[..., N, D] -> [..., N, m]`` (Lemma 1)."""
    m = projection.shape[0]
    wx = torch.einsum("...nd,fd->...nf", x, projection.to(x.dtype))
    return torch.exp(wx - 0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(m)


def eps_features(x: Tensor, projection: Tensor, eps: float, valid: Tensor | None,
                 per_row: bool) -> Tensor:
    """performer-pytorch's features m^-1/2 (exp(w.x - |x|^2/2 - c) + eps): c = max_f w_f.x
    of each row (``per_row``, queries) or of all real rows and features of one batch
    element and head (keys), a constant for autograd. Rows outside ``valid [B, N]`` are
    zero."""
    m = projection.shape[0]
    b, h, n, _ = x.shape
    wx = torch.einsum("...nd,fd->...nf", x, projection.to(x.dtype))
    real = torch.ones(b, n, dtype=torch.bool) if valid is None else valid
    out = torch.zeros_like(wx)
    for bi in range(b):
        for hi in range(h):
            rows = [i for i in range(n) if real[bi, i]]
            for i in rows:
                c = (wx[bi, hi, i].max() if per_row else wx[bi, hi, rows].max()).detach()
                out[bi, hi, i] = (torch.exp(wx[bi, hi, i] - 0.5 * (x[bi, hi, i] ** 2).sum() - c)
                                  + eps) / math.sqrt(m)
    return out


def performer_scores(
    q: Tensor, k: Tensor, projection: Tensor, *, key_padding_mask: Tensor | None = None,
    scale: float | None = None, eps: float = 0.0,
) -> Tensor:
    """The estimate A^ of exp(s Q K^T): ``[B, H, Nq, Nk]``, columns of padded keys zero.
    With ``eps > 0``, the features of ``eps_features`` (A^ is then off by per-row and
    per-head factors, which cancel in the attention)."""
    s = logit_scale(q.shape[-1], scale)
    if eps > 0:
        a = eps_features(q * math.sqrt(s), projection, eps, None, True) @ eps_features(
            k * math.sqrt(s), projection, eps, key_padding_mask, False).transpose(-1, -2)
    else:
        a = positive_features(q * math.sqrt(s), projection) @ positive_features(
            k * math.sqrt(s), projection
        ).transpose(-1, -2)
    if key_padding_mask is not None:
        a = a * key_padding_mask[:, None, None, :].to(a.dtype)
    return a


def reference_performer_attention(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, *,
    key_padding_mask: Tensor | None = None, scale: float | None = None, eps: float = 0.0,
    causal: bool = False,
) -> Tensor:
    """diag(A^ 1)^-1 A^ V (Performer eq. (6)) through the materialised A^, entries j > i
    zero with ``causal`` (and, with ``eps > 0``, row i's key shift the maximum over the
    real keys j <= i). ``[B, H, Nq, Dv]``."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="performer reference")
    if causal and eps > 0:  # each row's keys shifted by their maximum up to the row
        # (a query's features are its own row's: row i alone against the keys up to it)
        rows = [performer_scores(q[:, :, i:i + 1], k[:, :, :i + 1], projection, scale=scale,
                                 eps=eps, key_padding_mask=None if key_padding_mask is None
                                 else key_padding_mask[:, :i + 1])[:, :, 0]
                for i in range(q.shape[2])]
        a = torch.stack([F.pad(row, (0, k.shape[2] - row.shape[-1])) for row in rows], 2)
    else:
        a = performer_scores(q, k, projection, key_padding_mask=key_padding_mask, scale=scale,
                             eps=eps)
    if causal:
        a = a.tril()
    total = a.sum(-1, keepdim=True)
    if info.query_valid is not None:  # a padded row before every real key (causal, left
        # padding) sums to 0: its 0 / 0, zeroed below, would reach the gradients as NaN
        total = torch.where(info.query_valid[:, None, :, None], total, 1.0)
    if info.key_valid is not None:  # an element without a real key: zeros, as softmax's
        total = torch.where(info.key_valid.any(-1)[:, None, None, None], total, 1.0)
    out = (a @ v) / total
    return zero_padded_queries(out, info.query_valid)
