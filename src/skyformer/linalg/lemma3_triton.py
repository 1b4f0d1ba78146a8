"""The Triton path of ``lemma3_inverse``: the whole Lemma 3 chain in one launch.

``lemma3_inverse(..., kernel=...)`` takes it where the method's products take Triton
(``kernel_backend.use_triton``) and the kernel covers the call: the iterative inverse
from the identity (the Lemma 3 default), at least one iteration, m <= ``MAX_M``, and
float32 (float64 under Triton's interpreter, for the tests). Elsewhere the PyTorch
path runs; both give the same W up to rounding. ``triton_lemma3`` holds the kernels,
``triton_ops`` their custom operators (opaque to ``torch.compile``, captured by CUDA
graphs); gradients come from the backward kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .kernel_backend import interpreter_on, use_triton
from .vmap import vmap_into_batch

MAX_M = 128  # a 128 x 128 float32 matrix per program, in registers (triton_lemma3)


def fused_lemma3_applies(kernel: str, mat: Tensor, pinv: str, init: str,
                         iterations: int) -> bool:
    """Whether ``lemma3_inverse`` of ``mat: [..., m, m]`` runs as the Triton kernels."""
    if pinv != "iterative" or init != "identity" or iterations < 1 \
            or mat.shape[-1] > MAX_M or mat.numel() == 0:
        return False
    if not use_triton(kernel, mat):
        return False
    return mat.dtype == torch.float32 or (mat.dtype == torch.float64 and not mat.is_cuda
                                          and interpreter_on())


def _ops():
    from . import triton_ops  # imports Triton: only when this path is taken

    return triton_ops


class TritonLemma3Inverse(torch.autograd.Function):
    """W = Lemma 3 inverse of ``mat: [..., m, m]`` with ridge ``[R, m]`` (the diagonal
    of the matrices of leading index b, R dividing the number of matrices)."""

    @staticmethod
    def forward(mat: Tensor, ridge: Tensor, iterations: int  # type: ignore[override]
                ) -> tuple[Tensor, Tensor]:
        m = mat.shape[-1]
        w, store = _ops().lemma3_forward(mat.reshape(-1, m, m).contiguous(),
                                         ridge.contiguous(), iterations)
        return w.reshape(mat.shape), store

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        mat, ridge, _ = inputs
        _, store = output
        ctx.mark_non_differentiable(store)
        ctx.save_for_backward(mat, ridge, store)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(TritonLemma3Inverse.apply, info, in_dims, args,
                               tensors=(0, 1), outputs=2)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple[Tensor | None, None, None]:
        mat, ridge, store = ctx.saved_tensors
        m = mat.shape[-1]
        dm = _ops().lemma3_backward(mat.reshape(-1, m, m).contiguous(), ridge.contiguous(),
                                    store, grad.reshape(-1, m, m).contiguous())
        return dm.reshape(mat.shape), None, None


def triton_lemma3_inverse(mat: Tensor, ridge: Tensor, iterations: int) -> Tensor:
    """W for ``mat: [..., m, m]``, ``ridge: [R, m]`` (see ``TritonLemma3Inverse``)."""
    return TritonLemma3Inverse.apply(mat, ridge, iterations)[0]
