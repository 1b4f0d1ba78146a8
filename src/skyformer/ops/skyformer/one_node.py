"""Skyformer's non-causal call as one autograd node, in plain eager code.

``skyformer.py`` composes the call from four custom Functions (the landmark rows'
gather, the two Gaussian block products, the Lemma 3 core) and the views and products
between them: 27 autograd nodes and about 140 dispatched operations (views included)
for a forward and backward pass. On a GPU an eager call below N ~ 8192 is bound by
the host, not by its kernels (docs/gpu-record.md), so what the host spends around the
kernels is the call's time. Here the same kernels run in the same order on the same
tensors as one Function: its forward runs the products' and the core's forward steps,
its backward chains their backward steps by hand
(``kernel_matmul_triton.block_product_backward``, ``lemma3_triton.lemma3_backward_from``)
and adds the landmark rows' gradient into dq and dk in place
(``rows.add_rows_gradient_``). The values are the composable path's (tested against
it, outputs and gradients); the host's time is measured by ``benchmarks/host_time.py``.

Taken (``applies``) in plain eager code (``eager_calls.plain_eager``: not traced, no
``torch.func`` transform, plain tensors) for the non-causal call without padding, the
products and the core on the Triton kernels; elsewhere the composable path, which
tracers, transforms, masks and the PyTorch path need. A backward pass that is itself
differentiated (``create_graph``) is refused with the composable path's sentence; one
whose gradients are batched or wrapped (``autograd.grad(..., is_grads_batched=True)``,
``torch.func.vmap`` over ``autograd.grad``) replays the call through the composable
path with the same landmarks (``_replay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...linalg import half_sq_norm
from ...linalg.eager_calls import apply, plain_eager, plain_tensors
from ...linalg.functional_ops import _NOT_DIFFERENTIABLE
from ...linalg.kernel_backend import use_triton
from ...linalg.kernel_matmul_triton import (
    PRODUCT_FALLBACK,
    TritonGaussianBlockProduct,
    block_product_backward,
)
from ...linalg.lemma3_triton import (
    MAX_M,
    fused_lemma3_applies,
    lemma3_backward_from,
    lemma3_forward_step,
    stores_for,
)
from ...linalg.nystrom import core_iterations, ridge_diagonal
from ...linalg.rows import add_rows_gradient_, rows_untracked
from ...sketch import Landmarks
from ..shared.inputs import AttentionInputs, compute_dtype
from ..shared.modified_nystrom import every_head, nystrom_core

# Whether eligible calls take this path; ``benchmarks/host_time.py`` turns it off to
# time the composable path beside it
ONE_NODE = True


@dataclass(frozen=True)
class _Plan:
    """What the node needs besides tensors: the call's options, and what a replay
    through the composable path needs (``config``, ``landmarks``, ``info``)."""

    config: Any  # SkyformerConfig (skyformer.py imports this module)
    landmarks: Landmarks
    info: AttentionInputs
    scale: float  # s = p^-1/4 (or the config's)
    x_factor: float  # the factor of x over x_bf16 (1.0 without x_bf16)
    marks: bool  # the products mark non-finite rows (skyformer.marks_in_products)
    steps: int  # the core's iterations (core_iterations)
    keep: bool  # the core keeps its step products (lemma3_triton.stores_for)
    every_iterate: bool  # the core keeps every iterate (the unrolled gradient's)
    differentiated: bool  # q or k needs a gradient: the core's backward pass runs
    rows_dtype: torch.dtype  # the dtype of q and k (of the gathered rows)

    @property
    def auto(self) -> bool:
        return self.config.kernel == "auto"

    @property
    def implicit(self) -> bool:
        return self.config.pinv_gradient == "implicit"


def applies(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
            landmarks: Landmarks) -> bool:
    """Whether the call may run as one node, before its rows are gathered (``attention``
    asks the kernels the rest): plain eager code, non-causal, no padding, every slot
    live, one key head per query head, products on Triton, a core that its kernels
    hold (``lemma3_triton.MAX_M``)."""
    size = landmarks.query_index.shape[-1] + landmarks.key_index.shape[-1]
    return ONE_NODE and not config.causal and info.key_valid is None \
        and info.query_valid is None and landmarks.every_slot_live \
        and config.pinv == "iterative" and config.pinv_init == "identity" \
        and max(size, q.shape[-1]) <= MAX_M and q.dim() == 4 \
        and q.shape[:2] == k.shape[:2] == v.shape[:2] \
        and plain_eager() and plain_tensors(q, k, v) \
        and use_triton(config.kernel, q, half=True)  # the rows' dtype: x's (attention)


def attention(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
              landmarks: Landmarks, scale: float, marks: bool) -> Tensor | None:
    """Skyformer's output ``[B, H, Nq, Dv]`` as one node, or None where its products or
    its core do not take the Triton kernels here (the caller then composes the call).
    ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``."""
    with torch.no_grad():  # the node differentiates the rows itself
        flats, rows = rows_untracked((q, k), [every_head(index, q) for index in (
            landmarks.query_index, landmarks.key_index)])  # [B, H, m, D]
        unscaled = rows.to(compute_dtype(rows.dtype))
        bf16 = rows.dtype == torch.bfloat16  # x_bf16: the rows before their scale
        del rows
        x = unscaled * scale
        x_norm = half_sq_norm(x)  # [B, H, m]
    size = x.shape[-2]
    steps = core_iterations(config.pinv_gradient, config.pinv_iterations, size,
                            config.gamma, config.pinv, config.pinv_init, x.dtype)
    if not fused_lemma3_applies(config.kernel, x, size, config.pinv, config.pinv_init, steps):
        return None
    auto = config.kernel == "auto"
    if auto and (PRODUCT_FALLBACK.failed_on(q) or PRODUCT_FALLBACK.failed_on(k)):
        return None
    rows_differentiated = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    keep, every_iterate = stores_for(size, config.pinv_gradient == "implicit",
                                     rows_differentiated)
    plan = _Plan(config, landmarks, info, float(scale), float(scale) if bf16 else 1.0,
                 marks, steps, keep, every_iterate, rows_differentiated, q.dtype)
    ridge = ridge_diagonal(config.gamma, None, size, x).reshape(-1, size)  # [1, m]
    # "auto": what fails around the operators (importing Triton) hands the call to the
    # composable path, as ``gaussian_kernel_matmul``'s own fallback does
    return PRODUCT_FALLBACK.run(
        auto, lambda: apply(_OneNode, q, k, v, x, x_norm, unscaled if bf16 else None,
                            *flats, ridge, plan)[0],
        lambda: None, on=q)


class _OneNode(torch.autograd.Function):
    """out = C(Q, X) [W (C(X, K)^T V)] with X = s [Q; K]_S given as ``x: [B, H, m, D]``
    (gathered and scaled without a node: ``attention``), ``x_norm`` its half squared
    norms, ``x_bf16`` the rows before their scale where they are bfloat16 numbers,
    ``flat_q``, ``flat_k`` the rows' numbers in q and k, ``ridge: [1, m]``. Outputs:
    ``out: [B, H, Nq, Dv]`` and what the backward pass reads (not differentiable)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, x: Tensor,  # type: ignore[override]
                x_norm: Tensor, x_bf16: Tensor | None, flat_q: Tensor, flat_k: Tensor,
                ridge: Tensor, plan: _Plan) -> tuple[Tensor, ...]:
        qf, kf, vf, xf, nf, bf = _flat(q, k, v, x, x_norm, x_bf16)
        # C(X_S, K) V: [BH, m, Dv]; then W; then C(Q, X_S) (W (C(X_S, K) V))
        context, a_k = TritonGaussianBlockProduct.forward(
            kf, xf, nf, vf, None, plan.scale, True, True, False, None, bf, plan.x_factor,
            False, plan.auto, plan.marks)
        w, store = lemma3_forward_step(xf, nf, ridge, plan.steps, plan.auto, plan.implicit,
                                       plan.keep, plan.every_iterate)
        if not plan.differentiated:  # no backward pass reads them: the iterates go now
            store = w.new_empty(0)
        z = w @ context
        out, a_q = TritonGaussianBlockProduct.forward(
            qf, xf, nf, z, None, plan.scale, True, False, False, None, bf, plan.x_factor,
            False, plan.auto, plan.marks)
        return out.view(*q.shape[:-1], out.shape[-1]), context, w, z, a_q, a_k, store

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, x, x_norm, x_bf16, flat_q, flat_k, ridge, plan = inputs
        _, context, w, z, a_q, a_k, store = output
        ctx.mark_non_differentiable(context, w, z, a_q, a_k, store)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, x, x_norm, x_bf16, flat_q, flat_k, ridge, context, w,
                              z, a_q, a_k, store)
        ctx.plan = plan

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        none = (None,) * 7
        if grad is None:  # the output reached no loss (grads are not materialised)
            return (None,) * 3 + none
        if torch.is_grad_enabled():  # create_graph: as the composable path's Functions
            raise RuntimeError(_NOT_DIFFERENTIABLE)
        saved = list(ctx.saved_tensors)  # read once (activation checkpointing unpacks once)
        # the node's own references go (kept for a second pass, retain_graph=True), so
        # that each tensor is freed once read, as the composed call's nodes free theirs
        getattr(ctx, "maybe_clear_saved_tensors", lambda: None)()
        needs = ctx.needs_input_grad[:3]
        if not plain_tensors(grad):  # batched or wrapped: the composable path's backward
            return _replay(saved[:3], ctx.plan, needs, grad) + none
        return _backward(saved, ctx.plan, needs, grad) + none


def _flat(*tensors: Tensor | None) -> list[Tensor | None]:
    """``[B, H, ...]`` tensors as ``[BH, ...]`` (None stays None)."""
    return [None if t is None else t.reshape(-1, *t.shape[2:]) for t in tensors]


def _backward(saved: list, plan: _Plan, needs: tuple, grad: Tensor
              ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk, dv): the backward steps of ``_OneNode.forward``'s in reverse order,
    their gradients of X and of its norms summed, then added to dq and dk at the
    landmark rows. ``saved`` is emptied, and each tensor dropped once read: the Lemma 3
    iterates and W before the key product's backward makes dk and dv (the peak of the
    call at short N, as in the composed call)."""
    q, k, v, x, x_norm, x_bf16, flat_q, flat_k, ridge, context, w, z, a_q, a_k, store = saved
    saved.clear()
    need_q, need_k, need_v = needs
    need_x = need_q or need_k  # X is rows of Q and K
    qf, kf, vf, xf, nf, bf = _flat(q, k, v, x, x_norm, x_bf16)
    options = (plan.scale, True, False, plan.x_factor, False, plan.auto)
    dq, dx, dnorm, dz = block_product_backward(  # of C(Q, X_S) Z
        (qf, xf, nf, z, a_q, None, None, bf), options, (need_q, need_x, need_x, True),
        _flat(grad)[0])
    del z, a_q
    dcontext = w.mT @ dz  # [BH, m, Dv]
    dw = dz @ context.mT if need_x else None  # [BH, m, m]
    del w, dz
    if need_x:
        dx_core, dnorm_core = lemma3_backward_from(  # of W
            (xf, nf, ridge, store), plan.steps, plan.auto, plan.implicit, dw)
        dx, dnorm = dx + dx_core, dnorm + dnorm_core
        del dx_core, dnorm_core
    del store, dw
    transposed = (plan.scale, True, True, plan.x_factor, False, plan.auto)
    dk, dx_keys, dnorm_keys, dv = block_product_backward(  # of C(X_S, K)^T V
        (kf, xf, nf, vf, a_k, context, None, bf), transposed,
        (need_k, need_x, need_x, need_v), dcontext)
    if need_x:
        # x_norm = |x|^2 / 2 gives x its gradient times x, as autograd's (dn / 2) x
        # twice (each factor of x * x), summed in its order; x = s rows
        half = (dnorm + dnorm_keys).mul_(0.5)[..., None] * xf
        dx = (dx + dx_keys).add_(half).add_(half).mul_(plan.scale)
        dx = dx.view(x.shape).to(plan.rows_dtype)  # [B, H, m, D]
        rows_q = flat_q.shape[-1]
        if need_q:
            add_rows_gradient_(dq, dx[..., :rows_q, :], flat_q)
        if need_k:
            add_rows_gradient_(dk, dx[..., rows_q:, :], flat_k)
    return tuple(None if d is None else d.view(t.shape)  # type: ignore[return-value]
                 for d, t in ((dq, q), (dk, k), (dv, v)))


def _replay(inputs: tuple, plan: _Plan, needs: tuple, grad: Tensor
            ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk, dv) by the composable path's backward, the call recomputed with the
    same landmarks (gradients batched by the legacy vmap or wrapped by a transform,
    which its Functions take)."""
    from .skyformer import skyformer_from_core  # it imports this module

    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs,
                                                                     strict=True)]
        q, k, core = nystrom_core(leaves[0], leaves[1], plan.scale, plan.config,
                                  plan.landmarks)
        out = skyformer_from_core(q, k, leaves[2], core, plan.info, plan.scale,
                                  kernel=plan.config.kernel, show_nonfinite=plan.marks)
    wanted = [t for t, need in zip(leaves, needs, strict=True) if need]
    grads = iter(torch.autograd.grad(out, wanted, grad))
    return tuple(next(grads) if need else None  # type: ignore[return-value]
                 for need in needs)
