"""Exact softmax attention's weights formed from its logits: ``softmax(scale Q K^T +
bias)`` with the method's own masks (``masked.attention_bias``: ``attn_mask``, key
padding, causal), O(Nq Nk D) where the identity appended to the values
(``skyformer.weights``) costs O(Nq Nk^2). Rows without a key and rows of padded queries
are zero, as the method's output."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from ..shared.masked import attention_bias, masked_softmax
from .softmax import SoftmaxConfig


def softmax_weights(q: Tensor, k: Tensor, config: SoftmaxConfig, *,
                    key_padding_mask: Tensor | None = None,
                    query_padding_mask: Tensor | str | None = "auto",
                    attn_mask: Tensor | None = None) -> Tensor:
    """The weights ``[B, H, Nq, Nk]`` that ``softmax_attention(q, k, v, config, ...)``
    applies to ``v`` without dropout, in float64 for float64 inputs, else float32."""
    info = check_attention_inputs(q, k, k, key_padding_mask, method="softmax",
                                  query_padding_mask=query_padding_mask)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = logit_scale(info.head_dim, config.scale)
    logits = (q.to(work) @ k.to(work).transpose(-1, -2)) * scale
    given = attn_mask if attn_mask is not None else torch.ones(1, dtype=torch.bool,
                                                               device=q.device)
    bias = attention_bias(given, info.key_valid, config.causal, tuple(logits.shape), work,
                          q.device, "softmax")
    weights = masked_softmax(logits + bias, bias != float("-inf"))
    return zero_padded_queries(weights, info.query_valid)
