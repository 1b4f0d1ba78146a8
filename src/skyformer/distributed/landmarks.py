"""Skyformer's landmarks drawn across the shards of a sequence, identical to one
process's draw, and their rows shared with one all-reduce of m x D.

One process keeps the valid rows of [Q; K] with the ``ceil(m/2)`` (queries) and
``floor(m/2)`` (keys) smallest selection keys (``sketch/landmarks.py``). A row's key
depends only on the random key, its batch element and its rank among the valid rows,
which a shard computes from the valid rows before it (``ShardLayout.valid_before``).
The smallest keys of the sequence are the smallest among each shard's smallest, so
every rank takes its own ``c`` smallest, the ranks all-gather them (``P x B x m`` keys
and positions: no N in it), and every rank merges them alike: the same landmarks, in
the same order, as ``uniform_landmarks`` on the whole sequence.

The landmark rows are then summed over the ranks from one ``[B, H, m, D]`` tensor per
rank holding its own landmarks' rows and zeros elsewhere (exact: x + 0 = x). The sum
is differentiable (``collectives.all_reduce_sum``), so the gradient with respect to a
landmark row, summed over the ranks, reaches the row on the rank that holds it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.shared.modified_nystrom import head_rows
from ..sketch import Landmarks
from ..sketch.landmarks import (
    KEY_STREAM,
    PADDED_KEY,
    QUERY_STREAM,
    smallest_keys,
    stream_selection_keys,
)
from .collectives import all_gather, all_reduce_sum
from .layout import ShardLayout

_NO_CANDIDATE = torch.iinfo(torch.long).max  # pads a shard shorter than the count


def draw_landmarks(
    num_features: int, layout: ShardLayout, valid: Tensor | None, batch: int, n: int, *,
    draw: str = "auto",
) -> tuple[Landmarks, Tensor, Tensor]:
    """The landmarks of the whole sequence (module docstring).

    Args:
        valid: this shard's mask ``[B, n]`` (True = real row) or None.
        draw: how the selection keys are computed (the method's ``kernel`` option,
            ``sketch.landmarks.use_triton_draw``); the landmarks are the same.
    Returns:
        ``(landmarks, query_local, key_local)``: landmarks with sequence positions (as
        ``uniform_landmarks`` returns for the whole sequence), and for each landmark slot
        ``[B, m_side]`` the row of this shard that holds it, -1 elsewhere.
    """
    counts = ((num_features + 1) // 2, num_features // 2)
    keys, positions, rows = [], [], []
    for name, count in zip((QUERY_STREAM, KEY_STREAM), counts, strict=True):
        shard_keys = stream_selection_keys(layout.key, name, valid, batch, n,
                                           valid_before=layout.valid_before,
                                           rows_before=layout.rows_before,
                                           draw=draw)  # [B, n]
        index, picked = smallest_keys(shard_keys, count)  # [B, min(count, n)]
        none = index.new_full((batch, count - index.shape[1]), -1)  # [B, count - c]
        keys.append(torch.cat([picked, torch.full_like(none, _NO_CANDIDATE)], 1))
        positions.append(torch.cat([index + layout.rows_before, none], 1))
        rows.append(torch.cat([index, none], 1))
    gathered = all_gather(torch.stack([torch.cat(keys, 1), torch.cat(positions, 1)]),
                          layout.group)  # [P, 2, B, m]
    sides, start = [], 0
    for count, own_rows in zip(counts, rows, strict=True):
        part = gathered[..., start : start + count]  # [P, 2, B, c]
        start += count
        cand_keys = part[:, 0].permute(1, 0, 2).reshape(batch, -1)  # [B, P c]
        cand_pos = part[:, 1].permute(1, 0, 2).reshape(batch, -1)
        slot, picked = smallest_keys(cand_keys, min(count, layout.total_rows))
        mine = slot // count == layout.rank
        local = torch.where(mine, own_rows.gather(1, slot % count), -1)
        sides.append((cand_pos.gather(1, slot), picked < PADDED_KEY, local))
    (q_pos, q_live, q_local), (k_pos, k_live, k_local) = sides
    return Landmarks(q_pos, q_live, k_pos, k_live), q_local, k_local


def landmark_rows(q: Tensor, k: Tensor, query_local: Tensor, key_local: Tensor, scale: float,
                  layout: ShardLayout) -> Tensor:
    """The scaled landmark rows ``[B, H, m, D]`` of [s Q; s K] on every rank, from the
    shards ``q: [B, H, n, D]``, ``k: [B, H, n, D]`` (one differentiable all-reduce)."""
    parts = []
    for x, local in ((q, query_local), (k, key_local)):
        mine = (local >= 0)[:, None, :, None]  # [B, 1, m_side, 1]
        parts.append(torch.where(mine, head_rows(x, local.clamp_min(0)), 0.0))
    return all_reduce_sum(torch.cat(parts, dim=2), layout.group) * scale
