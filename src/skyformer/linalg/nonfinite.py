"""Marks of non-finite rows, made where a product reads them (``show_nonfinite`` of
``gaussian_kernel_matmul``): the value ``registry/guard.py`` adds to an output row, 0 or
NaN. A row pair's mark is 0 * (|y_i|^2 + the sum of v_i's entries): NaN where an entry
is NaN or inf, and also where y_i's squared norm overflows (float32: entries beyond
about 1e19, where the Gaussian kernel's exponent s^2 |y_i|^2 / 2 overflows too and the
row's kernel entries would be lost) or v_i's finite entries add up past the range. The
Triton kernels take |y_i|^2 from the sum they form for the row norm anyway."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_offsets import squared_norms


def row_marks(rows: Tensor, values: Tensor | None = None, valid: Tensor | None = None
              ) -> Tensor:
    """``[..., N]`` marks of ``rows: [..., N, D]`` and, with ``values: [..., N, R]``, of
    each row pair; 0 where ``valid: [..., N]`` (bool) is False. Summed in float32 for
    half types (float64 for float64), without gradient."""
    dtype = torch.promote_types(rows.dtype, torch.float32)
    sums = squared_norms(rows.detach(), dtype)
    if values is not None:
        sums = sums + values.detach().sum(-1, dtype=dtype)
    marks = sums * 0
    return marks if valid is None else torch.where(valid, marks, 0.0)
