"""``kernel="triton"`` of exact kernelized attention: the flash-style kernels of
``triton_flash`` as custom operators (opaque to ``torch.compile``, captured by CUDA
graphs) with their backward pass, and a ``vmap`` rule that folds a mapped dim into the
batch dim. Under ``"auto"`` the operators fall back to the SDPA augmentation where a
kernel fails, in compiled graphs too (``FLASH_FALLBACK``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...linalg.eager_calls import apply, custom_op
from ...linalg.functional_ops import first_order_backward
from ...linalg.kernel_backend import KernelFallback, autograd_in_operator
from ...linalg.vmap import vmap_into_batch


def _kernels():
    from . import triton_flash  # imports Triton: only when this path is taken

    return triton_flash


def _valid(key_valid: Tensor) -> Tensor | None:
    return key_valid if key_valid.numel() else None


# "auto"'s safety net: flash kernels that cannot compile or launch here (an old GPU, no
# C compiler, too few resources for the backward kernels) give way to the SDPA
# augmentation, with one warning, for the device and dtype of q. It runs inside the
# operators, so that it holds in compiled graphs too (``KernelFallback``).
FLASH_FALLBACK = KernelFallback("flash kernels of exact kernelized attention",
                                "kernel='auto' takes the SDPA augmentation")


@custom_op("skyformer::gaussian_flash_forward")
def flash_forward(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, s: float, causal: bool,
                  auto: bool) -> Tensor:
    """``triton_flash.flash_forward`` (``key_valid`` empty: no padding); ``auto``: the
    SDPA augmentation's output where the kernel fails (``FLASH_FALLBACK``)."""
    return FLASH_FALLBACK.run(
        auto, lambda: _kernels().flash_forward(q, k, v, _valid(key_valid), s, causal),
        lambda: _augmented_output(q, k, v, key_valid, s, causal), on=q)


@flash_forward.register_fake
def _(q, k, v, key_valid, s, causal, auto):
    return q.new_empty(*q.shape[:3], v.shape[-1])


@custom_op("skyformer::gaussian_flash_backward")
def flash_backward(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, grad: Tensor,
                   s: float, causal: bool, need_q: bool, need_kv: bool, auto: bool
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``triton_flash.flash_backward``: (dq, dk, dv); an empty dq without ``need_q``,
    empty dk and dv without ``need_kv`` (their kernel is not launched); ``auto``: the
    SDPA augmentation's gradients where a kernel fails (``FLASH_FALLBACK``)."""
    args = (q, k, v, key_valid, grad, s, causal, need_q, need_kv)
    return FLASH_FALLBACK.run(auto, lambda: _kernel_gradients(*args),
                              lambda: _augmented_gradients(*args), on=q)


@flash_backward.register_fake
def _(q, k, v, key_valid, grad, s, causal, need_q, need_kv, auto):
    return (q.new_empty(q.shape if need_q else 0), k.new_empty(k.shape if need_kv else 0),
            v.new_empty(v.shape if need_kv else 0))


def _kernel_gradients(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, grad: Tensor,
                      s: float, causal: bool, need_q: bool, need_kv: bool
                      ) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _kernels().flash_backward(q, k, v, _valid(key_valid), grad, s, causal,
                                           need_q=need_q, need_kv=need_kv)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv)


class GaussianFlashAttention(torch.autograd.Function):
    """C V, C_ij = exp(-s |q_i - k_j|^2 / 2): q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``,
    v ``[B, H, Nk, Dv]`` in one dtype, ``key_valid`` ``[B, Nk]`` bool (empty: none);
    ``auto``: a kernel that cannot run gives way to the augmentation (``FLASH_FALLBACK``,
    inside the operators)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor,  # type: ignore[override]
                s: float, causal: bool, auto: bool) -> Tensor:
        return flash_forward(q, k, v, key_valid, s, causal, auto)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        q, k, v, key_valid, s, causal, auto = inputs
        ctx.save_for_backward(q, k, v, key_valid)
        ctx.options = (s, causal, auto)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, q, k, v, key_valid, s, causal,  # type: ignore[override]
             auto):
        """The mapped dim joins the batch dim (a mapped mask's too; an unmapped mask
        is repeated for each mapped index)."""
        tensors = (0, 1, 2) if key_valid.numel() == 0 else (0, 1, 2, 3)
        (out,), (dim,) = vmap_into_batch(GaussianFlashAttention.apply, info, in_dims,
                                         (q, k, v, key_valid, s, causal, auto),
                                         tensors=tensors, outputs=1)
        return out, dim

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, key_valid = ctx.saved_tensors
        s, causal, auto = ctx.options
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = flash_backward(q, k, v, key_valid, grad, s, causal, need_q,
                                    need_k or need_v, auto)
        return (dq if need_q else None, dk if need_k else None, dv if need_v else None,
                None, None, None, None)


def _augmented_output(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, s: float,
                      causal: bool) -> Tensor:
    """``flash_forward``'s C V ``[B, H, Nq, Dv]`` (q's dtype, contiguous, as the operator
    declares) through the SDPA augmentation: "auto"'s output where the kernel fails."""
    from .sdpa_augmentation import kernelized_by_sdpa

    out = kernelized_by_sdpa(q, k, v, s, key_valid=_valid(key_valid), causal=causal)
    return out.to(q.dtype).contiguous()


def _augmented_gradients(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, grad: Tensor,
                         s: float, causal: bool, need_q: bool, need_kv: bool
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``flash_backward``'s (dq, dk, dv) through the SDPA augmentation (empty where not
    needed; contiguous, in the inputs' dtype, as the operator declares): "auto"'s
    gradients where the backward kernels cannot run. Differentiated inside the operator
    (``autograd_in_operator``); bfloat16 in float32, as every SDPA route with gradients
    (``kernelized.sums_in_float32_for_gradients``: in bfloat16, dq and dk came out 0.4
    from float64)."""
    from .sdpa_augmentation import kernelized_by_sdpa

    work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
    with autograd_in_operator():
        leaves = [t.detach().to(work).requires_grad_(need)
                  for t, need in ((q, need_q), (k, need_kv), (v, need_kv))]
        out = kernelized_by_sdpa(*leaves, s, key_valid=_valid(key_valid), causal=causal)
        grads = iter(torch.autograd.grad(out, [t for t in leaves if t.requires_grad],
                                         grad.to(out.dtype)))
    return tuple(next(grads).to(given.dtype).contiguous()  # type: ignore[return-value]
                 if t.requires_grad else given.new_empty(0)
                 for t, given in zip(leaves, (q, k, v), strict=True))


def flash_kernelized(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, s: float,
                     causal: bool, auto: bool = False) -> Tensor:
    """Exact kernelized attention C V by the flash-style Triton kernels, ``[B, H, Nq,
    Dv]`` in the inputs' dtype; ``key_valid`` ``[B, Nk]`` bool or None; ``auto``: forward
    and backward fall back to the augmentation where a kernel cannot run, also in a
    compiled graph."""
    placeholder = q.new_empty(0, dtype=torch.bool)
    return apply(GaussianFlashAttention, q, k, v, placeholder if key_valid is None
                 else key_valid, s, causal, auto)
