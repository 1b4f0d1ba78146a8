"""Naive Linformer (Wang et al. 2020, Section 4): the materialised ``[Nq, k]`` softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries


def reference_linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proj_k: Tensor,
    proj_v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Naive Linformer, one batch element and head at a time: keep the real keys' columns
    of E and F (``[k, n_real]``), drop slots whose key row is zero on them, and form the
    materialised ``[Nq, k]`` softmax matrix. For tests only."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="linformer reference")
    s = logit_scale(info.head_dim, scale)
    n = info.key_len
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
    for b in range(info.batch):
        rows = (torch.arange(n, device=k.device) if info.key_valid is None
                else info.key_valid[b].nonzero()[:, 0])
        for h in range(info.heads):
            e = (proj_k[h] if proj_k.dim() == 3 else proj_k)[:, :n][:, rows]
            f = (proj_v[h] if proj_v.dim() == 3 else proj_v)[:, :n][:, rows]
            keep = (e != 0).any(dim=1)
            if not bool(keep.any()):
                continue
            logits = s * q[b, h] @ (e[keep] @ k[b, h][rows]).T  # [Nq, k']
            out[b, h] = torch.softmax(logits, dim=-1) @ (f[keep] @ v[b, h][rows])
    return zero_padded_queries(out, info.query_valid)
