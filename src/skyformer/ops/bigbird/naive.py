"""Naive BigBird (Zaheer et al. 2020): softmax over the materialised block-sparse pattern."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from ..shared.masked import masked_softmax
from .bigbird import BigBirdLayout, RealBlocks


def _block_tokens(side: RealBlocks, b: int, n: int, bs: int) -> list[Tensor]:
    """The input positions of each real block of sequence ``b`` on one side."""
    n_real = int(side.n_valid[b])
    pos = (torch.arange(n) if side.order is None else side.order.order[b].cpu())[:n_real]
    return [pos[j * bs : (j + 1) * bs] for j in range(int(side.last[b]) + 1)]


def bigbird_pattern(layout: BigBirdLayout, n: int) -> Tensor:
    """The dense ``[B, H, N, N]`` bool pattern of ``layout`` in the input's positions,
    built query block by query block from the paper's rules: query block i of the real
    queries against key blocks of the real keys. For tests only."""
    b_size, heads = layout.random.shape[:2]
    bs = layout.block_size
    pattern = torch.zeros(b_size, heads, n, n, dtype=torch.bool)
    for b in range(b_size):
        rows_of = _block_tokens(layout.queries, b, n, bs)
        cols_of = _block_tokens(layout.keys, b, n, bs)
        q_last, last = len(rows_of) - 1, len(cols_of) - 1
        for h in range(heads):
            for i in range(q_last + 1):
                if i in (0, q_last):
                    keys = set(range(last + 1))
                else:
                    keys = {0, last, i - 1, i, i + 1}
                    keys |= {
                        int(x)
                        for x, alive in zip(
                            layout.random[b, h, i], layout.random_live[b, h, i], strict=True
                        )
                        if alive
                    }
                rows = rows_of[i]
                for j in keys & set(range(last + 1)):
                    pattern[b, h, rows[:, None], cols_of[j][None, :]] = True
    return pattern


def reference_bigbird_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: BigBirdLayout,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    scale: float | None = None,
) -> Tensor:
    """Naive BigBird: softmax over the materialised ``[B, H, N, N]`` logits restricted to
    ``bigbird_pattern(layout)`` (drawn for the same masks); ``scale`` ``None`` =
    1/sqrt(D). For tests only."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="bigbird reference",
                                  query_padding_mask=query_padding_mask)
    s = logit_scale(info.head_dim, scale)
    pattern = bigbird_pattern(layout, info.key_len).to(q.device)
    logits = (q @ k.transpose(-1, -2)) * s
    return zero_padded_queries(masked_softmax(logits, pattern) @ v, info.query_valid)
