"""A column of ones appended to the values: ``A [V, 1]`` gives ``A V`` and the row sums
``A 1`` (the normaliser of a softmax or kernel estimate) in one product
(``ops.shared.normalised.numerator_and_denominator`` splits them again)."""

from __future__ import annotations

import torch
from torch import Tensor


def with_ones_column(v: Tensor, ones_column: bool = True) -> Tensor:
    """``[v, 1]``: ``v [..., R]`` with a column of ones appended, ``[..., R + 1]`` (``v``
    itself where ``ones_column`` is False)."""
    if not ones_column:
        return v
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
