"""Key sums and maxima completed across the ranks that hold the other shards."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.shared.reduction import KeyReduction
from .collectives import all_reduce_max, all_reduce_sum


class GroupReduction(KeyReduction):
    """``KeyReduction`` over the ranks of ``group``: a differentiable all-reduce for sums
    (their size is the summand's, e.g. m x Dv, never N) and for the earlier ranks'
    partials, a constant all-reduce for maxima."""

    sharded = True

    def __init__(self, group: Any) -> None:
        self.group = group

    def sum(self, partial: Tensor) -> Tensor:
        return all_reduce_sum(partial, self.group)

    def max(self, partial: Tensor) -> Tensor:
        return all_reduce_max(partial, self.group)

    def earlier(self, partial: Tensor) -> Tensor:
        """Every rank's partial, by a differentiable all-reduce of this rank's put in its
        slot of zeros (``[P, *partial.shape]``, P times the summand: m x Dv-sized states,
        never N), then the slots before this rank's. Its backward pass all-reduces as the
        sums' does, on every rank alike (rank 0's empty slice included)."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        zeros = partial.new_zeros(1, *partial.shape)
        slots = torch.cat([zeros.expand(rank, *partial.shape), partial[None],
                           zeros.expand(world - rank - 1, *partial.shape)])
        return all_reduce_sum(slots, self.group)[:rank]
