"""The Triton path of ``lemma3_inverse`` and ``landmark_inverse``: the whole Lemma 3
chain in one launch, or one launch a pass (``triton_lemma3.launch``), from the landmark
rows the kernel block C(X, X) too.

They take it where the method's products take Triton (``kernel_backend.use_triton``) and
the kernel covers the call: the iterative inverse from the identity (the Lemma 3
default), at least one iteration, m <= ``MAX_M`` (and head dim <= ``MAX_M`` from rows),
float32 (float64 under Triton's interpreter, for the tests, from Triton 3.5: ``tl.dot``
of float64 tiles). Elsewhere the PyTorch path runs, under ``"triton"`` too where the
kernel does not cover the call (another ``pinv`` or ``init``, no iteration, m >
``MAX_M``, an empty matrix); a covered call that Triton cannot run there (a CPU tensor
without the interpreter, a half type) gets the products' sentence
(``kernel_backend.use_triton``). Both paths give the same W up to rounding. Under
``"auto"`` it is an eager choice (``torch.compile`` fuses the PyTorch path itself,
tracers record its operators), and a kernel that fails to compile or launch, forward or
backward, warns once and hands the call to the PyTorch path from then on, for that
device and dtype (``CORE_FALLBACK``). ``triton_lemma3`` holds the forward kernel,
``triton_lemma3_backward`` the backward kernel, ``triton_ops`` their custom operators
(opaque to ``torch.compile``, captured by CUDA graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .eager_calls import apply
from .functional_ops import first_order_backward
from .graph_launches import graph_launches_on
from .kernel_backend import (
    KernelFallback,
    autograd_in_operator,
    check_kernel,
    float64_dots,
    interpreter_on,
    use_triton,
)
from .tracing import may_read_values
from .vmap import vmap_into_batch

MAX_M = 128  # the kernels' tiles cover m <= 128 (triton_lemma3.launch_options)
CORE_FALLBACK = KernelFallback(
    "Lemma 3 kernel", "computing the core with PyTorch operations (the same W up to rounding)")


def fused_lemma3_applies(kernel: str, source: Tensor, size: int, pinv: str, init: str,
                         iterations: int) -> bool:
    """Whether the Lemma 3 inverse of ``size`` landmarks, given as ``source`` (their
    matrix ``[..., m, m]`` or rows ``[..., m, D]``), runs as the Triton kernels (forward
    and backward)."""
    check_kernel(kernel)
    if pinv != "iterative" or init != "identity" or iterations < 1 \
            or max(size, source.shape[-1]) > MAX_M or source.numel() == 0:
        return False
    if not use_triton(kernel, source):
        return False

    if kernel == "auto" and (CORE_FALLBACK.failed_on(source) or not may_read_values(source)):
        return False
    return source.dtype == torch.float32 or (source.dtype == torch.float64
                                             and not source.is_cuda and interpreter_on()
                                             and float64_dots())


def _ops():
    from . import triton_ops  # imports Triton: only when this path is taken

    return triton_ops


def _flat(t: Tensor | None, trailing: int) -> Tensor | None:
    """``t`` as a contiguous ``[BH, ...]`` (its last ``trailing`` dims kept); None stays
    None."""
    if t is None:
        return None
    return t.reshape(-1, *t.shape[t.dim() - trailing:]).contiguous()


class TritonLemma3Inverse(torch.autograd.Function):
    """W = Lemma 3 inverse of the landmark matrix ``source: [..., m, m]`` (``norm``
    None) or of C(X, X) for landmark rows ``source: [..., m, D]`` with half squared
    norms ``norm: [..., m]``; ridge ``[R, m]`` (the diagonal of the matrices of leading
    index b, R dividing the number of matrices); ``implicit``: differentiated as an
    inverse (``implicit_inverse``), from V_K alone."""

    @staticmethod
    def forward(source: Tensor, norm: Tensor | None, ridge: Tensor,  # type: ignore[override]
                iterations: int, auto: bool, implicit: bool, keep: bool, backward: bool
                ) -> tuple[Tensor, Tensor]:
        m = source.shape[-2]
        w, store = _ops().lemma3_forward(_flat(source, 2), _flat(norm, 1),
                                         ridge.contiguous(), iterations, keep, backward,
                                         implicit)
        return w.reshape(*source.shape[:-2], m, m), store

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        source, norm, ridge, iterations, auto, implicit, _, _ = inputs
        _, store = output
        ctx.mark_non_differentiable(store)
        ctx.set_materialize_grads(False)  # no zero tensor of the iterates' size
        ctx.save_for_backward(source, norm, ridge, store)
        ctx.iterations, ctx.auto, ctx.implicit = iterations, auto, implicit

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(TritonLemma3Inverse.apply, info, in_dims, args,
                               tensors=(0, 1, 2), outputs=2)

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor, _: Any
                 ) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None, None]:
        if grad is None:  # W reached no loss (grads are not materialised)
            return (None,) * 8
        dsource, dnorm = lemma3_backward_from(ctx.saved_tensors, ctx.iterations, ctx.auto,
                                              ctx.implicit, grad)
        return dsource, dnorm, None, None, None, None, None, None


def lemma3_backward_from(saved: tuple, iterations: int, auto: bool, implicit: bool,
                         grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """The gradients of the source and the norms (None without) of
    ``TritonLemma3Inverse`` for the gradient ``grad`` of W: ``saved`` as its
    ``setup_context`` keeps them (source, norm, ridge, store). Also the backward step of
    a caller that chains the core itself (``ops/skyformer/two_nodes.py``)."""
    source, norm, ridge, store = saved
    m = source.shape[-2]
    # "auto"'s fallback runs inside the operator, where compiled autograd's traced
    # backward graph calls it (``lemma3_gradients_by_pytorch``)
    dsource, dnorm = _ops().lemma3_backward(
        _flat(source, 2), _flat(norm, 1), ridge.contiguous(),
        store.contiguous(), grad.reshape(-1, m, m).contiguous(), iterations, auto, implicit)
    return dsource.reshape(source.shape), None if norm is None else dnorm.reshape(norm.shape)


def lemma3_gradients_by_pytorch(source: Tensor, norm: Tensor | None, ridge: Tensor,
                                grad: Tensor, iterations: int, implicit: bool = False
                                ) -> tuple[Tensor, Tensor | None]:
    """The gradients of the source and the norms (None without) for the gradient ``grad``
    of W, by autograd through ``_by_pytorch``: "auto"'s where the backward kernel fails,
    computed inside its operator (``autograd_in_operator``)."""
    with autograd_in_operator():
        leaves = [t.detach().requires_grad_(True) for t in (source, norm) if t is not None]
        w = _by_pytorch(leaves[0], None if norm is None else leaves[1], ridge, iterations,
                        implicit)
        grads = torch.autograd.grad(w, leaves, grad)
    return grads[0], (None if norm is None else grads[1])


def _by_pytorch(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int,
                implicit: bool = False) -> Tensor:
    """The same W by ``nystrom.lemma3_by_pytorch`` (differentiable by autograd)."""
    from .kernels import gaussian_kernel_block
    from .nystrom import lemma3_by_pytorch  # nystrom imports this module

    mat = source if norm is None else gaussian_kernel_block(source, source, norm, norm)
    m = mat.shape[-1]
    flat = mat.reshape(-1, m, m)
    diag = ridge.repeat_interleave(flat.shape[0] // ridge.shape[0], dim=0)  # [BH, m]
    return lemma3_by_pytorch(flat, diag, "iterative", iterations, "identity",
                             "implicit" if implicit else "unrolled").reshape(mat.shape)


def triton_lemma3_inverse(source: Tensor, norm: Tensor | None, ridge: Tensor,
                          iterations: int, *, kernel: str = "triton",
                          implicit: bool = False) -> Tensor:
    """W (see ``TritonLemma3Inverse``); ``kernel="auto"`` falls back to PyTorch where
    the kernel fails."""
    if source.dim() == 2:  # one matrix: the Function and its vmap rule take a batch dim
        return triton_lemma3_inverse(source[None], None if norm is None else norm[None],
                                     ridge, iterations, kernel=kernel, implicit=implicit)[0]
    auto = kernel == "auto"
    return CORE_FALLBACK.run(
        auto, lambda: apply(TritonLemma3Inverse, source, norm, ridge, iterations, auto,
                            implicit, *_stored(source, norm, implicit))[0],
        lambda: _by_pytorch(source, norm, ridge, iterations, implicit), on=source)


def lemma3_forward_step(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int,
                        auto: bool, implicit: bool, keep: bool, backward: bool
                        ) -> tuple[Tensor, Tensor]:
    """(W, the store) of ``TritonLemma3Inverse``'s forward for a caller that chains the
    core itself (``ops/skyformer/two_nodes.py``), launched on the source's device; under
    ``auto`` where the kernel fails, W by PyTorch and an empty store (the backward
    operator then takes the PyTorch path's gradients, ``CORE_FALLBACK``)."""
    return CORE_FALLBACK.run(
        auto, lambda: TritonLemma3Inverse.forward(source, norm, ridge, iterations, auto,
                                                  implicit, keep, backward),
        lambda: (_by_pytorch(source, norm, ridge, iterations, implicit), source.new_empty(0)),
        on=source)


def _stored(source: Tensor, norm: Tensor | None, implicit: bool) -> tuple[bool, bool]:
    """(whether the forward kernel keeps its step products, whether it keeps every
    iterate for a backward pass): without one, or for the ``implicit`` gradient, which
    reads V_K alone, it keeps the latest two iterates; with one, the step products too
    where the backward kernel's options ask (``triton_lemma3.store_slots``,
    ``keeps_products``: inside ``cuda_graph_launches()``). Traced by ``torch.compile``
    at the setting in force then, on which it guards; the backward kernel reads what
    was kept from the store's size."""
    if implicit or not torch.is_grad_enabled():
        return False, False
    # under torch.func transforms the tensors a Function sees need not say whether an
    # outer grad differentiates them (grad of vmap: the batched ones do not)
    transformed = not torch.compiler.is_compiling() \
        and torch._C._are_functorch_transforms_active()
    return stores_for(source.shape[-2], implicit, transformed or source.requires_grad
                      or (norm is not None and norm.requires_grad))


def stores_for(size: int, implicit: bool, differentiated: bool) -> tuple[bool, bool]:
    """``_stored``'s answer for ``size`` landmarks and a core that is, or is not,
    ``differentiated`` (grad mode is not read: a caller that chains the core itself
    says)."""
    if implicit or not differentiated:
        return False, False
    from .triton_lemma3 import keeps_products  # imports Triton

    return keeps_products(size, graph_launches_on()), True
