"""Naive Informer ProbSparse attention (Zhou et al. 2021, eqs. (3)-(4)), materialised."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs
from .informer import InformerConfig, KeySamples, active_counts


def reference_informer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    samples: KeySamples,
    *,
    key_padding_mask: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Naive ProbSparse attention with given key samples, through the materialised
    ``[Nq, Nk]`` score and softmax matrices, one batch element and head at a time:
    M from the sampled entries of the score matrix, active queries by a full sort,
    active rows of softmax(S) V, mean of the real values elsewhere. ``options`` as
    ``InformerConfig``. For tests only."""
    config = InformerConfig(**options)
    info = check_attention_inputs(q, k, v, key_padding_mask, method="informer reference")
    s = logit_scale(info.head_dim, config.scale)
    counts = active_counts(info, config.num_features, config.factor, q.device)[0].tolist()
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
    for b in range(info.batch):
        k_rows = (torch.arange(info.key_len) if info.key_valid is None
                  else info.key_valid[b].nonzero()[:, 0])
        q_rows = (torch.arange(info.query_len) if info.query_valid is None
                  else info.query_valid[b].nonzero()[:, 0])
        if len(k_rows) == 0:
            continue
        for h in range(info.heads):
            scores = s * q[b, h] @ k[b, h].T  # [Nq, Nk]
            measure = {}
            for i in q_rows.tolist():
                picked = scores[i, samples.index[b, i][samples.live[b, i]]]
                # eq. (4) with the pairs not sampled as 0: the sum over n_k
                measure[i] = (picked.max() - picked.sum() / len(k_rows)).item()
            ranked = sorted(measure, key=lambda i: -measure[i])[: counts[b]]
            probs = torch.softmax(scores[:, k_rows], dim=-1)  # [Nq, n_k]
            out[b, h, q_rows] = v[b, h, k_rows].mean(dim=0)
            for i in ranked:
                out[b, h, i] = probs[i] @ v[b, h, k_rows]
    return out
