"""Key sums and maxima completed across the ranks that hold the other shards."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..ops.shared.reduction import KeyReduction
from .collectives import all_reduce_max, all_reduce_sum


class GroupReduction(KeyReduction):
    """``KeyReduction`` over the ranks of ``group``: a differentiable all-reduce for sums
    (their size is the summand's, e.g. m x Dv, never N), a constant all-reduce for maxima."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def sum(self, partial: Tensor) -> Tensor:
        return all_reduce_sum(partial, self.group)

    def max(self, partial: Tensor) -> Tensor:
        return all_reduce_max(partial, self.group)
