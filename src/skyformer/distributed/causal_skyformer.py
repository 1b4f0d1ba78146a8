"""Causal Skyformer sequence parallel (``causal_shard.py``): the state of the earlier
ranks' keys is S = sum_j phi(k_j) v_j^T, ``[B, H, m, Dv]``, a plain sum of theirs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..linalg import kernel_scale
from ..ops.shared.causal_nystrom import gaussian_features
from ..ops.shared.causal_prefix import by_blocks
from ..ops.shared.inputs import AttentionInputs
from ..ops.skyformer.causal import causal_skyformer_from_core
from .causal_shard import CausalShard, Rows, causal_shard, offer_blocks
from .layout import ShardLayout
from .reduction import GroupReduction


def causal_skyformer_shard(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
                           layout: ShardLayout, reduce: GroupReduction) -> Tensor:
    """This rank's rows ``[B, H, N_r, Dv]`` of causal Skyformer over the sequence whose
    shard ``q, k: [B, H, N_r, D]``, ``v: [B, H, N_r, Dv]`` it holds."""
    scale = kernel_scale(info.head_dim, config.scale)
    shard = causal_shard(q, k, v, config, info, layout, reduce, scale)
    qs, ks = shard.q * scale, shard.k * scale
    if by_blocks(ks.shape[2], qs, ks, shard.v, shard.core.x, shard.core.l_inv):
        # inference: the features of one block at a time, for the sums this rank offers
        # and again for its rows (ops/skyformer/causal.py), none kept for every row
        offers, phi_k = _offers_by_blocks(ks, shard, config.kernel), None
    else:
        phi_k = gaussian_features(ks, shard.core, row_valid=shard.valid, kernel=config.kernel)
        offers = (_key_sums(phi_k, shard.v, shard.head), _key_sums(phi_k, shard.v, shard.mine))
    start = shard.earlier([offers], reduce)[0].sum(0)
    out = causal_skyformer_from_core(qs, ks, shard.v, shard.valid, shard.core, shard.landmarks,
                                     config.causal_local, kernel=config.kernel, start=start,
                                     phi_k=phi_k)
    return shard.finish(out)


def _offers_by_blocks(ks: Tensor, shard: CausalShard, kernel: str) -> tuple[Tensor, Tensor]:
    """The sums of ``shard.head`` and ``shard.mine`` (``_key_sums``), the keys' features
    taken block by block (``offer_blocks``)."""
    head = whole = None
    for block, valid, head_rows, mine_rows in offer_blocks(shard):
        phi_k = gaussian_features(ks[:, :, block], shard.core, row_valid=valid, kernel=kernel)
        v = shard.v[:, :, block]
        parts = (_key_sums(phi_k, v, head_rows), _key_sums(phi_k, v, mine_rows))
        head, whole = parts if head is None else (head + parts[0], whole + parts[1])
    return head, whole


def _key_sums(phi_k: Tensor, v: Tensor, rows: Rows) -> Tensor:
    """sum phi(k_j) v_j^T over ``rows``: ``[B, H, m, Dv]`` (a range reads views)."""
    if isinstance(rows, slice):
        return phi_k[:, :, rows].transpose(-1, -2) @ v[:, :, rows]
    return phi_k.transpose(-1, -2) @ torch.where(rows[:, None, :, None], v, 0.0)
