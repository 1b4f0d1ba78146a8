"""The two Gaussian block product kernels' results by PyTorch operations: what the
custom operators (``triton_ops``) compute under ``kernel="auto"`` where a kernel cannot
compile or launch (``kernel_matmul_triton.PRODUCT_FALLBACK``), in eager and compiled
code alike.

``rows_product`` and ``cols_product`` take the arguments of ``triton_kernels``'
functions of the same names and return their results up to rounding (the algebra is
in that module's docstring), ``chunk_rows`` rows at a time, so that no [N, m] block is
held whole. Half-type rows are converted chunk by chunk; ``x_bf16`` changes nothing
(x holds the values the kernels read either way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_matmul import _exponent, chunk_rows
from .nonfinite import row_marks


def _chunks(y: Tensor, m: int) -> list[slice]:
    n = y.shape[1]
    step = chunk_rows(n, y.shape[0], m, y.device)
    return [slice(s, s + step) for s in range(0, n, step)]


def _kept(a: Tensor | None, rows: slice) -> Tensor | None:
    """Which of ``rows`` the offsets a keep (+inf drops a row), or None (all)."""
    return None if a is None else a[:, rows] != float("inf")


def _exponents(y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None,
               exclude: Tensor | None, rows: slice, norm_scale: float | None,
               dot_scale: float, b_scale: float) -> tuple[Tensor, Tensor]:
    """(E, y) for ``rows`` of y: E ``[BH, c, m]`` in log2 units (no row shift), -inf
    where excluded (``kernel_matmul._exponent``, with the kernels' scales and row
    norms), and those rows ``[BH, c, D]`` in x's dtype."""
    y_c = y[:, rows].to(x.dtype)
    offset = None if a is None else a[:, rows]
    if norm_scale is not None:
        norms = torch.linalg.vecdot(y_c, y_c).mul_(norm_scale)
        offset = norms if offset is None else norms.add_(offset)
    e = _exponent(y_c, (x * dot_scale).transpose(1, 2), offset,
                  None if b is None else (b * -b_scale)[:, None, :],
                  y_c.new_empty(y_c.shape[0], y_c.shape[1], x.shape[1]),
                  None if exclude is None else exclude[:, rows])
    return e, y_c


def rows_product(
    y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vm: Tensor,
    vn: Tensor | None, exclude: Tensor | None, *,
    write_out1: bool = True, out1_dtype: torch.dtype | None = None,
    shift_rows: bool = False, out2_scale: float = 1.0, norm_coef: float | None = None,
    norm_scale: float | None = None, dot_scale: float = 1.0, b_scale: float = 1.0,
    x_bf16: bool = False, show_nonfinite: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``triton_kernels.rows_product``: (C V_M ``[BH, N, R]`` in ``out1_dtype``
    (default y's), ((V_N V_M^T) * C) X ``[BH, N, D]``, the row shifts ``[BH, N]``), None
    where not asked for."""
    bh, n, d = y.shape
    out1 = y.new_empty(bh, n, vm.shape[-1],
                       dtype=y.dtype if out1_dtype is None else out1_dtype) if write_out1 else None
    out2 = y.new_empty(bh, n, d) if vn is not None else None
    shift = x.new_empty(bh, n) if shift_rows else None
    for rows in _chunks(y, x.shape[1]):
        e, y_c = _exponents(y, x, a, b, exclude, rows, norm_scale, dot_scale, b_scale)
        if shift is not None:  # a row with no live column keeps shift 0
            top = e.amax(dim=-1)
            top = top.masked_fill(top == float("-inf"), 0.0)
            shift[:, rows] = top
            e.sub_(top[:, :, None])
        c = e.exp2_()
        c_vm = torch.bmm(c, vm) if write_out1 or norm_coef is not None else None
        if out1 is not None:
            out1[:, rows] = c_vm if not show_nonfinite else \
                c_vm + row_marks(y_c, valid=_kept(a, rows))[:, :, None]
        if out2 is not None:
            vn_c = vn[:, rows].to(x.dtype)
            de = torch.bmm(vn_c, vm.transpose(1, 2)).mul_(c)
            dy = torch.bmm(de, x).mul_(out2_scale)
            if norm_coef is not None:  # + norm_coef (dE 1)_i y_i, (dE 1)_i = vn_i . (C V_M)_i
                dy.addcmul_(y_c, torch.linalg.vecdot(vn_c, c_vm)[:, :, None], value=norm_coef)
            out2[:, rows] = dy
    return out1, out2, shift


def cols_product(
    y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vn: Tensor,
    vm: Tensor | None, exclude: Tensor | None, *, write_out1: bool = True,
    norm_scale: float | None = None, dot_scale: float = 1.0, b_scale: float = 1.0,
    out2_scale: float = 1.0, x_bf16: bool = False, show_nonfinite: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """``triton_kernels.cols_product``: (C^T V_N ``[BH, m, R]``, ``out2_scale``
    ((V_N V_M^T) * C)^T Y ``[BH, m, D]``), None where not asked for."""
    bh, _, d = y.shape
    m = x.shape[1]
    out1 = x.new_zeros(bh, m, vn.shape[-1]) if write_out1 else None
    out2 = x.new_zeros(bh, m, d) if vm is not None else None
    for rows in _chunks(y, m):
        e, y_c = _exponents(y, x, a, b, exclude, rows, norm_scale, dot_scale, b_scale)
        c = e.exp2_()
        vn_c = vn[:, rows].to(x.dtype)
        if out1 is not None:
            if show_nonfinite:  # the marks of y's and V_N's rows, in every entry
                marks = row_marks(y_c, vn_c, valid=_kept(a, rows))
                out1.add_(marks.sum(-1)[:, None, None])
            out1.baddbmm_(c.transpose(1, 2), vn_c)
        if out2 is not None:
            de = torch.bmm(vn_c, vm.transpose(1, 2)).mul_(c)
            out2.baddbmm_(de.transpose(1, 2), y_c)
    return out1, (None if out2 is None else out2.mul_(out2_scale))
