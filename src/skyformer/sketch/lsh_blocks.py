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
    nq, nk = q.shape[2], k.shape[2]
    num_blocks = math.ceil(nk / block_size)
    q_size = block_size if nq == nk else math.ceil(nq / num_blocks)
    q_order = hamming_order(q, hyperplanes, query_valid)
    k_order = hamming_order(k, hyperplanes, key_valid)
    q_slot = _inverse(q_order)
    return LshBlocks(
        q_index=equal_size_buckets(q_order, q_size, num_blocks),
        k_index=equal_size_buckets(k_order, block_size, num_blocks),
        q_slot=q_slot,
        q_block=q_slot // q_size,
        k_block=_inverse(k_order) // block_size,
        k_order=k_order,
    )


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
