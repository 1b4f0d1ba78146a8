"""Block-diagonal attention support from equal-sized angular LSH buckets (KDEformer Fig. 6).

Queries and keys are ordered separately by ``hamming_order`` (Definition A.3) with the
same hyperplanes, and the t-th chunk of queries is paired with the t-th chunk of keys:
in the permuted coordinates the support is block diagonal, with ``num_blocks =
ceil(Nk / block_size)`` blocks of ``block_size`` keys and ``query_block_size`` queries
(equal to ``block_size`` in self-attention). Query i and key j are in the same bucket
iff ``q_block[i] == k_block[j]``.

Padded rows sort after the real ones, so the real rows fill the leading blocks in the
same order with or without padding (for one sequence, right padding gives the blocks
of truncation); callers mask padded keys inside a block. Slots past the end of the
sequence hold the index N (one past the last row): ``gather_block_rows`` reads a zero
row there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..linalg.rows import gather_rows
from ..linalg.tracing import may_read_values
from .angular_lsh import equal_size_buckets, hamming_order


@dataclass(frozen=True)
class LshBlocks:
    """Positions of the rows in each block, and the block of each row."""

    q_index: Tensor  # [B, H, num_blocks, query_block_size] long, Nq = empty slot
    k_index: Tensor  # [B, H, num_blocks, block_size] long, Nk = empty slot
    q_slot: Tensor  # [B, H, Nq] long: flat slot of each query in [num_blocks * query_block_size]
    q_block: Tensor  # [B, H, Nq] long
    k_block: Tensor  # [B, H, Nk] long
    k_order: Tensor  # [B, H, Nk] long: keys in Hamming (Gray-rank) order, padded keys last


def _inverse(order: Tensor) -> Tensor:
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter(-1, order, positions)


def hamming_blocks(
    q: Tensor, k: Tensor, hyperplanes: Tensor, block_size: int, *,
    query_valid: Tensor | None = None, key_valid: Tensor | None = None,
) -> LshBlocks:
    """Equal-sized LSH buckets of queries and keys.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``.
        hyperplanes: ``[B, H, D, r]`` (see ``draw_hyperplanes``).
        block_size: keys per block (> 0).
        query_valid: ``[B, Nq]``; key_valid: ``[B, Nk]`` bool, True = real row.
    """
    if block_size < 1:  # a comparison, not an int check: a compiled size may be symbolic
        raise ValueError(f"hamming_blocks: block_size must be a positive integer (keys per "
                         f"block), got {block_size!r}.")
    nq, nk = q.shape[2], k.shape[2]
    num_blocks = math.ceil(nk / block_size)
    q_order = hamming_order(q, hyperplanes, query_valid)
    k_order = hamming_order(k, hyperplanes, key_valid)
    k_index = equal_size_buckets(k_order, block_size, num_blocks)
    k_block = _inverse(k_order) // block_size
    # Self-attention: the queries are the keys (one mask object, or none). Otherwise the
    # queries are cut by the real counts, also when Nq == Nk.
    if nq != nk or query_valid is not key_valid:
        q_index, q_slot, q_block = _cross_query_blocks(
            q_order, block_size, num_blocks, query_valid, key_valid, nk)
        return LshBlocks(q_index, k_index, q_slot, q_block, k_block, k_order)
    q_slot = _inverse(q_order)
    return LshBlocks(
        q_index=equal_size_buckets(q_order, block_size, num_blocks),
        k_index=k_index,
        q_slot=q_slot,
        q_block=q_slot // block_size,
        k_block=k_block,
        k_order=k_order,
    )


def _cross_query_blocks(q_order: Tensor, block_size: int, num_blocks: int,
                        query_valid: Tensor | None, key_valid: Tensor | None, nk: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Query blocks in cross-attention, per batch element from its real counts: the
    element's n_k real keys fill b = ceil(n_k / block_size) blocks, and its n_q real
    queries (in Hamming order) are cut into b chunks of ceil(n_q / b), so that padding
    gives the blocks of truncation. The slot count per block is the largest such chunk
    (read from the masks in eager mode; ``nq`` under tracing, where values cannot be
    read). Padded queries get slot 0 (their outputs are zeroed by the caller).
    Returns (q_index ``[B, H, nb, sq]``, q_slot ``[B, H, Nq]``, q_block ``[B, H, Nq]``)."""
    b, h, nq = q_order.shape
    device = q_order.device
    n_q = (query_valid.sum(-1) if query_valid is not None
           else torch.full((b,), nq, device=device))  # [B]
    n_k = (key_valid.sum(-1) if key_valid is not None
           else torch.full((b,), nk, device=device))
    blocks = torch.div(n_k + block_size - 1, block_size, rounding_mode="floor").clamp_min(1)
    chunk = torch.div(n_q + blocks - 1, blocks, rounding_mode="floor").clamp_min(1)  # [B]
    q_size = int(chunk.max()) if may_read_values(chunk) else nq
    rank = torch.arange(nq, device=device)  # position in the Hamming order
    real = rank[None, :] < n_q[:, None]  # [B, Nq]
    block = torch.div(rank[None, :], chunk[:, None], rounding_mode="floor")
    slot = block * q_size + rank[None, :] - block * chunk[:, None]  # [B, Nq] by rank
    sentinel = num_blocks * q_size
    target = torch.where(real, slot, sentinel)[:, None, :].expand(b, h, nq)
    flat = q_order.new_full((b, h, sentinel + 1), nq)
    flat = flat.scatter(2, target, q_order)[..., :sentinel]
    q_index = flat.view(b, h, num_blocks, q_size)
    # per query position: its rank in the order, then its block and slot
    position_rank = _inverse(q_order)  # [B, H, Nq]
    real_rank = position_rank < n_q[:, None, None]
    q_block = torch.where(real_rank, torch.div(position_rank, chunk[:, None, None],
                                               rounding_mode="floor"), 0)
    q_slot = torch.where(real_rank, slot[:, None, :].expand(b, h, nq).gather(
        2, position_rank), 0)
    return q_index, q_slot, q_block


def gather_block_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x: [B, H, N, C]`` at ``index: [B, H, nb, s]`` -> ``[B, H, nb, s, C]``;
    index N reads zeros."""
    b, h, _, c = x.shape
    padded = torch.cat([x, x.new_zeros(b, h, 1, c)], dim=2)
    return gather_rows(padded, index)


def gather_block_values(x: Tensor, index: Tensor, fill: float | bool = 0) -> Tensor:
    """Entries of ``x: [B, H, N]`` (or ``[B, 1, N]``) at ``index: [B, H, nb, s]``;
    index N reads ``fill``."""
    b, _, n = x.shape
    padded = torch.cat([x, x.new_full((b, x.shape[1], 1), fill)], dim=2)
    padded = padded.expand(b, index.shape[1], n + 1)
    return padded.gather(2, index.reshape(b, index.shape[1], -1)).view(index.shape)


def scatter_block_rows(x: Tensor, blocks: LshBlocks) -> Tensor:
    """Per-query results in block layout ``[B, H, nb, sq, C]`` back to ``[B, H, Nq, C]``."""
    b, h, nb, sq, c = x.shape
    return gather_rows(x.reshape(b, h, nb * sq, c), blocks.q_slot)
