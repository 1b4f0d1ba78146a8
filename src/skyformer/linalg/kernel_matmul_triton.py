"""The Triton path of ``gaussian_kernel_matmul``: forward and backward, C never formed.

Same algebra as ``kernel_matmul`` (see its docstring), on the two kernels of
``triton_kernels``. With dE = dC * C, the pairs of value matrices are:

    out = C Z:    forward rows(V_M = Z);  backward rows(V_N = g, V_M = Z) -> dE x,
                  cols(V_N = g, V_M = Z) -> (dZ = C^T g, dE^T y)
    out = C^T V:  forward cols(V_N = V);  backward rows(V_N = V, V_M = g) -> (dV = C g,
                  dE x), cols(V_N = V, V_M = g) -> dE^T y

and the row sums of dE need no extra pass: the rows kernel sums the dE tiles it forms
for dy, in the compute dtype, to finish dy in place ((dE 1)_i = V_N,i . (C V_M)_i, the
identity of ``kernel_matmul``, would cost the product C V_M where dV is not asked
for). y and the N-row values may be half types (``triton_kernels``).
The kernels are called as the custom operators of ``triton_ops``, so that
``torch.compile`` traces everything around them and CUDA graphs capture them. Under
``kernel="auto"`` the operators compute a kernel's results by PyTorch operations where
it cannot compile or launch (``PRODUCT_FALLBACK``), forward and backward, compiled too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .functional_ops import first_order_backward
from .kernel_backend import KernelFallback
from .kernel_offsets import LOG2E, offset_and_value_gradients, row_offsets
from .launch_grid import tile_width
from .ones_column import with_ones_column
from .vmap import vmap_into_batch

# "auto"'s safety net: product kernels that cannot compile or launch here (an old GPU, no
# C compiler, too few registers) give way to PyTorch operations, with one warning: the
# operators' own (``product_fallback``), then ``gaussian_kernel_matmul``'s PyTorch path,
# for the device and dtype of the rows y that the kernels read (half-type rows compile
# kernels of their own).
PRODUCT_FALLBACK = KernelFallback(
    "Gaussian block product kernels",
    "computing the products with PyTorch operations (the same values up to rounding)")
# The backward pass's rows and cols kernels as one pass over the rows where every column
# fits one tile (``triton_one_pass``, ``one_pass_applies``): off, since on an H100 it was
# slower in GPU time at every shape but the smallest (docs/gpu-record.md). Where it fails to
# compile or launch, the two kernels run instead, with a warning.
ONE_PASS_BACKWARD = False
ONE_PASS_FALLBACK = KernelFallback(
    "one-pass backward kernel of the Gaussian block products",
    "running the rows and cols kernels instead (the same values up to rounding)")


def one_pass_applies(m: int, d: int, r: int) -> bool:
    """Whether one pass covers a product with ``m`` columns, head dim ``d`` and ``r``
    value columns: every column in one tile (the columns' sums, [m, D] and [m, R], are
    held by each program) and the rows' tiles at most 64 wide. Compiled for sm_90 the
    kernel spills nothing at m <= 128 and D, R <= 64
    (``benchmarks/triton_resources.py --one-pass-backward``); ``nystrom_softmax``'s 65
    value columns (a 128-wide tile) spilled or took about 170 KiB of shared memory."""
    return m <= 128 and max(tile_width(d), tile_width(r)) <= 64


def _ops():
    from . import triton_ops  # imports Triton: only when this path is taken

    return triton_ops


def _none_to_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """The operators' stand-in for an absent output (an operator returns no None):
    empty and one-dimensional, which no present tensor is (they have a batch and a row
    dim, and may be empty: m = 0). Absent inputs are passed as None."""
    return like.new_empty(0) if t is None else t


def is_absent(t: Tensor) -> bool:
    """Whether ``t`` is ``_none_to_empty``'s stand-in for an absent tensor."""
    return t.dim() == 1 and t.shape[0] == 0


def _empty_to_none(t: Tensor) -> Tensor | None:
    return None if is_absent(t) else t


def _rows(y, kx, a, b, vm, vn, exclude, norm_scale, *, auto, out1_dtype, write_out1=True,
          shift_rows=False, out2_scale=1.0, norm_coef=None, show_nonfinite=False):
    """``triton_ops.rows_product`` with ``None`` for absent tensors, x (``_KernelX``)
    and b as the method holds them, C V_M in ``out1_dtype``; ``auto``:
    ``PRODUCT_FALLBACK`` where it fails."""
    out = _ops().rows_product(y, kx.x, a, b, vm, vn, exclude, write_out1, out1_dtype,
                              shift_rows, out2_scale, norm_coef, norm_scale,
                              kx.dot_scale * LOG2E, LOG2E, kx.bf16, show_nonfinite, auto)
    return tuple(_empty_to_none(t) for t in out)


def _one_pass(y, kx, a, b, vn, vm, exclude, norm_scale, *, auto, write_row1, write_row2,
              write_col1, write_col2, row2_scale, norm_coef, col2_scale):
    """``triton_ops.one_pass_product`` with ``None`` for absent tensors: the outputs of
    ``_rows`` (C V_M, dE x) and ``_cols`` (C^T V_N, dE^T y) in one pass."""
    out = _ops().one_pass_product(y, kx.x, a, b, vn, vm, exclude, write_row1, write_row2,
                                  write_col1, write_col2, row2_scale, norm_coef, norm_scale,
                                  kx.dot_scale * LOG2E, LOG2E, col2_scale, kx.bf16, auto)
    return tuple(_empty_to_none(t) for t in out)


def _cols(y, kx, a, b, vn, vm, exclude, norm_scale, scale, *, auto, write_out1=True,
          show_nonfinite=False):
    """``triton_ops.cols_product`` with ``None`` for absent tensors, x (``_KernelX``)
    and b as the method holds them; the second output is dx, ((V_N V_M^T) * C)^T y
    times s (``scale``); ``auto``: ``PRODUCT_FALLBACK`` where it fails."""
    out = _ops().cols_product(y, kx.x, a, b, vn, vm, exclude, write_out1, norm_scale,
                              kx.dot_scale * LOG2E, LOG2E, scale, kx.bf16, show_nonfinite,
                              auto)
    return tuple(_empty_to_none(t) for t in out)


class _KernelX(NamedTuple):
    """The landmark rows as the kernels read them: x itself (``dot_scale`` = s), or
    x / c given exactly as bfloat16 numbers (``dot_scale`` = s c, ``bf16``: the
    bf16x3 products leave out their zero lo part; the method's x is c times them, up
    to x's rounding)."""

    x: Tensor
    dot_scale: float
    bf16: bool


def _kernel_x(x: Tensor, x_bf16: Tensor | None, x_factor: float, scale: float) -> _KernelX:
    if x_bf16 is None:
        return _KernelX(x.contiguous(), scale, False)
    return _KernelX(x_bf16.contiguous(), scale * x_factor, True)


def _norm_scale(scale: float, row_norm: bool) -> float | None:
    """The factor of |y_i|^2 in row i's offset, in log2 units (s^2 / 2 log2(e)), or None
    (``row_norm`` False)."""
    return 0.5 * scale * scale * LOG2E if row_norm else None


class TritonGaussianBlockProduct(torch.autograd.Function):
    """out = C @ rhs or C^T @ rhs (``ones_column``: with [rhs, 1]); tensors as
    ``kernel_matmul._GaussianBlockProduct``, and ``x_bf16`` (or None), x / ``x_factor``
    as bfloat16 numbers in x's dtype, which the kernels then read instead of x
    (``_KernelX``; not differentiated: x is); ``auto``: kernels that fail, forward or
    backward, give way to PyTorch operations (``PRODUCT_FALLBACK``);
    ``show_nonfinite``: the forward kernels mark non-finite rows in ``out``
    (``triton_kernels``), not differentiated (C^T V's backward reads its marked
    output)."""

    @staticmethod
    def forward(y: Tensor, x: Tensor, b: Tensor | None, rhs: Tensor,  # type: ignore[override]
                row_valid: Tensor | None, scale: float, row_norm: bool, transpose: bool,
                shift_rows: bool, exclude: Tensor | None, x_bf16: Tensor | None,
                x_factor: float, ones_column: bool, auto: bool,
                show_nonfinite: bool) -> tuple[Tensor, Tensor]:
        y, rhs = y.contiguous(), with_ones_column(rhs, ones_column).contiguous()
        kx = _kernel_x(x, x_bf16, x_factor, scale)
        b = None if b is None else b.contiguous()
        # the row norms s^2 |y_i|^2 / 2 are summed by the kernels (_norm_scale); a holds
        # the invalid rows' +inf (or nothing)
        a = row_offsets(y, scale, False, row_valid, dtype=x.dtype)
        a = None if a is None else a.contiguous()
        norm_scale = _norm_scale(scale, row_norm)
        if transpose:
            out, _ = _cols(y, kx, a, b, rhs, None, exclude, norm_scale, scale, auto=auto,
                           show_nonfinite=show_nonfinite)
        else:
            out, _, shift = _rows(y, kx, a, b, rhs, None, exclude, norm_scale, auto=auto,
                                  out1_dtype=y.dtype, shift_rows=shift_rows,
                                  show_nonfinite=show_nonfinite)
            if shift is not None:
                a = shift if a is None else a + shift
        return out, (x.new_empty(0) if a is None else a)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        y, x, b, rhs, _, scale, row_norm, transpose, _, exclude, x_bf16, x_factor, \
            ones_column, auto, *_ = inputs
        out, a = output
        ctx.mark_non_differentiable(a)
        ctx.set_materialize_grads(False)  # no zero tensor for the offsets' gradient
        # C Z's backward needs no copy of its [N, R] output (the rows kernel forms dE 1
        # itself); C^T V's [m, R] output gives the column offsets' gradient
        ctx.save_for_backward(y, x, b, rhs, a, out if transpose else None, exclude, x_bf16)
        ctx.options = (scale, row_norm, transpose, x_factor, ones_column, auto)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(TritonGaussianBlockProduct.apply, info, in_dims, args,
                               tensors=(0, 1, 2, 3, 4, 9, 10), outputs=2)

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple[Tensor | None, ...]:
        if grad is None:  # the output reached no loss (grads are not materialised)
            return (None,) * 15
        return (*block_product_backward(ctx.saved_tensors, ctx.options,
                                        ctx.needs_input_grad[:4], grad),) + (None,) * 11


def block_product_backward(saved: tuple, options: tuple, needs: tuple, grad: Tensor
                           ) -> tuple[Tensor | None, Tensor | None, Tensor | None,
                                      Tensor | None]:
    """(dy, dx, db, drhs) of ``TritonGaussianBlockProduct`` for the gradient ``grad`` of
    its output: ``saved`` and ``options`` as its ``setup_context`` keeps them,
    ``needs`` whether each of y, x, b and rhs needs its gradient (None where not).
    Also the backward step of a caller that chains the products itself
    (``ops/skyformer/two_nodes.py``)."""
    y, x, b, rhs, a, out, exclude, x_bf16 = saved
    a = None if is_absent(a) else a.contiguous()
    scale, row_norm, transpose, x_factor, ones_column, auto = options
    need_y, need_x, need_b, need_rhs = needs
    y, grad = y.contiguous(), grad.contiguous()
    rhs = with_ones_column(rhs, ones_column).contiguous()
    kx = _kernel_x(x, x_bf16, x_factor, scale)
    b = None if b is None else b.contiguous()
    vn, vm = (rhs, grad) if transpose else (grad, rhs)
    # the rows of C g (transpose: dV) and dE x; the columns of C^T g (dZ) and dE^T y
    rows_first = transpose and (need_rhs or (need_y and row_norm))
    cols_first = not transpose and (need_rhs or need_b)
    row_norm_coef = -scale * scale if row_norm else None
    gradients = (grad, out, rhs, transpose, need_b, need_rhs, ones_column)
    if ONE_PASS_BACKWARD and (need_y or rows_first) and (need_x or cols_first) \
            and one_pass_applies(x.shape[-2], y.shape[-1], rhs.shape[-1]):
        c_vm, dy, c_vn, dx = _one_pass(
            y, kx, a, b, vn, vm, exclude, _norm_scale(scale, row_norm), auto=auto,
            write_row1=rows_first, write_row2=need_y, write_col1=cols_first,
            write_col2=need_x, row2_scale=kx.dot_scale, norm_coef=row_norm_coef,
            col2_scale=scale)
        return _gradients(*gradients, c_vm, dy, c_vn, dx)
    c_vm, dy = None, None
    if need_y or rows_first:
        # dy = s dE x (x = c x_bf16 when the kernels read x_bf16); the row norm adds
        # -s^2 (dE 1)_i y_i, summed in the kernel (no rounded copy of dE 1). C V_M
        # (dV = C g) in V_N's dtype, V's, whether or not V_N is read for dy
        c_vm, dy, _ = _rows(y, kx, a, b, vm, vn if need_y else None, exclude,
                            _norm_scale(scale, row_norm), auto=auto, out1_dtype=vn.dtype,
                            write_out1=rows_first, out2_scale=kx.dot_scale,
                            norm_coef=row_norm_coef)
    c_vn, dx = None, None
    if need_x or cols_first:
        c_vn, dx = _cols(y, kx, a, b, vn, vm if need_x else None, exclude,
                         _norm_scale(scale, row_norm), scale, auto=auto,
                         write_out1=cols_first)
    return _gradients(*gradients, c_vm, dy, c_vn, dx)


def _gradients(grad: Tensor, out: Tensor | None, rhs: Tensor, transpose: bool, need_b: bool,
               need_rhs: bool, ones_column: bool, c_vm: Tensor | None, dy: Tensor | None,
               c_vn: Tensor | None, dx: Tensor | None
               ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``block_product_backward``'s gradients from the kernels' outputs."""
    db, drhs = offset_and_value_gradients(  # dV = C g, or dZ = C^T g
        grad, out, rhs, c_vm if transpose else c_vn, transpose=transpose, need_b=need_b,
        need_rhs=need_rhs, ones_column=ones_column)
    return dy, dx, db, drhs
