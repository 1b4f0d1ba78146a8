"""The Triton kernels as PyTorch custom operators (``torch.library.custom_op``; called
directly in plain eager code, ``eager_calls``).

As operators they are opaque to ``torch.compile``: the graph around them (landmark
draws, the m x m core, norms) is traced and fused by Inductor, the kernels are called
as they are, and CUDA graphs (``mode="reduce-overhead"``) capture them. Gradients come
from ``kernel_matmul_triton.TritonGaussianBlockProduct``, which calls these operators
in its backward pass. Absent input tensors are passed as None (``Tensor?``), absent
outputs come back as empty tensors (an operator returns no None).
Under ``kernel="auto"`` (``auto``) the product operators compute a kernel's results by
PyTorch operations where it cannot compile or launch (``product_fallback``,
``PRODUCT_FALLBACK``), and the Lemma 3 backward operator its PyTorch path's gradients
(``CORE_FALLBACK``): inside the operators, so that compiled graphs (compiled autograd's
backward graphs too) keep the fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import product_fallback, triton_kernels
from .eager_calls import custom_op
from .kernel_backend import launch_device
from .kernel_matmul_triton import ONE_PASS_FALLBACK, PRODUCT_FALLBACK
from .kernel_matmul_triton import _none_to_empty as _or_empty  # fresh: outputs never alias
from .lemma3_triton import CORE_FALLBACK, lemma3_gradients_by_pytorch


@custom_op("skyformer::gaussian_rows_product")
def rows_product(y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vm: Tensor,
                 vn: Tensor | None, exclude: Tensor | None, write_out1: bool,
                 out1_dtype: torch.dtype, shift_rows: bool, out2_scale: float,
                 norm_coef: float | None, norm_scale: float | None, dot_scale: float,
                 b_scale: float, x_bf16: bool, show_nonfinite: bool, auto: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``triton_kernels.rows_product``, C V_M in ``out1_dtype`` (named by the caller: vn
    is None where dy is not asked for, and dV = C g is in V's dtype all the same);
    absent outputs are empty tensors; ``auto``: by PyTorch operations where the kernel
    fails (``PRODUCT_FALLBACK``)."""
    args = (y, x, a, b, vm, vn, exclude)
    options = {"write_out1": write_out1, "out1_dtype": out1_dtype, "shift_rows": shift_rows,
               "out2_scale": out2_scale, "norm_coef": norm_coef, "norm_scale": norm_scale,
               "dot_scale": dot_scale, "b_scale": b_scale, "x_bf16": x_bf16,
               "show_nonfinite": show_nonfinite}
    out1, out2, shift = PRODUCT_FALLBACK.run(
        auto, lambda: triton_kernels.rows_product(*args, **options),
        lambda: product_fallback.rows_product(*args, **options), on=y)
    return (_or_empty(out1, y), _or_empty(out2, y), _or_empty(shift, x))


@rows_product.register_fake
def _(y, x, a, b, vm, vn, exclude, write_out1, out1_dtype, shift_rows, out2_scale,
      norm_coef, norm_scale, dot_scale, b_scale, x_bf16, show_nonfinite, auto):
    bh, n, d = y.shape
    return (y.new_empty(bh, n, vm.shape[-1], dtype=out1_dtype) if write_out1
            else y.new_empty(0),
            y.new_empty(bh, n, d) if vn is not None else y.new_empty(0),
            x.new_empty(bh, n) if shift_rows else x.new_empty(0))


@custom_op("skyformer::gaussian_cols_product")
def cols_product(y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vn: Tensor,
                 vm: Tensor | None, exclude: Tensor | None, write_out1: bool,
                 norm_scale: float | None, dot_scale: float, b_scale: float,
                 out2_scale: float, x_bf16: bool, show_nonfinite: bool, auto: bool
                 ) -> tuple[Tensor, Tensor]:
    """``triton_kernels.cols_product``; absent outputs are empty tensors; ``auto``: by
    PyTorch operations where the kernel fails (``PRODUCT_FALLBACK``)."""
    args = (y, x, a, b, vn, vm, exclude)
    options = {"write_out1": write_out1, "norm_scale": norm_scale, "dot_scale": dot_scale,
               "b_scale": b_scale, "out2_scale": out2_scale, "x_bf16": x_bf16,
               "show_nonfinite": show_nonfinite}
    out1, out2 = PRODUCT_FALLBACK.run(
        auto, lambda: triton_kernels.cols_product(*args, **options),
        lambda: product_fallback.cols_product(*args, **options), on=y)
    return (_or_empty(out1, x), _or_empty(out2, x))


@cols_product.register_fake
def _(y, x, a, b, vn, vm, exclude, write_out1, norm_scale, dot_scale, b_scale,
      out2_scale, x_bf16, show_nonfinite, auto):
    bh, _, d = y.shape
    m = x.shape[1]
    return (x.new_empty(bh, m, vn.shape[-1]) if write_out1 else x.new_empty(0),
            x.new_empty(bh, m, d) if vm is not None else x.new_empty(0))


@custom_op("skyformer::gaussian_one_pass_product")
def one_pass_product(y: Tensor, x: Tensor, a: Tensor | None, b: Tensor | None, vn: Tensor,
                     vm: Tensor, exclude: Tensor | None, write_row1: bool, write_row2: bool,
                     write_col1: bool, write_col2: bool, row2_scale: float, norm_coef: float | None,
                     norm_scale: float | None, dot_scale: float, b_scale: float,
                     col2_scale: float, x_bf16: bool, auto: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``triton_one_pass.one_pass_product``; absent outputs are empty tensors. Where it
    fails to compile or launch, the rows and cols operators instead, with one warning
    (``ONE_PASS_FALLBACK``; they then take ``auto``'s own fallback)."""
    from . import triton_one_pass

    def one_pass() -> tuple[Tensor, ...]:
        outs = triton_one_pass.one_pass_product(
            y, x, a, b, vn, vm, exclude, write_row1=write_row1,
            write_row2=write_row2, write_col1=write_col1, write_col2=write_col2,
            row2_scale=row2_scale, norm_coef=norm_coef, norm_scale=norm_scale,
            dot_scale=dot_scale, b_scale=b_scale, col2_scale=col2_scale, x_bf16=x_bf16)
        return tuple(_or_empty(t, like) for t, like in zip(outs, (y, y, x, x), strict=True))

    def two_kernels() -> tuple[Tensor, ...]:
        row1, row2, _ = rows_product(y, x, a, b, vm, vn if write_row2 else None,
                                     exclude, write_row1, vn.dtype, False, row2_scale,
                                     norm_coef, norm_scale, dot_scale, b_scale, x_bf16,
                                     False, auto)
        col1, col2 = cols_product(y, x, a, b, vn, vm if write_col2 else None,
                                  exclude, write_col1, norm_scale, dot_scale, b_scale,
                                  col2_scale, x_bf16, False, auto)
        return row1, row2, col1, col2  # C V_M in V_N's dtype (vn.dtype), as one pass

    return ONE_PASS_FALLBACK.run(True, one_pass, two_kernels, on=y)


@one_pass_product.register_fake
def _(y, x, a, b, vn, vm, exclude, write_row1, write_row2, write_col1, write_col2,
      row2_scale, norm_coef, norm_scale, dot_scale, b_scale, col2_scale, x_bf16, auto):
    bh, n, d = y.shape
    m, r = x.shape[1], vm.shape[-1]
    return (y.new_empty(bh, n, r, dtype=vn.dtype) if write_row1 else y.new_empty(0),
            y.new_empty(bh, n, d) if write_row2 else y.new_empty(0),
            x.new_empty(bh, m, r) if write_col1 else x.new_empty(0),
            x.new_empty(bh, m, d) if write_col2 else x.new_empty(0))


@custom_op("skyformer::lemma3_inverse_forward")
def lemma3_forward(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int,
                   keep: bool, backward: bool, implicit: bool) -> tuple[Tensor, Tensor]:
    """``triton_lemma3.lemma3_forward`` (``norm`` None: ``source`` is the matrix):
    (W, the iterates and, ``keep``, the step products for the ``backward`` pass;
    ``implicit``: the latest two iterates of the Newton chain). On ``source``'s GPU:
    in eager code ``CORE_FALLBACK.run`` enters it, but a graph compiled without
    Inductor's device guards calls this operator alone."""
    from . import triton_lemma3

    with launch_device(source):
        return triton_lemma3.lemma3_forward(source, norm, ridge, iterations, keep, backward,
                                            implicit)


@lemma3_forward.register_fake
def _(source, norm, ridge, iterations, keep, backward, implicit):
    from .triton_lemma3 import store_slots

    bh, m = source.shape[:2]
    return (source.new_empty(bh, m, m),
            source.new_empty(bh, store_slots(iterations, keep, backward), m, m))


@custom_op("skyformer::lemma3_inverse_backward")
def lemma3_backward(source: Tensor, norm: Tensor | None, ridge: Tensor, store: Tensor,
                    grad: Tensor, iterations: int, auto: bool, implicit: bool
                    ) -> tuple[Tensor, Tensor]:
    """``triton_lemma3_backward.lemma3_backward``: the gradients of the source and the norms
    (empty for a matrix, whose ``norm`` is None), ``implicit``: as an inverse's (from V_K
    alone, the latest two iterates stored); ``auto``: the PyTorch path's where the kernel fails
    (``CORE_FALLBACK``, inside the operator: compiled autograd traces the backward pass,
    and a ``run`` around the operator there)."""
    from . import triton_lemma3_backward

    def launch() -> tuple[Tensor, Tensor | None]:
        return triton_lemma3_backward.lemma3_backward(source, norm, ridge, store, grad,
                                                      iterations, implicit)

    dsource, dnorm = CORE_FALLBACK.run(
        auto, launch, lambda: lemma3_gradients_by_pytorch(source, norm, ridge, grad,
                                                          iterations, implicit), on=source)
    return dsource, _or_empty(dnorm, source)


@lemma3_backward.register_fake
def _(source, norm, ridge, store, grad, iterations, auto, implicit):
    return torch.empty_like(source), (source.new_empty(0) if norm is None
                                      else torch.empty_like(norm))
