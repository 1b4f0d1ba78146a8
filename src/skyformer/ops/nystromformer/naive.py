"""Naive Nystromformer (Xiong et al. 2021, eqs. (13)-(14)) from explicit matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs
from .nystromformer import NystromformerConfig


def reference_nystromformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    conv_weight: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Naive Nystromformer, one batch element at a time, from explicit matrices.

    Builds the averaging matrix P (``[m, n]``, P_jr = 1/|segment j| on the real tokens)
    so that Q~ = P Q_real, the three kernels, and the materialised ``[Nq, Nk]`` matrix
    S^ = K1 pinv(K2) K3, then S^ V. Each side has min(m, n) landmarks, so in
    cross-attention K2 may be rectangular; its pseudo-inverse is Razavi's iteration on
    that rectangle (``_razavi``). No shortcut for n <= m: this is the literal
    formula (compare with exact attention through ``pinv_iterations``); the convolution
    runs over the real values alone, in order. ``options`` as
    ``NystromformerConfig`` (``conv_kernel`` is implied by ``conv_weight``). For tests only.
    """
    config = NystromformerConfig(**options)
    num_features, pinv_iterations = config.num_features, config.pinv_iterations
    info = check_attention_inputs(q, k, v, key_padding_mask, method="nystromformer reference")
    s = logit_scale(info.head_dim, config.scale)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
    for b in range(info.batch):
        q_rows = _rows(info.query_valid, b, info.query_len, q.device)
        k_rows = _rows(info.key_valid, b, info.key_len, k.device)
        qb, kb, vb = q[b][:, q_rows], k[b][:, k_rows], v[b][:, k_rows]
        p_q = _averaging_matrix(len(q_rows), num_features, q.dtype, q.device)
        p_k = _averaging_matrix(len(k_rows), num_features, q.dtype, q.device)
        q_land, k_land = p_q @ qb, p_k @ kb  # [H, m', D]
        k1 = torch.softmax(s * qb @ k_land.transpose(-1, -2), dim=-1)
        k2 = torch.softmax(s * q_land @ k_land.transpose(-1, -2), dim=-1)
        k3 = torch.softmax(s * q_land @ kb.transpose(-1, -2), dim=-1)
        s_hat = k1 @ _razavi(k2, pinv_iterations) @ k3
        rows = s_hat @ vb
        if conv_weight is not None:  # over the real values in order, row r to query rank r
            conv = _naive_conv(vb, conv_weight)[:, : len(q_rows)]
            rows = rows + torch.nn.functional.pad(conv, (0, 0, 0, len(q_rows) - conv.shape[1]))
        out[b][:, q_rows] = rows
    return out


def _razavi(a: Tensor, iterations: int) -> Tensor:
    """Razavi et al. (2014) pseudo-inverse of ``a: [..., p, r]`` (p and r may differ):
    V_0 = A^T / (|A|_1 |A|_inf), V <- V (13 I - A V (15 I - A V (7 I - A V))) / 4, with
    I the p x p identity."""
    norm_1 = torch.linalg.matrix_norm(a, ord=1)
    norm_inf = torch.linalg.matrix_norm(a, ord=float("inf"))
    v = a.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]
    eye = torch.eye(a.shape[-2], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        av = a @ v
        v = 0.25 * v @ (13 * eye - av @ (15 * eye - av @ (7 * eye - av)))
    return v


def _rows(mask: Tensor | None, b: int, n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device) if mask is None else mask[b].nonzero()[:, 0]


def _averaging_matrix(n: int, m: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[m', n]`` segment-averaging matrix over n tokens, m' = min(m, n) non-empty rows."""
    p = torch.zeros(m, n, dtype=dtype, device=device)
    for r in range(n):
        p[(r * m) // n, r] = 1.0
    p = p[p.sum(dim=1) > 0]
    return p / p.sum(dim=1, keepdim=True)


def _naive_conv(v: Tensor, weight: Tensor) -> Tensor:
    """out[h, i] = sum_t w[h, t] v[h, i + t - K//2] with zeros outside: ``[H, N, Dv]``."""
    kernel = weight.shape[1]
    n = v.shape[1]
    out = torch.zeros_like(v)
    for i in range(n):
        for t in range(kernel):
            j = i + t - kernel // 2
            if 0 <= j < n:
                out[:, i] += weight[:, t, None].to(v.dtype) * v[:, j]
    return out
