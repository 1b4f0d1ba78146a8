"""Row offsets of the Gaussian block in log2 units, shared by both product paths.

C is evaluated as 2^(E log2 e): exp2 is ~3x cheaper than exp on CPU (PyTorch 2.x,
AVX-512), and the factor folds into the m landmark rows and the offsets at no cost.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2E = 1.0 / math.log(2.0)


def row_offsets(
    y: Tensor, scale: float, row_norm: bool, row_valid: Tensor | None,
    dtype: torch.dtype | None = None,
) -> Tensor | None:
    """a log2(e), a = s^2 |y|^2 / 2 (or 0), +inf on invalid rows: ``[BH, N]`` (None if all 0),
    in ``dtype`` (default y's; a half-type y is summed in that dtype, not rounded first)."""
    dtype = y.dtype if dtype is None else dtype
    a = None
    if row_norm:
        a = squared_norms(y, dtype).mul_(0.5 * scale * scale * LOG2E)
    if row_valid is not None:
        inf = torch.full((), float("inf"), dtype=dtype, device=y.device)  # a fill, no copy
        a = torch.where(row_valid, 0.0 if a is None else a, inf)
    return a


def squared_norms(y: Tensor, dtype: torch.dtype) -> Tensor:
    """|y_i|^2 over the last dim in ``dtype``: ``[..., N, D] -> [..., N]``; half-type rows
    are summed in ``dtype`` without a converted copy."""
    if dtype == y.dtype:
        return torch.linalg.vecdot(y, y)
    return torch.linalg.vector_norm(y, dim=-1, dtype=dtype).square_()
