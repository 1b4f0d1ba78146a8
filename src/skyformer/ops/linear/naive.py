"""Naive linear attention (Katharopoulos et al. 2020, eqs. (4)-(7)), materialised."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..shared.inputs import check_attention_inputs, zero_padded_queries
from .linear import LinearConfig, elu_feature_map


def reference_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Naive linear attention through the materialised ``[B, H, Nq, Nk]`` similarity
    matrix A_ij = phi(q_i).phi(k_j) (padded columns zero, and j > i with ``causal``),
    then A V / (A 1 + eps).
    ``options`` as ``LinearConfig``."""
    config = LinearConfig(**options)
    eps = config.eps
    info = check_attention_inputs(q, k, v, key_padding_mask, method="linear reference")
    phi_q, phi_k = elu_feature_map(q), elu_feature_map(k)
    a = (phi_q[..., :, None, :] * phi_k[..., None, :, :]).sum(-1)  # [B, H, Nq, Nk]
    if key_padding_mask is not None:
        a = a * key_padding_mask[:, None, None, :].to(a.dtype)
    if config.causal:  # A_ij = 0 for j > i (eq. (8))
        a = a.tril()
    out = (a @ v) / (a.sum(dim=-1, keepdim=True) + eps)
    return zero_padded_queries(out, info.query_valid)
