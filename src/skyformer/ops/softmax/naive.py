"""Naive softmax attention: the materialised ``[B, H, Nq, Nk]`` matrix times V."""

from __future__ import annotations

from torch import Tensor

from ...linalg import softmax_scores
from ..shared.inputs import check_attention_inputs, zero_padded_queries


def reference_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> Tensor:
    """softmax(scale Q K^T) V through the materialised matrix (``linalg.softmax_scores``).
    ``[B, H, Nq, Dv]``; rows of padded queries (self-attention) are zero."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="softmax reference")
    probs = softmax_scores(q, k, key_padding_mask=key_padding_mask, scale=scale, causal=causal)
    return zero_padded_queries(probs @ v, info.query_valid)
