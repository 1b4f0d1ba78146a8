"""Naive BigBird (Zaheer et al. 2020): softmax over the materialised block-sparse pattern."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..shared.inputs import check_attention_inputs, zero_padded_queries
from ..shared.masked import masked_softmax
from .bigbird import BigBirdLayout


def bigbird_pattern(layout: BigBirdLayout, n: int) -> Tensor:
    """The dense ``[B, H, N, N]`` bool pattern of ``layout`` in the input's positions,
    built query block by query block from the paper's rules. For tests only."""
    b_size, heads = layout.random.shape[:2]
    bs = layout.block_size
    pattern = torch.zeros(b_size, heads, n, n, dtype=torch.bool)
    for b in range(b_size):
        n_real, last = int(layout.n_valid[b]), int(layout.last[b])
        pos = (torch.arange(n) if layout.order is None else layout.order.order[b].cpu())[:n_real]

        def tokens(block: int, pos: Tensor = pos, n_real: int = n_real) -> Tensor:
            return pos[block * bs : min(n_real, (block + 1) * bs)]

        for h in range(heads):
            for i in range(last + 1):
                if i in (0, last):
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
                rows = tokens(i)
                for j in keys:
                    cols = tokens(j)
                    pattern[b, h, rows[:, None], cols[None, :]] = True
    return pattern


def reference_bigbird_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: BigBirdLayout,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Naive BigBird: softmax over the materialised ``[B, H, N, N]`` logits restricted to
    ``bigbird_pattern(layout)``; ``scale`` ``None`` = 1/sqrt(D). For tests only."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="bigbird reference")
    s = scale if scale is not None else 1.0 / math.sqrt(info.head_dim)
    pattern = bigbird_pattern(layout, info.key_len).to(q.device)
    logits = (q @ k.transpose(-1, -2)) * s
    return zero_padded_queries(masked_softmax(logits, pattern) @ v, info.query_valid)
