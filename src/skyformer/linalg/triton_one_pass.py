"""A Gaussian block product's backward pass in one pass over its N rows (Triton).

The backward pass of ``kernel_matmul_triton`` runs two kernels over the N rows of y
(``triton_kernels``): the rows kernel for the N-row gradients (dy, and dV = C g for
C^T V) and the cols kernel, one program per block of the m columns, for the m-row ones
(dx, and dZ = C^T g for C Z). Each forms the tile C and dE = (V_N V_M^T) * C again and
reads y and V_N; the cols kernel's programs read them once per column block. Where
every column fits one tile (``one_pass_applies``), one program per slice of the rows
can do both: for each block of rows it forms C and dE once, writes the rows' outputs,
which are complete since every column is there, and adds to the columns' sums, which
it keeps for its slice (partial sums added by the launcher, as the cols kernel's):

    ROW1 = C V_M,   ROW2 = s_r (dE X) + c_n (dE 1)_i y_i,   (rows kernel's OUT1, OUT2)
    COL1 = C^T V_N, COL2 = s_c dE^T Y                        (cols kernel's OUT1, OUT2)

per element pair: one exp and six products (eight and two exps for the two kernels),
and y and V_N read once. Offsets, masks, dtypes and dot precisions are those of
``triton_kernels`` (its ``_mm``): the outputs equal the two kernels' to rounding.

Off by default (``kernel_matmul_triton.ONE_PASS_BACKWARD``): the columns' two [m, D]
float32 sums stay in registers for the whole slice, which leaves one program per SM,
and on an H100 that cost more than the saved passes: 0.52-1.02x the two kernels' speed
in GPU time, 0.68x at B x H = 64, N = 32768 (``benchmarks/one_pass_sweep.py``,
docs/gpu-record.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kernel_backend import HALF_TYPES
from .kernel_matmul_triton import one_pass_applies
from .launch_grid import tile_width
from .triton_kernels import (
    STAGES,
    _column_side,
    _exclude_args,
    _in_slices_of_matrices,
    _mm,
    _precision,
    row_slices,
    strided_offsets,
)
from .triton_rounding import to_dtype


@triton.jit
def _one_pass_kernel(
    Y, X, A, B, VN, VM, EXC, ROW1, ROW2, COL1, COL2,
    N, M, D, R, BH, rows_per_split,
    s_exc_b, s_exc_n, s_exc_m, norm_scale, dot_scale, b_scale, row2_scale, norm_coef,
    col2_scale,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_EXC: tl.constexpr, ROW_NORM: tl.constexpr,
    X_BF16: tl.constexpr, WRITE_ROW1: tl.constexpr, WRITE_ROW2: tl.constexpr,
    NORM_TERM: tl.constexpr, WRITE_COL1: tl.constexpr, WRITE_COL2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, FMA: tl.constexpr,
):
    split = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    Y_BF16: tl.constexpr = Y.dtype.element_ty == tl.bfloat16  # exact bfloat16 tiles (_mm)
    VN_BF16: tl.constexpr = VN.dtype.element_ty == tl.bfloat16
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    col_in = rm < M
    x, b, vm = _column_side(X, B, VM, bh, rm, rd, rr, M, D, R, b_scale, HAS_B, True)
    col1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=x.dtype)
    col2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=x.dtype)
    start = split * rows_per_split
    for n0 in range(0, rows_per_split, BLOCK_N):
        rn = start + n0 + tl.arange(0, BLOCK_N)
        row_in = (rn < N) & (rn < start + rows_per_split)
        y = tl.load(Y + bh * N * D + rn[:, None] * D + rd[None, :],
                    mask=row_in[:, None] & (rd < D)[None, :], other=0.0).to(x.dtype)
        e = _mm(y, tl.trans(x), PRECISION, FMA, Y_BF16, X_BF16).to(x.dtype) * dot_scale
        e = e - b[None, :]
        if HAS_A:
            a = tl.load(A + bh * N + rn, mask=row_in, other=float("inf"))
            e = e - a[:, None]
        if ROW_NORM:
            e = e - (norm_scale * tl.sum(y * y, axis=1))[:, None]
        e = tl.where(row_in[:, None] & col_in[None, :], e, float("-inf"))
        if HAS_EXC:
            exc = tl.load(EXC + bh * s_exc_b + strided_offsets(rn, s_exc_n, rm, s_exc_m),
                          mask=row_in[:, None] & col_in[None, :], other=0)
            e = tl.where(exc != 0, float("-inf"), e)
        c = tl.exp2(e)  # [BLOCK_N, BLOCK_M]
        vn = tl.load(VN + bh * N * R + rn[:, None] * R + rr[None, :],
                     mask=row_in[:, None] & (rr < R)[None, :], other=0.0).to(x.dtype)
        if WRITE_ROW1:
            row1 = _mm(c.to(vm.dtype), vm, PRECISION, FMA)  # [BLOCK_N, BLOCK_R]
            tl.store(ROW1 + bh * N * R + rn[:, None] * R + rr[None, :],
                     to_dtype(row1, ROW1.dtype.element_ty),
                     mask=row_in[:, None] & (rr < R)[None, :])
        if WRITE_ROW2 or WRITE_COL2:
            de = _mm(vn, tl.trans(vm), PRECISION, FMA, VN_BF16).to(c.dtype) * c
        if WRITE_ROW2:
            row2 = _mm(de.to(x.dtype), x, PRECISION, FMA, False, X_BF16) * row2_scale
            if NORM_TERM:  # dy's term of the row norm: (dE 1)_i, every column in the tile
                row2 += norm_coef * tl.sum(de, axis=1)[:, None] * y
            tl.store(ROW2 + bh * N * D + rn[:, None] * D + rd[None, :],
                     to_dtype(row2, ROW2.dtype.element_ty),
                     mask=row_in[:, None] & (rd < D)[None, :])
        if WRITE_COL1:
            col1 += _mm(tl.trans(c).to(vn.dtype), vn, PRECISION, FMA, False, VN_BF16)
        if WRITE_COL2:
            col2 += _mm(tl.trans(de).to(y.dtype), y, PRECISION, FMA, False, Y_BF16)
    base = split * BH + bh
    if WRITE_COL1:
        tl.store(COL1 + base * M * R + rm[:, None] * R + rr[None, :], col1,
                 mask=col_in[:, None] & (rr < R)[None, :])
    if WRITE_COL2:
        tl.store(COL2 + base * M * D + rm[:, None] * D + rd[None, :], col2 * col2_scale,
                 mask=col_in[:, None] & (rd < D)[None, :])


def _tiles(bm: int, bd: int, br: int, dtype: torch.dtype, half_rows: bool) -> tuple[int, int]:
    """(BLOCK_N rows a loop step, warps). Compiled for sm_90 (Triton 3.9,
    ``benchmarks/triton_resources.py --one-pass-backward``,
    ``results/triton_resources_one_pass.md``), nothing spills with 32 rows for half-type
    rows where every tile is at most 64 wide (m = 64, D = 64) and with 16 rows otherwise
    (m = 128; float32 rows, whose tf32x3 products spilled with 32 rows at m = 64 while
    the tiles were chosen). float64 is summed by broadcasting [BLOCK_N, BLOCK_M, BLOCK_D]
    values (``_mm``): few rows."""
    if dtype == torch.float64:
        return 8, 4
    return (32 if half_rows and max(bm, bd, br) <= 64 else 16), 8


@_in_slices_of_matrices
def one_pass_product(
    y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vn: Tensor, vm: Tensor,
    exclude: Tensor | None, *, write_row1: bool, write_row2: bool, write_col1: bool,
    write_col2: bool, row2_scale: float = 1.0, norm_coef: float | None = None,
    norm_scale: float | None = None, dot_scale: float = 1.0, b_scale: float = 1.0,
    col2_scale: float = 1.0, x_bf16: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(C V_M, ``row2_scale`` (dE X) + ``norm_coef`` (dE 1)_i y_i, C^T V_N,
    ``col2_scale`` dE^T Y) with dE = (V_N V_M^T) * C, each only where asked for (None
    otherwise): ``triton_kernels.rows_product``'s two outputs and ``cols_product``'s,
    in one pass. Shapes and the other options as there: y ``[BH, N, D]``, x
    ``[BH, m, D]``, vn ``[BH, N, R]``, vm ``[BH, m, R]`` (``one_pass_applies``)."""
    bh, n, d = y.shape
    m, r = x.shape[1], vm.shape[-1]
    if not one_pass_applies(m, d, r):
        raise ValueError(f"one pass holds every column in one tile and the rows' tiles "
                         f"at most 64 wide (one_pass_applies): got m = {m}, D = {d}, "
                         f"R = {r}.")
    bm, bd, br = tile_width(m), tile_width(d), tile_width(r)
    bn, warps = _tiles(bm, bd, br, x.dtype, y.dtype in HALF_TYPES)
    # four programs per SM, as this kernel was timed (one resident per SM: not re-timed
    # with the cols kernel's eight)
    splits, rows_per_split = row_slices(n, bh, bn, y.device, per_sm=4)
    row1 = y.new_empty(bh, n, r, dtype=vn.dtype) if write_row1 else None
    row2 = y.new_empty(bh, n, d) if write_row2 else None
    col1 = x.new_empty(splits, bh, m, r) if write_col1 else None
    col2 = x.new_empty(splits, bh, m, d) if write_col2 else None
    exc, se_b, se_n, se_m = _exclude_args(exclude, y)
    dummy = y
    _one_pass_kernel[(splits, bh)](
        y, x, dummy if a is None else a, dummy if b is None else b, vn, vm, exc,
        *(dummy if t is None else t for t in (row1, row2, col1, col2)),
        n, m, d, r, bh, rows_per_split, se_b, se_n, se_m,
        0.0 if norm_scale is None else float(norm_scale), float(dot_scale), float(b_scale),
        float(row2_scale), 0.0 if norm_coef is None else float(norm_coef), float(col2_scale),
        HAS_A=a is not None, HAS_B=b is not None, HAS_EXC=exclude is not None,
        ROW_NORM=norm_scale is not None, X_BF16=x_bf16, WRITE_ROW1=write_row1,
        WRITE_ROW2=write_row2, NORM_TERM=write_row2 and norm_coef is not None,
        WRITE_COL1=write_col1, WRITE_COL2=write_col2,
        BLOCK_N=bn, BLOCK_M=bm, BLOCK_D=bd, BLOCK_R=br,
        PRECISION=_precision(x.dtype, y.dtype, y.device), FMA=x.dtype == torch.float64,
        num_warps=warps, num_stages=STAGES,
    )
    return (row1, row2, None if col1 is None else col1.sum(0),
            None if col2 is None else col2.sum(0))
