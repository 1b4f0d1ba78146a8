"""Causal ``nystrom_softmax`` sequence parallel (``causal_shard.py``). The state of the
earlier ranks' keys is theirs at a shift (``ops/nystrom_softmax/causal.py``): key j's
features psi(k_j) = L^-1 C(X_S, k^_j) exp(|k^_j|^2/2) are divided by exp of a running
maximum, which on one process runs over every earlier key. Here each rank takes its
keys' features at the running maximum of its own halo and rows (r'_j <= r_j), offers
its head's and its whole state at their largest r', and the later ranks join the
earlier states at the largest shift they offer, every factor at most 1, as Performer's
running sums (``ops/performer/causal.py``); that shift starts the running maximum of
the rank's rows. The values' sums [v_j, 1] travel beside the state, for the fallback's
prefix means."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..linalg import half_sq_norm, logit_scale, with_ones_column
from ..ops.nystrom_softmax.causal import (
    EarlierKeys,
    ShiftedKeys,
    causal_nystrom_softmax_from_core,
)
from ..ops.shared.causal_nystrom import gaussian_features
from ..ops.shared.causal_prefix import by_blocks
from ..ops.shared.inputs import AttentionInputs
from ..ops.shared.rescaled_prefix import factor, joined_at_largest
from .causal_shard import CausalShard, Rows, causal_shard, offer_blocks
from .layout import ShardLayout
from .reduction import GroupReduction


def causal_nystrom_softmax_shard(q: Tensor, k: Tensor, v: Tensor, config: Any,
                                 info: AttentionInputs, layout: ShardLayout,
                                 reduce: GroupReduction) -> Tensor:
    """This rank's rows ``[B, H, N_r, Dv]`` of causal ``nystrom_softmax`` over the
    sequence whose shard ``q, k: [B, H, N_r, D]``, ``v: [B, H, N_r, Dv]`` it holds."""
    root = math.sqrt(logit_scale(info.head_dim, config.scale))
    shard = causal_shard(q, k, v, config, info, layout, reduce, root)
    ks = shard.k * root
    real = (torch.ones_like(ks[..., 0], dtype=torch.bool) if shard.valid is None
            else shard.valid[:, None, :].expand_as(ks[..., 0]))  # [B, H, N]
    qs = shard.q * root
    with torch.no_grad():  # r'_j: the running maximum of this rank's halo and rows
        own_max = half_sq_norm(ks.detach()).masked_fill(~real, float("-inf")).cummax(-1).values
        offset = torch.where(torch.isfinite(own_max), own_max, 0.0)
    v1 = torch.where(real[..., None], with_ones_column(shard.v), 0.0)
    keys = None
    if by_blocks(ks.shape[2], qs, ks, shard.v, shard.core.x, shard.core.l_inv):
        # inference: the features of one block at a time, for the states this rank
        # offers and again for its rows (ops/nystrom_softmax/causal.py)
        offers = _offers_by_blocks(ks, shard, own_max, offset, v1, config.kernel)
    else:
        psi_k = gaussian_features(ks, shard.core, row_valid=shard.valid, row_offset=offset,
                                  row_norm=False, kernel=config.kernel)
        offers = [_state(psi_k, own_max, v1, rows) for rows in (shard.head, shard.mine)]
        keys = ShiftedKeys(psi_k, offset)
    # [R, B, H, m + 1, Dv + 1] at [R, B, H], in one exchange; the shifts came back tied to
    # the sums' exchange: constants again (performer/causal.py, earlier_running_sums)
    sums, shifts = shard.earlier(list(zip(*offers, strict=True)), reduce)
    shifts = shifts.detach()
    m = shard.core.l_inv.shape[-1]
    joined, top = joined_at_largest(sums[..., :m, :], shifts)
    start = EarlierKeys(joined, top, sums[..., m:, :].sum(0))
    out = causal_nystrom_softmax_from_core(
        qs, ks, shard.v, shard.valid, shard.core, shard.landmarks, config.causal_local,
        config.normalizer_threshold, kernel=config.kernel, start=start, keys=keys)
    return shard.finish(out)


def _offers_by_blocks(ks: Tensor, shard: CausalShard, own_max: Tensor, offset: Tensor,
                      v1: Tensor, kernel: str) -> list[tuple[Tensor, Tensor]]:
    """The states of ``shard.head`` and ``shard.mine`` (``_state``), the keys' features
    taken block by block (``offer_blocks``), the blocks' states joined."""
    parts: list[list[tuple[Tensor, Tensor]]] = [[], []]
    for block, valid, *block_rows in offer_blocks(shard):
        psi_k = gaussian_features(ks[:, :, block], shard.core, row_valid=valid,
                                  row_offset=offset[:, :, block], row_norm=False, kernel=kernel)
        for part, rows in zip(parts, block_rows, strict=True):
            part.append(_state(psi_k, own_max[:, :, block], v1[:, :, block], rows))
    m = shard.core.l_inv.shape[-1]
    offers = []
    for part in parts:
        states, tops = torch.stack([s for s, _ in part]), torch.stack([t for _, t in part])
        joined, top = joined_at_largest(states[..., :m, :], tops)  # the values' sums: plain sums
        offers.append((torch.cat([joined, states[..., m:, :].sum(0)], 2), top))
    return offers


def _state(psi_k: Tensor, own_max: Tensor, v1: Tensor, rows: Rows) -> tuple[Tensor, Tensor]:
    """The state of ``rows`` at their largest r': ``([B, H, m + 1, Dv + 1], [B, H])``,
    sum_j psi(k_j) exp(-top) [v_j, 1] over m rows, then sum_j [v_j, 1] (``v1``, zero for
    padded keys); ``psi_k [B, H, N, m]`` at ``own_max`` r' (-inf before a real key)."""
    n = psi_k.shape[2]
    if isinstance(rows, slice):
        rows = _range(rows, n, psi_k)
    with torch.no_grad():
        shift = torch.where(rows[:, None, :], own_max, float("-inf"))  # [B, H, N]
        top = shift.amax(-1)  # [B, H]
        weight = factor(shift, top[..., None])  # exp(r'_j - top) <= 1, 0 off the rows
    sums = psi_k.transpose(-1, -2) @ (v1 * weight[..., None])  # [B, H, m, Dv + 1]
    values = torch.where(rows[:, None, :, None], v1, 0.0).sum(2, keepdim=True)
    return torch.cat([sums, values], 2), top


def _range(rows: slice, n: int, like: Tensor) -> Tensor:
    """``[1, N]`` bool: the positions of ``rows`` (a range)."""
    position = torch.arange(n, device=like.device)
    return ((position >= rows.start) & (position < rows.stop))[None]
