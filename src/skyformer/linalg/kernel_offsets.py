"""Row offsets of the Gaussian block in log2 units, shared by both product paths.

C is evaluated as 2^(E log2 e): exp2 is ~3x cheaper than exp on CPU (PyTorch 2.x,
AVX-512), and the factor folds into the m landmark rows and the offsets at no cost.
"""

from __future__ import annotations

import torch
from torch import Tensor


def log2e() -> float:
    """log2(e), written as a literal for the code that ``torch.compile`` traces: with
    ``dynamic=True`` Dynamo turns a float read from a module global into a symbolic
    input, which (torch 2.13) it fails to carry into an autograd Function's forward
    (an internal assertion, ``lift_tracked_freevar_to_input should not be called on
    root SubgraphTracer``); a constant of the code stays a constant."""
    return 1.4426950408889634  # 1 / ln 2


LOG2E = log2e()  # for host code (kernel launches), which no compiler traces


def row_offsets(
    y: Tensor, scale: float, row_norm: bool, row_valid: Tensor | None,
    dtype: torch.dtype | None = None,
) -> Tensor | None:
    """a log2(e), a = s^2 |y|^2 / 2 (or 0), +inf on invalid rows: ``[BH, N]`` (None if all 0),
    in ``dtype`` (default y's; a half-type y is summed in that dtype, not rounded first).
    ``row_valid``: ``[BH, N]`` bool (False: an invalid row), or float constant offsets
    r_i added to a (+inf: an invalid row; ``gaussian_kernel_matmul(row_offset=...)``)."""
    dtype = y.dtype if dtype is None else dtype
    a = None
    if row_norm:
        a = squared_norms(y, dtype).mul_(0.5 * scale * scale * log2e())
    if row_valid is not None and row_valid.dtype != torch.bool:
        offset = row_valid.to(dtype) * log2e()
        a = offset if a is None else a + offset
    elif row_valid is not None:
        inf = torch.full((), float("inf"), dtype=dtype, device=y.device)  # a fill, no copy
        a = torch.where(row_valid, 0.0 if a is None else a, inf)
    return a


def offset_and_value_gradients(
    grad: Tensor, out: Tensor | None, rhs: Tensor, drhs: Tensor | None, *, transpose: bool,
    need_b: bool, need_rhs: bool, ones_column: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """(db, drhs) of a Gaussian block product, both paths' last step: the column offsets'
    gradient from the rows' identity (``kernel_matmul``'s docstring), -g . out for
    C^T V (``out`` its output) or -V_M . dZ for C Z (``rhs`` with its ones column), and
    the values' gradient without the ones column's."""
    db = None
    if need_b:
        db = -(torch.linalg.vecdot(grad, out) if transpose else torch.linalg.vecdot(rhs, drhs))
    if need_rhs and ones_column:
        drhs = drhs[..., :-1]
    return db, drhs if need_rhs else None


def squared_norms(y: Tensor, dtype: torch.dtype) -> Tensor:
    """|y_i|^2 over the last dim in ``dtype``: ``[..., N, D] -> [..., N]``; half-type rows
    are summed in ``dtype`` without a converted copy."""
    if dtype == y.dtype:
        return torch.linalg.vecdot(y, y)
    return torch.linalg.vector_norm(y, dim=-1, dtype=dtype).square_()
