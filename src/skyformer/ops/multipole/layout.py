"""Queries sorted by cluster and cut into blocks, and the row moves between the two orders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import functional_ops_only
from ...linalg.vmap import vmap_into_batch
from ..shared.tracing import may_read_values


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


class PermuteRows(torch.autograd.Function):
    """``out[:, :, j] = x_pad[:, :, index[j]]`` for a bijection between the rows of x and
    the entries of ``index`` below the row count R (R = an empty slot, a zero row), with
    ``inverse`` its inverse (R = empty). Autograd's gather backward is a scatter-add into
    zeros; for a bijection it is a gather by the inverse, several times cheaper on CPU.
    Call it through ``permute_rows``."""

    @staticmethod
    def forward(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:  # type: ignore[override]
        return gather_padded(x, index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[Tensor, int | None]:
        (out,), (dim,) = vmap_into_batch(PermuteRows.apply, info, in_dims, args,
                                         tensors=(0, 1, 2), outputs=1)
        return out, dim

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # linear: a gather
        (inverse,) = ctx.saved_tensors
        return gather_padded(grad, inverse), None, None


def permute_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """``PermuteRows``; under forward-mode AD and ``torch.export`` autograd's gather
    (a custom ``jvp`` rule would stop ``torch.compile``, which cannot trace one)."""
    if functional_ops_only():
        return gather_padded(x, index)
    return apply(PermuteRows, x, index, inverse)


def gather_padded(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x: [B, H, R, D]`` at ``index: [B, H, S]`` (R = a zero row) -> ``[B, H, S, D]``."""
    b, h, r, d = x.shape
    if index.shape[-1] > r:  # a bijection's index reaches R only if it has more entries
        x = torch.cat([x, x.new_zeros(b, h, 1, d)], dim=2)
    return gather_rows(x, index)


def gather_last(x: Tensor, index: Tensor) -> Tensor:
    """``x: [B, H, M]`` entries at ``index: [B, H, ...]``."""
    b, h = x.shape[:2]
    return x.gather(2, index.reshape(b, h, -1)).view(index.shape)
