"""The causal modified Nystrom methods sequence parallel: each rank runs the one-process
construction (``ops/skyformer/README.md``, "Causal"; ``shared/causal_nystrom.py``) on
its rows, after exchanges none of which grows with N.

Each rank gathers its real tokens to the front, as one process gathers the sequence's;
token t of rank r then has rank a_r + t among the sequence's real tokens (a_r: the real
tokens of the ranks before it, per batch element). Three exchanges:

1. **Landmarks.** Slot s sits at real rank s R + floor(u_s R), R from the sequence's
   real-token count (``causal_nystrom.slot_ranks``, alike on every rank); the rank
   holding that token contributes its query or key row: one all-reduce of m x D rows,
   after which every rank factorises the same core L^-1.
2. **Chunks across a boundary.** Chunks hold 64 real tokens counted from the
   sequence's first, so a rank's first chunk may begin on earlier ranks: its exact local
   part needs their last (at most 63) real keys and values. Every rank offers its last
   63 (P x 63 x (D + Dv) gathered); each takes the ones of its first chunk (the "halo").
3. **The far past.** The prefix state of the chunks before this rank's first (its
   keys j < 64 c_0): each rank offers the state of its keys before the last chunk
   boundary at or below its end ("head") and of all of them; an earlier rank whose last
   boundary is this rank's first chunk start gives its head (the rest is in the halo),
   any other its whole state (it ends at or before that start). What a state holds is
   the method's (``causal_skyformer.py``, ``causal_nystrom_softmax.py``).

Then the rank runs the one-process evaluation on its halo followed by its rows, whose
chunks are the sequence's, from that state. Output and gradients equal one process's up
to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..ops.shared.causal_nystrom import (
    CausalCore,
    CausalLandmarks,
    core_of_rows,
    slot_ranks,
    slot_takes_query,
)
from ..ops.shared.causal_prefix import CAUSAL_CHUNK, row_blocks
from ..ops.shared.inputs import AttentionInputs, compute_dtype, zero_padded_queries
from ..ops.shared.modified_nystrom import head_rows
from ..ops.shared.real_first import from_real_first, real_first, real_first_mask, to_real_first
from .layout import ShardLayout
from .reduction import GroupReduction

HALO = CAUSAL_CHUNK - 1  # the most real tokens of a chunk that can precede a rank's first

Rows = slice | Tensor  # rows of the halo-then-rows sequence: a range, or a [B, N] mask


@dataclass(frozen=True)
class CausalShard:
    """What this rank evaluates (module docstring): the halo's keys and values followed
    by its own rows, real tokens first, in the compute dtype and unscaled (``q, k: [B,
    H, N, D]``, ``v: [B, H, N, Dv]``, the halo's query rows zeros), ``valid [B, N]`` or
    None, ``head`` its rows before its last chunk boundary, ``mine`` all its rows; the
    core and the landmarks at positions of these rows."""

    q: Tensor
    k: Tensor
    v: Tensor
    valid: Tensor | None
    head: Rows
    mine: Rows
    core: CausalCore
    landmarks: CausalLandmarks
    gives_head: Tensor  # [R, B] bool: earlier rank r's head (else whole) precedes these
    finish: Callable[[Tensor], Tensor]  # an output's rows of this rank, as the call's

    def earlier(self, offers: Sequence[tuple[Tensor, Tensor]], reduce: GroupReduction
                ) -> list[Tensor]:
        """For each offer ``(head, whole)`` of this rank (``[B, ...]`` each, the states
        of its ``head`` and ``mine`` rows), ``[R, B, ...]``: of each earlier rank, its
        ``head`` or its ``whole``, whichever precedes this rank's first chunk. One
        exchange for all the offers."""
        parts = reduce.earlier_each(*(torch.stack(pair).movedim(0, -1) for pair in offers))
        return [torch.where(self.gives_head.view(*self.gives_head.shape,
                                                 *[1] * (part.dim() - 3)),
                            part[..., 0], part[..., 1])  # part: [R, B, ..., 2]
                for part in parts]


def causal_shard(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
                 layout: ShardLayout, reduce: GroupReduction, scale: float) -> CausalShard:
    """This rank's ``CausalShard`` of the sequence whose shard ``q, k: [B, H, N_r, D]``,
    ``v: [B, H, N_r, Dv]`` it holds; ``scale`` multiplies the landmark rows (the
    kernel's, or sqrt of the logit scale)."""
    dtype, work = q.dtype, compute_dtype(q.dtype)
    order = real_first(info.key_valid)
    valid = real_first_mask(info.key_valid, order)  # [B, N_r] real first, or None
    q, k, v = (to_real_first(t.to(work), order) for t in (q, k, v))
    counts = layout.valid_counts  # [P, B]
    before = layout.valid_before  # [B]: a_r
    total = counts.sum(0)  # [B]
    own = counts[layout.rank]  # [B]

    # 1. the landmark rows, each from the rank holding its token
    m = config.num_features
    stride = config.landmark_stride
    if stride is None:  # ceil(n / m) of the sequence's real tokens, as one process
        stride = ((total + (m - 1)) // m).clamp_min(1)
    ranks = slot_ranks(m, stride, batch=info.batch, device=q.device, key=layout.key,
                       draw=config.kernel)  # [B, m] among the sequence's real tokens
    live = ranks < total[:, None]
    local = ranks - before[:, None]
    held = live & (local >= 0) & (local < own[:, None])
    core = core_of_rows(reduce.sum(_landmark_rows(q, k, held, local)) * scale, live,
                        config.gamma)

    # 2. the halo: the earlier ranks' real tokens in this rank's first chunk
    first = (before // CAUSAL_CHUNK) * CAUSAL_CHUNK  # [B]: where that chunk starts
    halo = before - first  # [B] in [0, HALO]
    tails = reduce.earlier(_tail(torch.cat([k, v], dim=-1), own))  # [R, B, H, HALO, D + Dv]
    halo_kv, halo_valid = _halo(tails, counts[:layout.rank], first, halo)

    # 3. the halo followed by this rank's rows, whose chunks are the sequence's
    seq_q, seq_k, seq_v, seq_valid, head, mine, back = _halo_then_rows(
        q, k, v, halo_kv, halo_valid, valid, layout, first, halo, own)
    landmarks = CausalLandmarks(torch.where(live, ranks - first[:, None], 0), live,
                                slot_takes_query(m, q.device))
    ends = counts[:layout.rank].cumsum(0)  # [R, B]: one past each earlier rank's last

    def finish(out: Tensor) -> Tensor:
        return zero_padded_queries(from_real_first(back(out), order), info.query_valid).to(dtype)

    return CausalShard(seq_q, seq_k, seq_v, seq_valid, head, mine, core, landmarks,
                       (ends // CAUSAL_CHUNK) * CAUSAL_CHUNK == first, finish)


def offer_blocks(shard: CausalShard) -> Iterator[tuple[slice, Tensor | None, Rows, Rows]]:
    """The blocks of the shard's rows (``causal_prefix.row_blocks``) that a shard running
    by blocks takes its offers from: ``(block, its mask or None, shard.head's rows in it,
    shard.mine's)``."""
    for block in row_blocks(shard.k.shape[2]):
        valid = None if shard.valid is None else shard.valid[:, block]
        yield block, valid, rows_within(shard.head, block), rows_within(shard.mine, block)


def rows_within(rows: Rows, block: slice) -> Rows:
    """``rows`` of the sequence as rows of its ``block`` (a range of it)."""
    if isinstance(rows, slice):
        first = min(max(rows.start, block.start), block.stop) - block.start
        return slice(first, max(first, min(rows.stop, block.stop) - block.start))
    return rows[:, block]


def _halo_then_rows(q: Tensor, k: Tensor, v: Tensor, halo_kv: Tensor, halo_valid: Tensor,
                    valid: Tensor | None, layout: ShardLayout, first: Tensor, halo: Tensor,
                    own: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Rows, Rows,
                                          Callable[[Tensor], Tensor]]:
    """The halo's keys and values (queries: zeros, unused) followed by this rank's rows
    (real first), real tokens first: ``(q, k, v, valid, head, mine, back)``, with
    ``head`` the rows of this rank before its last chunk boundary, ``mine`` all its rows
    and ``back`` taking this rank's rows (real first) out of an output. Without padding
    here and on the ranks before, every batch element has the same halo, of the rows
    before: ranges and slices, no gathers."""
    d = k.shape[-1]
    halo_k, halo_v = halo_kv[..., :d], halo_kv[..., d:]
    if valid is None and layout.unpadded_before:
        h, n = layout.rows_before % CAUSAL_CHUNK, q.shape[2]
        cut = (layout.rows_before + n) // CAUSAL_CHUNK * CAUSAL_CHUNK - (layout.rows_before - h)
        seq = (torch.cat([q.new_zeros(*q.shape[:2], h, d), q], 2),
               torch.cat([halo_k[:, :, :h], k], 2), torch.cat([halo_v[:, :, :h], v], 2))
        return (*seq, None, slice(h, max(h, cut)), slice(h, h + n),
                lambda out: out[:, :, h:])
    if valid is None:  # padding on the ranks before only
        valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    seq_valid = torch.cat([halo_valid, valid], dim=1)  # [B, HALO + N_r]
    order = real_first(seq_valid)  # the halo, then this rank's real tokens
    seq = tuple(to_real_first(torch.cat(parts, 2), order) for parts in (
        (torch.zeros_like(halo_k), q), (halo_k, k), (halo_v, v)))
    position = torch.arange(seq_valid.shape[1], device=q.device)
    mine = (position >= halo[:, None]) & (position < (halo + own)[:, None])  # [B, N]
    end = first + halo + own  # one past this rank's last real rank
    head = mine & (position < ((end // CAUSAL_CHUNK) * CAUSAL_CHUNK - first)[:, None])
    return (*seq, real_first_mask(seq_valid, order), head, mine,
            lambda out: from_real_first(out, order)[:, :, HALO:])


def _landmark_rows(q: Tensor, k: Tensor, held: Tensor, local: Tensor) -> Tensor:
    """``[B, H, m, D]``: slot s's query row (even s) or key row where this rank holds its
    token (``held [B, m]``, at real-first row ``local [B, m]``), zeros elsewhere."""
    index = torch.where(held, local, 0)
    rows = torch.where(slot_takes_query(held.shape[1], q.device)[:, None],
                       head_rows(q, index), head_rows(k, index))
    return torch.where(held[:, None, :, None], rows, 0.0)


def _tail(rows: Tensor, own: Tensor) -> Tensor:
    """``[B, H, HALO, F]``: the last HALO real rows of ``rows [B, H, N_r, F]`` (real
    first; ``own [B]`` of them), slot t holding real row own - HALO + t (zeros before
    the first)."""
    b, h, _, f = rows.shape
    index = own[:, None] - HALO + torch.arange(HALO, device=rows.device)  # [B, HALO]
    taken = rows.gather(2, index.clamp_min(0)[:, None, :, None].expand(b, h, HALO, f))
    return torch.where((index >= 0)[:, None, :, None], taken, 0.0)


def _halo(tails: Tensor, counts: Tensor, first: Tensor, halo: Tensor) -> tuple[Tensor, Tensor]:
    """The real tokens of ranks ``first .. first + halo - 1`` (``[B]`` each) from the
    earlier ranks' ``tails [R, B, H, HALO, F]`` (``_tail``; ``counts [R, B]`` their real
    tokens), in HALO slots from the front: ``([B, H, HALO, F], valid [B, HALO])``."""
    r, b, h, _, f = tails.shape
    ends = counts.cumsum(0)  # [R, B]: one past each earlier rank's last real rank
    wanted = first[:, None] + torch.arange(HALO, device=first.device)  # [B, HALO]
    valid = torch.arange(HALO, device=first.device) < halo[:, None]
    owner = (ends[:, :, None] <= wanted).sum(0)  # [B, HALO], R where not valid
    owner_end = torch.cat([ends.T, ends.new_zeros(b, 1)], 1).gather(1, owner)
    slot = wanted - (owner_end - HALO)  # in [0, HALO) where valid
    index = torch.where(valid, 1 + owner * HALO + slot, 0)  # 0: a row of zeros
    flat = torch.cat([tails.new_zeros(b, h, 1, f),
                      tails.permute(1, 2, 0, 3, 4).reshape(b, h, r * HALO, f)], 2)
    return flat.gather(2, index[:, None, :, None].expand(b, h, HALO, f)), valid
