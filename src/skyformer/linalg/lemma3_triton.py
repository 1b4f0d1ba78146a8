"""The Triton path of ``lemma3_inverse``: the whole Lemma 3 chain in one launch.

``lemma3_inverse(..., kernel=...)`` takes it where the method's products take Triton
(``kernel_backend.use_triton``) and the kernel covers the call: the iterative inverse
from the identity (the Lemma 3 default), at least one iteration, m <= ``MAX_M``, and
float32 (float64 under Triton's interpreter, for the tests). Elsewhere the PyTorch
path runs; both give the same W up to rounding. Under ``"auto"`` it is an eager choice
(``torch.compile`` fuses the PyTorch path itself, tracers record its operators), and a
kernel that fails to compile or launch, forward or backward, warns once and hands the
call to the PyTorch path from then on. ``triton_lemma3`` holds the kernels,
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
_fused_failed = False  # set when a kernel under "auto" failed (no compiler, resources)


def fused_lemma3_applies(kernel: str, mat: Tensor, pinv: str, init: str,
                         iterations: int) -> bool:
    """Whether ``lemma3_inverse`` of ``mat: [..., m, m]`` runs as the Triton kernels."""
    if pinv != "iterative" or init != "identity" or iterations < 1 \
            or mat.shape[-1] > MAX_M or mat.numel() == 0:
        return False
    if not use_triton(kernel, mat):
        return False
    from ..ops.shared.tracing import may_read_values  # the ops package imports linalg

    if kernel == "auto" and (_fused_failed or not may_read_values(mat)):
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
    def forward(mat: Tensor, ridge: Tensor, iterations: int,  # type: ignore[override]
                auto: bool) -> tuple[Tensor, Tensor]:
        m = mat.shape[-1]
        w, store = _ops().lemma3_forward(mat.reshape(-1, m, m).contiguous(),
                                         ridge.contiguous(), iterations)
        return w.reshape(mat.shape), store

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        mat, ridge, iterations, auto = inputs
        _, store = output
        ctx.mark_non_differentiable(store)
        ctx.save_for_backward(mat, ridge, store)
        ctx.iterations, ctx.auto = iterations, auto

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(TritonLemma3Inverse.apply, info, in_dims, args,
                               tensors=(0, 1), outputs=2)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple[Tensor | None, None, None, None]:
        mat, ridge, store = ctx.saved_tensors
        m = mat.shape[-1]

        def launch() -> Tensor:
            return _ops().lemma3_backward(mat.reshape(-1, m, m).contiguous(),
                                          ridge.contiguous(), store,
                                          grad.reshape(-1, m, m).contiguous())

        def by_pytorch() -> Tensor:
            with torch.enable_grad():
                leaf = mat.detach().requires_grad_(True)
                (dm,) = torch.autograd.grad(_by_pytorch(leaf, ridge, ctx.iterations), leaf,
                                            grad)
            return dm

        dm = _launch_or_fall_back(ctx.auto, launch, by_pytorch)
        return dm.reshape(mat.shape), None, None, None


def _by_pytorch(mat: Tensor, ridge: Tensor, iterations: int) -> Tensor:
    """The same W by ``nystrom.lemma3_by_pytorch`` (differentiable by autograd)."""
    from .nystrom import lemma3_by_pytorch  # nystrom imports this module

    m = mat.shape[-1]
    flat = mat.reshape(-1, m, m)
    diag = ridge.repeat_interleave(flat.shape[0] // ridge.shape[0], dim=0)  # [BH, m]
    return lemma3_by_pytorch(flat, diag, "iterative", iterations, "identity").reshape(
        mat.shape)


def _launch_or_fall_back(auto: bool, launch: Any, fallback: Any) -> Tensor:
    """``launch()``; under ``"auto"`` a failure warns once and takes ``fallback()``."""
    global _fused_failed
    if not auto:
        return launch()
    try:
        return launch()
    except Exception as error:  # any compiler or driver error
        import warnings

        _fused_failed = True
        warnings.warn(f"the Triton Lemma 3 kernel failed ({type(error).__name__}: {error}); "
                      "computing the core with PyTorch operations from now on (the same W "
                      "up to rounding).", RuntimeWarning, stacklevel=3)
        return fallback()


def triton_lemma3_inverse(mat: Tensor, ridge: Tensor, iterations: int, *,
                          kernel: str = "triton") -> Tensor:
    """W for ``mat: [..., m, m]``, ``ridge: [R, m]`` (see ``TritonLemma3Inverse``);
    ``kernel="auto"`` falls back to PyTorch where the kernel fails."""
    auto = kernel == "auto"
    return _launch_or_fall_back(
        auto, lambda: TritonLemma3Inverse.apply(mat, ridge, iterations, auto)[0],
        lambda: _by_pytorch(mat, ridge, iterations))
