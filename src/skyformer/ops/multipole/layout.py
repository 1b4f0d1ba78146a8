"""Queries sorted by cluster and cut into blocks, and the row moves between the two orders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg.tracing import may_read_values


@dataclass(frozen=True)
class BlockLayout:
    """Queries sorted by cluster and cut into blocks of ``size`` rows."""

    size: int
    slot_query: Tensor  # [B, H, nb * size] query index per slot (Nq = empty slot)
    query_slot: Tensor  # [B, H, Nq] slot of each query
    block_cluster: Tensor  # [B, H, nb]


def block_layout(assignment: Tensor, num_clusters: int) -> BlockLayout:
    """Sort queries by cluster; cluster a fills ceil(|a| / size) blocks of
    size = ceil(N / 2c) rows, so at most N/size + c blocks, of which only as many as the
    fullest head needs are allocated (at most 1.5 N rows; under torch.compile or torch.func,
    which need shapes that do not depend on the data, the bound itself)."""
    b, h, n = assignment.shape
    size = max(1, -(-n // (2 * num_clusters)))
    with torch.no_grad():
        sorted_cluster, order = torch.sort(assignment, dim=-1, stable=True)
        counts = torch.zeros(b, h, num_clusters, dtype=torch.long, device=assignment.device)
        counts = counts.scatter_add(-1, assignment, torch.ones_like(assignment))
        blocks = -(-counts // size)
        bound = -(-n // size) + num_clusters
        nb = int(blocks.sum(-1).max()) if may_read_values(blocks) else bound
        first_block = blocks.cumsum(-1) - blocks
        first_row = counts.cumsum(-1) - counts
        rank = torch.arange(n, device=assignment.device) - first_row.gather(-1, sorted_cluster)
        block = first_block.gather(-1, sorted_cluster) + rank // size
        flat = block * size + rank % size  # [B, H, N] slot of the sorted queries
        slot_query = torch.full((b, h, nb * size), n, dtype=torch.long, device=assignment.device)
        slot_query = slot_query.scatter(-1, flat, order)
        query_slot = torch.empty_like(flat).scatter(-1, order, flat)
        block_cluster = torch.zeros(b, h, nb, dtype=torch.long, device=assignment.device)
        block_cluster = block_cluster.scatter(-1, block, sorted_cluster)
    return BlockLayout(size, slot_query, query_slot, block_cluster)


def gather_last(x: Tensor, index: Tensor) -> Tensor:
    """``x: [B, H, M]`` entries at ``index: [B, H, ...]``."""
    b, h = x.shape[:2]
    return x.gather(2, index.reshape(b, h, -1)).view(index.shape)
