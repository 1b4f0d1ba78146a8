"""Triton kernels for the Gaussian block products of ``kernel_matmul``, never forming C.

With the block, in log2 units (exp2 is the hardware's exponential),

    E_is = f y_i . x_s - a_i - g b_s,    C_is = 2^E_is,

and two [N, R] / [m, R] value matrices V_N (one row per y row) and V_M (one row per x
row), the two kernels compute everything the forward and backward passes need:

    rows kernel (one program per BLOCK_N rows of y, loops over the m columns):
        OUT1 = C V_M                      [N, R]
        OUT2 = ((V_N V_M^T) * C) X        [N, D]   (the chunk of dy before its scale)
    cols kernel (one program per BLOCK_M columns and one slice of the rows):
        OUT1 = C^T V_N                    [m, R]
        OUT2 = h ((V_N V_M^T) * C)^T Y    [m, D]   (dx)

The cols kernel splits the N rows into ``splits`` slices (m is small, so the column
blocks alone would leave most of a GPU idle) and writes partial sums that the
launcher adds. Tiles are [BLOCK_N, BLOCK_M] in registers; nothing of size N x m is
written. Out-of-range rows/columns, a_i = +inf (rows to drop), b_s = +inf (columns to
drop) and ``exclude`` entries give C = 0. ``shift_rows`` (rows kernel) first finds each
row's largest exponent and subtracts it (a row with no live column keeps shift 0).
The factors f = s log2(e) (s the row scale) and g = log2(e) are arguments
(``dot_scale``, ``b_scale``), applied to each tile, so x and b enter as the method holds
them (scaling them first was two operations a product and two more in its backward);
h (``out2_scale``) is the scale of dx. dy's term of the row norms, -s^2 (dE 1)_i y_i
(``NORM_TERM``), takes the row sums of the dE tiles that OUT2 multiplies, so a launch
for dy alone forms no C V_M: compiled for sm_90 at the model shape (bfloat16, D = 64,
m = 128) it holds 16 MMA instructions instead of 22 and 168 registers instead of 235
(Triton 3.6; 12 resident warps per SM instead of 8). The row norms' share of a_i
(s^2 |y_i|^2 / 2 in log2 units, ``norm_scale``) the kernels sum themselves from the
y tiles they read (a PyTorch norm of a half-type y was a slow reduction of its own:
0.26 ms for each of q and k at B=4, H=16, N=16384, D=64 on an H200, where the
kernels read y anyway). x (and everything with m rows)
is float32 or float64, the compute dtype; the N-row inputs y, V_N may also be
bfloat16 or float16, read into the compute dtype tile by tile (exact), so that a
half-precision model needs no float32 copy of its queries, keys and values. Sums are
kept in the compute dtype; N-row outputs are stored in their input's dtype.

``SHOW_NONFINITE`` (forward products) marks non-finite inputs in OUT1 as
``registry/guard.py`` does, in the tiles the kernels read anyway (the guard's own pass
was three reductions over q, k, v and an addition over the output: 11 % of a Skyformer
call's GPU time at the model shape and N = 16384 on an H100): a row's mark
0 * (|y_i|^2 + the sum of V_N,i's entries) is 0, or NaN where an entry is NaN or inf
(``linalg/nonfinite.py``). |y_i|^2 is the row norm's own sum (an extra sum of y's
entries took the cols kernel from 155 to 176 registers at head dim 64, compiled for
sm_90, and from 12 to 8 resident warps). The rows kernel adds y_i's mark to row i of OUT1; the
cols kernel adds the marks of the rows y_i, V_N,i of its slice to every entry of its
part of C^T V_N (one running scalar). Rows dropped by a_i = +inf carry no mark.

This module imports Triton; ``kernel_matmul_triton`` imports it only when the Triton
path is chosen, so the library runs without Triton installed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kernel_backend import interpreter_on
from .launch_grid import cdiv, tile_width
from .triton_limits import launch_within_limits
from .triton_rounding import bf16_values, to_dtype


@triton.jit
def _split_bf16(a):
    """(hi, lo) bfloat16 tiles with hi + lo = a to about 17 mantissa bits."""
    hi = to_dtype(a, tl.bfloat16)
    return hi, to_dtype(a - hi.to(a.dtype), tl.bfloat16)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, FMA: tl.constexpr, A_BF16: tl.constexpr = False,
        B_BF16: tl.constexpr = False):
    """a @ b: on the tensor cores, or (``FMA``, float64) as a broadcast sum, which
    every Triton backend compiles (float64 MMA layouts fail to lower in Triton 3.6).

    ``PRECISION="bf16x3"``: float32 tiles as hi + lo bfloat16 pairs, three bfloat16
    products summed in float32 (a_hi b_hi + a_hi b_lo + a_lo b_hi, relative error about
    2^-16), written out here so that every Triton version compiles it the same way.
    ``A_BF16`` / ``B_BF16``: that operand holds bfloat16 values (tiles read from
    bfloat16 tensors), so its lo part is zero and its product is left out: two MMAs,
    or one for two such operands, the same sum.
    ``"bf16x3-interpreted"``: the same parts multiplied as float32 values (exact, as
    the tensor cores do), for Triton's interpreter, whose bfloat16 ``tl.dot`` is wrong
    (Triton 3.9: two 16 x 16 tiles of ones give 4.2e9 for 16).
    ``"bf16"`` (``"bf16-interpreted"``): one product of the tiles rounded to bfloat16,
    summed in float32 (``ROWS_ONE_BF16_PASS``)."""
    if FMA:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    elif PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif PRECISION == "bf16-interpreted":
        return tl.dot(bf16_values(a), bf16_values(b),
                      input_precision="ieee")
    elif PRECISION == "bf16x3" or PRECISION == "bf16x3-interpreted":
        a_hi, a_lo = _split_bf16(a)
        b_hi, b_lo = _split_bf16(b)
        acc = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
        if not A_BF16:
            acc = _dot_bf16(a_lo, b_hi, acc, PRECISION)
        if not B_BF16:
            acc = _dot_bf16(a_hi, b_lo, acc, PRECISION)
        return _dot_bf16(a_hi, b_hi, acc, PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_bf16(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b for bfloat16 tiles, summed in float32 (``_mm``'s bf16x3 parts)."""
    if PRECISION == "bf16x3-interpreted":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def strided_offsets(rows, s_rows, cols, s_cols):
    """``rows[:, None] s_rows + cols[None, :] s_cols`` in int64: an exclude mask of any
    strides (a transposed ``[m, N]`` one has a column stride of N) takes int32
    products past 2^31 from m N = 2^31 (m = 128, N = 2^24) on."""
    return rows.to(tl.int64)[:, None] * s_rows + cols.to(tl.int64)[None, :] * s_cols


@triton.jit
def _column_side(X, B, VM, bh, rm, rd, rr, M, D, R, b_scale, HAS_B: tl.constexpr,
                 HAS_VM: tl.constexpr):
    """A program's columns ``rm`` of the landmark side: x ``[BLOCK_M, BLOCK_D]``, the
    scaled offsets b (+inf outside the m columns) and V_M ``[BLOCK_M, BLOCK_R]`` (zeros
    without ``HAS_VM``); for the kernels that hold their columns for a whole row slice."""
    col_in = rm < M
    x = tl.load(X + bh * M * D + rm[:, None] * D + rd[None, :],
                mask=col_in[:, None] & (rd < D)[None, :], other=0.0)
    if HAS_B:
        b = b_scale * tl.load(B + bh * M + rm, mask=col_in, other=float("inf"))
    else:
        b = tl.zeros([rm.shape[0]], dtype=x.dtype)
    b = tl.where(col_in, b, float("inf"))
    if HAS_VM:
        vm = tl.load(VM + bh * M * R + rm[:, None] * R + rr[None, :],
                     mask=col_in[:, None] & (rr < R)[None, :], other=0.0)
    else:
        vm = tl.zeros([rm.shape[0], rr.shape[0]], dtype=x.dtype)
    return x, b, vm


@triton.jit
def _rows_kernel(
    Y, X, A, B, VM, VN, EXC, OUT1, OUT2, SHIFT,
    N, M, D, R,
    s_exc_b, s_exc_n, s_exc_m, out2_scale, norm_coef, norm_scale, dot_scale, b_scale,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_EXC: tl.constexpr,
    WRITE_OUT1: tl.constexpr, HAS_VN: tl.constexpr, SHIFT_ROWS: tl.constexpr,
    NORM_TERM: tl.constexpr, ROW_NORM: tl.constexpr, X_BF16: tl.constexpr,
    SHOW_NONFINITE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, FMA: tl.constexpr,
    VALUE_PRECISION: tl.constexpr,
):
    """Rows of y against every column (module docstring); the exponent's dot in
    ``PRECISION``, the value products in ``VALUE_PRECISION`` (``rows_value_precision``)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    Y_BF16: tl.constexpr = Y.dtype.element_ty == tl.bfloat16  # exact bfloat16 tiles (_mm)
    VN_BF16: tl.constexpr = VN.dtype.element_ty == tl.bfloat16
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: N * D may pass 2^31
    rd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    row_in = rn < N
    y = tl.load(Y + bh * N * D + rn[:, None] * D + rd[None, :],
                mask=row_in[:, None] & (rd < D)[None, :], other=0.0).to(X.dtype.element_ty)
    if HAS_A:
        a = tl.load(A + bh * N + rn, mask=row_in, other=0.0)
    else:
        a = tl.zeros([BLOCK_N], dtype=y.dtype)
    if ROW_NORM or SHOW_NONFINITE:
        squares = tl.sum(y * y, axis=1)
    if SHOW_NONFINITE:  # 0, or NaN for a valid row with a NaN or inf (module docstring)
        mark = tl.where(a == float("inf"), 0.0, squares * 0.0)
    if ROW_NORM:  # a_i += norm_scale |y_i|^2, from the tile in registers
        a += norm_scale * squares
    if HAS_VN:
        vn = tl.load(VN + bh * N * R + rn[:, None] * R + rr[None, :],
                     mask=row_in[:, None] & (rr < R)[None, :], other=0.0).to(y.dtype)
    if SHIFT_ROWS:
        top = tl.full([BLOCK_N], float("-inf"), dtype=y.dtype)
        for m0 in range(0, M, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            x = tl.load(X + bh * M * D + rm[:, None] * D + rd[None, :],
                        mask=(rm < M)[:, None] & (rd < D)[None, :], other=0.0)
            e = _mm(y, tl.trans(x), PRECISION, FMA, Y_BF16, X_BF16).to(y.dtype) * dot_scale
            e = e - a[:, None]
            if HAS_B:
                b = tl.load(B + bh * M + rm, mask=rm < M, other=float("inf"))
                e = e - b_scale * b[None, :]
            e = tl.where((rm < M)[None, :], e, float("-inf"))
            if HAS_EXC:
                exc = tl.load(EXC + bh * s_exc_b + strided_offsets(rn, s_exc_n, rm, s_exc_m),
                              mask=row_in[:, None] & (rm < M)[None, :], other=0)
                e = tl.where(exc != 0, float("-inf"), e)
            top = tl.maximum(top, tl.max(e, axis=1))
        top = tl.where(top == float("-inf"), 0.0, top)
        tl.store(SHIFT + bh * N + rn, top, mask=row_in)
        a = a + top
    ONE_BF16: tl.constexpr = VALUE_PRECISION == "bf16" or VALUE_PRECISION == "bf16-interpreted"
    # dy's row-norm term (dE 1)_i: the sums of the dE tiles, or vn_i . (C V_M)_i where
    # C V_M is formed anyway (WRITE_OUT1) for head dims above 64: there the sums in the
    # loop spilled 48 bytes a thread in the float32 launch (sm_90, Triton 3.6), where up
    # to 64 they take fewer registers (Triton 3.9: 249 against 255 and 16 bytes spilled
    # at the model shape). Where dE is rounded once (ONE_BF16), always its sums: both of
    # dy's terms must read the same numbers.
    SUM_DE: tl.constexpr = NORM_TERM and (ONE_BF16 or not WRITE_OUT1 or BLOCK_D <= 64)
    acc1 = tl.zeros([BLOCK_N, BLOCK_R], dtype=y.dtype)
    acc2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=y.dtype)
    de_sum = tl.zeros([BLOCK_N], dtype=y.dtype)  # SUM_DE: (dE 1)_i
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        col_in = rm < M
        x = tl.load(X + bh * M * D + rm[:, None] * D + rd[None, :],
                    mask=col_in[:, None] & (rd < D)[None, :], other=0.0)
        e = _mm(y, tl.trans(x), PRECISION, FMA, Y_BF16, X_BF16).to(y.dtype) * dot_scale
        e = e - a[:, None]
        if HAS_B:
            b = tl.load(B + bh * M + rm, mask=col_in, other=float("inf"))
            e = e - b_scale * b[None, :]
        e = tl.where(col_in[None, :], e, float("-inf"))
        if HAS_EXC:
            exc = tl.load(EXC + bh * s_exc_b + strided_offsets(rn, s_exc_n, rm, s_exc_m),
                          mask=row_in[:, None] & col_in[None, :], other=0)
            e = tl.where(exc != 0, float("-inf"), e)
        c = tl.exp2(e)  # [BLOCK_N, BLOCK_M]
        vm = tl.load(VM + bh * M * R + rm[:, None] * R + rr[None, :],
                     mask=col_in[:, None] & (rr < R)[None, :], other=0.0)
        if WRITE_OUT1:
            acc1 += _mm(c.to(vm.dtype), vm, VALUE_PRECISION, FMA)
        if HAS_VN:
            de = _mm(vn, tl.trans(vm), VALUE_PRECISION, FMA, VN_BF16).to(c.dtype) * c
            if ONE_BF16:  # rounded once, so that dy's two terms (dE X and the row
                # norm's, from the sums below) read the same numbers and still cancel
                de = bf16_values(de)
            acc2 += _mm(de.to(x.dtype), x, VALUE_PRECISION, FMA, False, X_BF16)
            if SUM_DE:
                de_sum += tl.sum(de, axis=1)
    if WRITE_OUT1:
        if SHOW_NONFINITE:
            acc1 += mark[:, None]
        tl.store(OUT1 + bh * N * R + rn[:, None] * R + rr[None, :],
                 to_dtype(acc1, OUT1.dtype.element_ty), mask=row_in[:, None] & (rr < R)[None, :])
    if HAS_VN:
        acc2 = acc2 * out2_scale
        if SUM_DE:  # dy's term of the row norm, from the dE tiles summed above
            acc2 += norm_coef * de_sum[:, None] * y
        elif NORM_TERM:  # (dE 1)_i = vn_i . (C V_M)_i
            acc2 += norm_coef * tl.sum(vn * acc1, axis=1)[:, None] * y
        tl.store(OUT2 + bh * N * D + rn[:, None] * D + rd[None, :],
                 to_dtype(acc2, OUT2.dtype.element_ty), mask=row_in[:, None] & (rd < D)[None, :])


@triton.jit
def _cols_kernel(
    Y, X, A, B, VN, VM, EXC, OUT1, OUT2,
    N, M, D, R, BH, rows_per_split,
    s_exc_b, s_exc_n, s_exc_m, norm_scale, dot_scale, b_scale, out2_scale,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_EXC: tl.constexpr,
    WRITE_OUT1: tl.constexpr, HAS_VM: tl.constexpr, ROW_NORM: tl.constexpr,
    X_BF16: tl.constexpr, SHOW_NONFINITE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, FMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    Y_BF16: tl.constexpr = Y.dtype.element_ty == tl.bfloat16  # exact bfloat16 tiles (_mm)
    VN_BF16: tl.constexpr = VN.dtype.element_ty == tl.bfloat16
    split = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rr = tl.arange(0, BLOCK_R)
    col_in = rm < M
    x, b, vm = _column_side(X, B, VM, bh, rm, rd, rr, M, D, R, b_scale, HAS_B, HAS_VM)
    acc1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=x.dtype)
    acc2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=x.dtype)
    marks = 0.0  # SHOW_NONFINITE: 0, or NaN once a marked row is read
    start = split * rows_per_split
    for n0 in range(0, rows_per_split, BLOCK_N):
        rn = start + n0 + tl.arange(0, BLOCK_N)
        row_in = (rn < N) & (rn < start + rows_per_split)
        y = tl.load(Y + bh * N * D + rn[:, None] * D + rd[None, :],
                    mask=row_in[:, None] & (rd < D)[None, :], other=0.0).to(x.dtype)
        e = _mm(x, tl.trans(y), PRECISION, FMA, X_BF16, Y_BF16).to(x.dtype) * dot_scale
        e = e - b[:, None]
        if HAS_A:
            a = tl.load(A + bh * N + rn, mask=row_in, other=float("inf"))
            e = e - a[None, :]
        if ROW_NORM or SHOW_NONFINITE:
            squares = tl.sum(y * y, axis=1)
        if ROW_NORM:
            e = e - (norm_scale * squares)[None, :]
        e = tl.where(row_in[None, :], e, float("-inf"))
        if HAS_EXC:
            exc = tl.load(EXC + bh * s_exc_b + strided_offsets(rm, s_exc_m, rn, s_exc_n),
                          mask=col_in[:, None] & row_in[None, :], other=0)
            e = tl.where(exc != 0, float("-inf"), e)
        ct = tl.exp2(e)  # C^T tile: [BLOCK_M, BLOCK_N]
        vn = tl.load(VN + bh * N * R + rn[:, None] * R + rr[None, :],
                     mask=row_in[:, None] & (rr < R)[None, :], other=0.0).to(x.dtype)
        if SHOW_NONFINITE:  # the slice's marks, added to every entry of C^T V_N
            mark = (squares + tl.sum(vn, axis=1)) * 0.0
            if HAS_A:  # rows a drops carry none
                mark = tl.where(a == float("inf"), 0.0, mark)
            marks += tl.sum(mark, axis=0)
        if WRITE_OUT1:
            acc1 += _mm(ct.to(vn.dtype), vn, PRECISION, FMA, False, VN_BF16)
        if HAS_VM:
            de = _mm(vm, tl.trans(vn), PRECISION, FMA, False, VN_BF16).to(ct.dtype) * ct
            acc2 += _mm(de.to(y.dtype), y, PRECISION, FMA, False, Y_BF16)
    base = split * BH + bh
    if WRITE_OUT1:
        if SHOW_NONFINITE:
            acc1 += marks
        tl.store(OUT1 + base * M * R + rm[:, None] * R + rr[None, :], acc1,
                 mask=col_in[:, None] & (rr < R)[None, :])
    if HAS_VM:
        tl.store(OUT2 + base * M * D + rm[:, None] * D + rd[None, :], acc2 * out2_scale,
                 mask=col_in[:, None] & (rd < D)[None, :])


def _precision(dtype: torch.dtype, rows: torch.dtype | None = None,
               device: torch.device | None = None) -> str:
    """tl.dot's input precision for compute dtype ``dtype`` and N-row inputs ``rows``.

    Float32 from half-precision rows: ``"bf16x3"`` (three bfloat16 products, relative
    error about 2^-16, far below the half type's own 2^-9; half the MMA instructions of
    tf32x3 and, compiled for sm_90, none of its spills, benchmarks/triton_resources.py),
    on GPUs with bfloat16 tensor cores (compute capability 8.0 on), whatever PyTorch's
    float32 matmul precision; under Triton's interpreter ``"bf16x3-interpreted"``
    (``_mm``). Float32 otherwise: three TF32 passes (about float32's accuracy) at
    PyTorch's default matmul precision "highest", one TF32 pass where PyTorch allows
    TF32 (``tf32_allowed``). Float64 is exact (IEEE), and so is everything on GPUs
    before compute capability 8.0 (Turing, Volta), which have neither TF32 nor bfloat16
    tensor cores: Triton compiles those dots to float32 FMAs, so each of tf32x3's three
    passes would be a full float32 product."""
    if dtype != torch.float32:
        return "ieee"
    capability = device_capability(device)
    if capability is not None and capability < (8, 0):
        return "ieee"
    if rows in (torch.bfloat16, torch.float16):
        if interpreter_on():  # whatever the tensors' device: the kernels run on the CPU
            return "bf16x3-interpreted"
        if capability is not None:
            return "bf16x3"
    return "tf32" if tf32_allowed() else "tf32x3"


# The rows kernel's value products (C V_M, V_N V_M^T, dE X) in one bfloat16 pass where
# the rows are half types, instead of bf16x3; off. dE is rounded once and dy's row-norm
# term summed from the rounded numbers, so dy's two terms still cancel exactly. The
# outputs of the rows kernel do not enter the Lemma 3 inverse; the cols kernel's C^T V
# and dZ = C^T g do, and keep bf16x3 (in one pass too, Skyformer's dq was 0.20 off
# float64 for repeated tokens). Under the interpreter, rounding as a GPU does
# (``triton_rounding``), bfloat16 inputs around 4 centres (benchmarks/half_gradients.py
# --rows-one-bf16-pass, results/half_gradients_rows_bf16.md): Skyformer's output and
# gradients 1.7e-3 to 3.0e-3 from float64, up to 1.8x bf16x3's (1.6e-3 to 2.2e-3).
# Compiled for sm_90 at the model shape (Triton 3.6, results/
# triton_resources_triton36_rows_bf16.md): the forward launch 6 MMA instructions instead
# of 10 (20 resident warps per SM instead of 16), the dy launch 10 instead of 16 (16
# instead of 12), the dy-and-dV launch 12 instead of 22 (174 registers instead of 249).
# Not timed on a GPU: gpu_kernels.py times it as "+rows-bf16".
ROWS_ONE_BF16_PASS = False


def rows_value_precision(precision: str) -> str:
    """The rows kernel's precision for its value products, given ``_precision``'s for the
    call: one bfloat16 pass in place of bf16x3 under ``ROWS_ONE_BF16_PASS``."""
    if ROWS_ONE_BF16_PASS and precision in ("bf16x3", "bf16x3-interpreted"):
        return precision.replace("bf16x3", "bf16")
    return precision


def tf32_allowed() -> bool:
    """Whether PyTorch allows TF32 for float32 matmuls on CUDA: its per-backend setting
    ``torch.backends.cuda.matmul.fp32_precision`` is "tf32" (which it inherits from
    ``torch.backends.fp32_precision``, and which ``torch.set_float32_matmul_precision``
    and ``allow_tf32`` write too; "none" means never set: IEEE). Only a torch without
    that setting is asked ``torch.get_float32_matmul_precision()``, which raises once a
    program has set any backend's newer API (torch 2.13: "mix of the legacy and new
    APIs"), and every Triton call raised with it."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting is not None:
        return setting == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def device_capability(device: torch.device | None) -> tuple[int, int] | None:
    """The compute capability the kernels are compiled for on ``device``: a CUDA
    device's, None for any other and under Triton's interpreter (which runs every
    kernel on the CPU)."""
    if device is None or device.type != "cuda" or interpreter_on():
        return None
    return _capability(device.index if device.index is not None else
                       torch.cuda.current_device())


def dot_family(capability: tuple[int, int] | None) -> str:
    """How Triton compiles the kernels' dots on a GPU of ``capability``, which decides
    the tiles that fit its registers: ``"default"`` (the tiles chosen on sm_90, whose
    dots are ``wgmma``; sm_100's ``tcgen05`` code spills nothing with them at the model
    shape either; None too), ``"mma_sync"`` (Ampere and Ada, 8.x, and consumer
    Blackwell, 12.x: RTX 50xx, GB10, which has neither), ``"fma"`` (before 8.0: Volta,
    Turing, where Triton 3.9 emits no MMA instruction, float16 included). Compiled for
    sm_80, sm_120 and sm_75, sm_90's tiles spilled (docs/gpu-record.md, "Tiles and precision
    before Hopper")."""
    if capability is None:
        return "default"
    if capability < (8, 0):
        return "fma"
    return "mma_sync" if capability < (9, 0) or capability[0] == 12 else "default"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _exclude_args(exclude: Tensor | None, like: Tensor) -> tuple[Tensor, int, int, int]:
    if exclude is None:
        return like, 0, 0, 0
    return (exclude.view(torch.uint8), *exclude.stride())


# Tiles: (BLOCK_N, BLOCK_M, num_warps, stages); one pipeline stage (the loop's loads are
# small and come from L2; software pipelining doubled or tripled the shared memory, which
# held a program to one per SM). First chosen from the registers, spills and shared
# memory of the compiled kernels (benchmarks/triton_resources.py, sm_90): with these no
# kernel spills at head dim 64 with half inputs (bf16x3), and at D = 32 in float32 one
# kernel spills 32 bytes a thread, where 64 x 64 tiles with three stages spilled 536-632
# bytes (half inputs, D = 64) and 144-160 (float32, D = 32) in the backward kernels.
# Then timed (benchmarks/product_tiles.py, H200, B=4, H=16, N=16384, D=64, bfloat16,
# Skyformer forward + backward): the cols kernel's 64 columns a program, up to head dim
# 64 with half-type rows (was 32), took the call from 7.69 to 7.18 ms; no other candidate
# of either kernel was faster by more than the noise (the rows kernel's 64-column steps:
# 7.63 ms against 7.66, and they spill 23-32 bytes in backward), 8 warps and 32-row
# tiles were slower. Float32 rows (tf32x3 dots) keep 32 columns at head dim 64: with 64
# the cols kernel spills 480 bytes a thread there (not timed).
STAGES = 1


# Tiles by dot_family where sm_90's spill. "mma_sync" (compiled for sm_80 and sm_120,
# Triton 3.9): sm_90's tiles spilled 184-256 bytes a thread in the rows kernel's backward
# launches (half rows, D = 64), 56-144 in the cols kernel's, 816-984 in the float32 cols
# backward launch at D = 32; with 32 x 32 none spills and as many or more warps fit an
# SM. "fma" (sm_75): 32 x 32 tiles still spilled 216-400 bytes in float16; 16 x 16 with
# eight warps none (64-128 registers, 16-24 warps an SM). Not timed: no such GPU ran them.
FAMILY_TILES = {"mma_sync": (32, 32, 4, STAGES), "fma": (16, 16, 8, STAGES)}

# Head dims above 64, where sm_90's and mma_sync's tiles spilled in the backward launches
# (compiled with Triton 3.9, m = 128; benchmarks/triton_resources.py). At a padded
# width of 128 (sm_90 and sm_80): half rows 136-152 bytes a thread in the rows kernel's
# two gradient launches (sm_80: 96-128), float32 rows 656-744 there and 96-464 in the
# cols kernel's gradient launches; with the tiles below, eight warps spreading the
# [BLOCK_N, BLOCK_D] accumulators over twice the threads, no launch of either kernel
# spills on either target and as many warps fit an SM (the cols kernel with half rows
# spilled nothing and keeps its tiles). At 256 (sm_90): half rows spilled 1256-1288
# bytes in the rows kernel's gradient launches and 224 in one cols launch; with these,
# at most 8. Float32 rows at 256 still spill 112-392 bytes (16 rows is the least a dot
# takes). Not timed: docs/gpu-record.md, "Tiles for head dims above 64".
WIDE_TILES = {  # (kernel, padded width, half rows) -> tiles; absent: the narrow choice
    ("rows", 128, True): (32, 32, 8, STAGES), ("rows", 128, False): (16, 32, 8, STAGES),
    ("cols", 128, False): (16, 16, 8, STAGES),
    ("rows", 256, True): (16, 16, 8, STAGES), ("rows", 256, False): (16, 32, 8, STAGES),
    ("cols", 256, True): (32, 32, 8, STAGES), ("cols", 256, False): (16, 16, 8, STAGES),
}


def _wide_tiles(kernel: str, bd: int, br: int, half_rows: bool,
                family: str) -> tuple[int, int, int, int] | None:
    """``WIDE_TILES``' choice where the padded head dim or value width is above 64 on a
    GPU whose dots use MMA instructions (the ``fma`` family's 16 x 16 tiles with eight
    warps fit already); widths above 256 take 256's. None: the narrow choice."""
    width = max(bd, br)
    if width <= 64 or family == "fma":
        return None
    return WIDE_TILES.get((kernel, 128 if width <= 128 else 256, half_rows))


def _row_tiles(bd: int, br: int, dtype: torch.dtype, half_rows: bool = False,
               capability: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """The rows kernel: (BLOCK_N rows a program, BLOCK_M columns a loop step, warps,
    pipeline stages) on a GPU of ``capability`` (None: sm_90's tiles); ``half_rows``: y
    is a half type (bf16x3 dots)."""
    if dtype == torch.float64:  # broadcast sums of [BLOCK_N, BLOCK_M, BLOCK_D] values
        return 16, 16, 4, STAGES
    family = dot_family(capability)
    if (tiles := _wide_tiles("rows", bd, br, half_rows, family)) is not None:
        return tiles
    if family in FAMILY_TILES:
        return FAMILY_TILES[family]
    return (64 if max(bd, br) <= 64 else 32), 32, 4, STAGES


def _col_tiles(bd: int, br: int, dtype: torch.dtype, half_rows: bool = False,
               capability: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """The cols kernel: (BLOCK_N rows a loop step, BLOCK_M columns a program, warps,
    pipeline stages); ``half_rows``: y and V_N are half types (bf16x3 dots);
    ``capability`` as ``_row_tiles``."""
    if dtype == torch.float64:
        return 16, 16, 4, STAGES
    family = dot_family(capability)
    if (tiles := _wide_tiles("cols", bd, br, half_rows, family)) is not None:
        return tiles
    if family in FAMILY_TILES:
        return FAMILY_TILES[family]
    wide = max(bd, br)
    columns = 64 if wide <= (64 if half_rows else 32) else 32
    return (64 if wide <= 64 else 32), columns, 4, STAGES


# CUDA's limit on a launch grid's second and third dimensions: the kernels put the
# matrix index (batch x head) on the second, so a call with more matrices is launched
# in slices of at most this many (the first dimension's limit is 2^31 - 1).
MAX_GRID_YZ = 65535


def _in_slices_of_matrices(product):
    """``product(*tensors, **options)`` over slices of at most ``MAX_GRID_YZ`` matrices
    along dim 0 of its tensor arguments (each ``[BH, ...]`` or None), outputs joined."""

    @functools.wraps(product)
    def run(*tensors, **options):
        bh = tensors[0].shape[0]
        if bh <= MAX_GRID_YZ:
            return product(*tensors, **options)
        parts = [product(*(None if t is None else t[start:start + MAX_GRID_YZ]
                           for t in tensors), **options)
                 for start in range(0, bh, MAX_GRID_YZ)]
        return tuple(None if outs[0] is None else torch.cat(outs)
                     for outs in zip(*parts, strict=True))

    return run


@_in_slices_of_matrices
def rows_product(
    y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vm: Tensor,
    vn: Tensor | None, exclude: Tensor | None, *,
    write_out1: bool = True, out1_dtype: torch.dtype | None = None,
    shift_rows: bool = False, out2_scale: float = 1.0, norm_coef: float | None = None,
    norm_scale: float | None = None, dot_scale: float = 1.0, b_scale: float = 1.0,
    x_bf16: bool = False, show_nonfinite: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(C V_M, ((V_N V_M^T) * C) X, row shifts); see the module docstring.

    y ``[BH, N, D]``, x ``[BH, m, D]``, a ``[BH, N]``, b ``[BH, m]`` (log2 units),
    vm ``[BH, m, R]``, vn ``[BH, N, R]``, exclude ``[BH, N, m]`` bool (any strides).
    ``dot_scale`` and ``b_scale`` are f and g of the module docstring; ``x_bf16``: x
    holds bfloat16 numbers (in its float dtype), so bf16x3 leaves out its zero lo part.
    The second output is scaled by ``out2_scale`` and, with ``norm_coef``, gets
    ``norm_coef (dE 1)_i y_i`` added (dy of the row norm, summed in the kernel's
    precision). With ``norm_scale``, each row's offset also gets ``norm_scale |y_i|^2``,
    summed in the compute dtype from the tile the kernel reads anyway (no pass over y
    before the launch). y and vn may be half types (read into x's dtype, the compute
    dtype); the second output comes in y's dtype, the first in ``out1_dtype`` (default
    y's), which the caller names: C Z in y's dtype, dV = C g in V's (V_N's dtype, also
    where vn is not passed because dy is not asked for), stored once from the sums.
    ``show_nonfinite``: row i of the first output is NaN where y_i holds a NaN or inf
    (module docstring).
    """
    bh, n, d = y.shape
    m, r = x.shape[1], vm.shape[-1]
    bd, br = tile_width(d), tile_width(r)
    bn, bm, warps, stages = _row_tiles(bd, br, x.dtype, y.dtype in (torch.bfloat16,
                                                                     torch.float16),
                                       device_capability(y.device))
    out1 = y.new_empty(bh, n, r, dtype=y.dtype if out1_dtype is None else out1_dtype) \
        if write_out1 else None
    out2 = y.new_empty(bh, n, d, dtype=y.dtype) if vn is not None else None
    shift = x.new_empty(bh, n) if shift_rows else None
    exc, se_b, se_n, se_m = _exclude_args(exclude, y)
    dummy = y
    grid = (cdiv(n, bn), bh)
    precision = _precision(x.dtype, y.dtype, y.device)
    launch_within_limits(_rows_kernel, grid, (
        y, x, dummy if a is None else a, dummy if b is None else b, vm,
        dummy if vn is None else vn, exc,
        dummy if out1 is None else out1, dummy if out2 is None else out2,
        dummy if shift is None else shift,
        n, m, d, r, se_b, se_n, se_m, float(out2_scale),
        0.0 if norm_coef is None else float(norm_coef),
        0.0 if norm_scale is None else float(norm_scale), float(dot_scale), float(b_scale),
    ), {
        "HAS_A": a is not None, "HAS_B": b is not None, "HAS_EXC": exclude is not None,
        "WRITE_OUT1": write_out1, "HAS_VN": vn is not None, "SHIFT_ROWS": shift_rows,
        "NORM_TERM": vn is not None and norm_coef is not None,
        "ROW_NORM": norm_scale is not None, "X_BF16": x_bf16,
        "SHOW_NONFINITE": show_nonfinite, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_D": bd,
        "BLOCK_R": br, "PRECISION": precision, "FMA": x.dtype == torch.float64,
        "VALUE_PRECISION": rows_value_precision(precision), "num_warps": warps,
        "num_stages": stages,
    }, "rows product")
    return out1, out2, shift


# Programs per multiprocessor the cols kernel's row slices aim at. Its launches keep two
# or three programs resident per SM (8-12 warps), so the last wave of a grid sized for
# four left many SMs idle: on an H200 (Skyformer, B=4, H=16, D=64, bfloat16, m = 128,
# N = 32768, forward + backward) its three launches took 2.07 ms at 4 per SM, 1.85 at 8,
# 1.89 at 16 and 1.86 at 32 (the partial sums' addition growing with the slices), and
# 0.29 / 0.27 ms at N = 4096 (benchmarks/results/gpu_h200_2026-12-04b/col_slices.txt).
COLS_PROGRAMS_PER_SM = 8


def _splits(n: int, blocks: int, block_n: int, device: torch.device,
            per_sm: int = COLS_PROGRAMS_PER_SM) -> int:
    """Row slices for the cols kernel: about ``per_sm`` programs per multiprocessor."""
    if device.type != "cuda":
        return min(2, cdiv(n, block_n))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return slices_for(n, blocks, block_n, sms, per_sm)


def slices_for(n: int, blocks: int, block_n: int, sms: int, per_sm: int) -> int:
    """Row slices of ``n`` rows (blocks of ``block_n``) for ``blocks`` programs a slice,
    about ``per_sm`` programs on each of ``sms`` multiprocessors: at least one, at most
    one a row block."""
    return max(1, min(cdiv(n, block_n), cdiv(per_sm * sms, max(1, blocks))))


def row_slices(n: int, blocks: int, block_n: int, device: torch.device,
               per_sm: int = COLS_PROGRAMS_PER_SM) -> tuple[int, int]:
    """(slices, rows a slice) of N rows for ``blocks`` programs a slice (``_splits``),
    each slice a whole number of ``block_n`` blocks."""
    rows_per_split = cdiv(cdiv(n, _splits(n, blocks, block_n, device, per_sm)),
                          block_n) * block_n
    return cdiv(n, rows_per_split), rows_per_split


@_in_slices_of_matrices
def cols_product(
    y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vn: Tensor,
    vm: Tensor | None, exclude: Tensor | None, *, write_out1: bool = True,
    norm_scale: float | None = None, dot_scale: float = 1.0, b_scale: float = 1.0,
    out2_scale: float = 1.0, x_bf16: bool = False, show_nonfinite: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """(C^T V_N, ``out2_scale`` ((V_N V_M^T) * C)^T Y); shapes, ``norm_scale``,
    ``dot_scale``, ``b_scale`` and ``x_bf16`` as ``rows_product`` (y and vn may be half types; the
    outputs, m rows, are in x's dtype). ``show_nonfinite``: the whole first output is
    NaN where a row of y or vn that a does not drop holds a NaN or inf."""
    bh, n, d = y.shape
    m, r = x.shape[1], vn.shape[-1]
    bd, br = tile_width(d), tile_width(r)
    bn, bm, warps, stages = _col_tiles(bd, br, x.dtype, y.dtype in (torch.bfloat16,
                                                                     torch.float16),
                                       device_capability(y.device))
    col_blocks = cdiv(m, bm)
    splits, rows_per_split = row_slices(n, col_blocks * bh, bn, y.device)
    out1 = x.new_empty(splits, bh, m, r) if write_out1 else None
    out2 = x.new_empty(splits, bh, m, d) if vm is not None else None
    exc, se_b, se_n, se_m = _exclude_args(exclude, y)
    dummy = y
    launch_within_limits(_cols_kernel, (col_blocks, bh, splits), (
        y, x, dummy if a is None else a, dummy if b is None else b, vn,
        dummy if vm is None else vm, exc,
        dummy if out1 is None else out1, dummy if out2 is None else out2,
        n, m, d, r, bh, rows_per_split, se_b, se_n, se_m,
        0.0 if norm_scale is None else float(norm_scale), float(dot_scale), float(b_scale),
        float(out2_scale),
    ), {
        "HAS_A": a is not None, "HAS_B": b is not None, "HAS_EXC": exclude is not None,
        "WRITE_OUT1": write_out1, "HAS_VM": vm is not None,
        "ROW_NORM": norm_scale is not None, "X_BF16": x_bf16,
        "SHOW_NONFINITE": show_nonfinite, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_D": bd,
        "BLOCK_R": br, "PRECISION": _precision(x.dtype, y.dtype, y.device),
        "FMA": x.dtype == torch.float64, "num_warps": warps, "num_stages": stages,
    }, "cols product")
    return (None if out1 is None else out1.sum(0)), (None if out2 is None else out2.sum(0))
