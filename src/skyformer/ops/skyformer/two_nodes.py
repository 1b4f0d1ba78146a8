"""Skyformer's non-causal call as two autograd nodes, in plain eager code.

``skyformer.py`` composes the call from four custom Functions (the landmark rows'
gather, the two Gaussian block products, the Lemma 3 core) and the views and products
between them: 27 autograd nodes for a forward and backward pass (the inputs'
accumulators included; 6 here). On a GPU an eager call below N ~ 8192 is bound by the
host, not by its kernels (docs/gpu-record.md), so what the host spends around the
kernels is the call's time. Here the same kernels run
in the same order on the same tensors as two Functions whose backward passes chain the
products' and the core's backward steps by hand
(``kernel_matmul_triton.block_product_backward``, ``lemma3_triton.lemma3_backward_from``):

- ``_KeySide``: Z = W (C(X_S, K) V), X_S the landmark rows (gathered without a node,
  ``attention``); it passes q, X_S and their norms through, so that its backward pass
  receives their gradients and adds the rows' gradient into dq and dk in place, in one
  kernel (``linalg/landmark_rows.py``);
- ``_QueryProduct``: C(Q, X_S) Z, padded queries' rows zero.

Two, not one: the output's gradient and q are freed after the second node's backward
step, as after the composed call's query product, not held to the end of the call.
The values are the composed call's, bit for bit (tested); the host's time is measured
by ``benchmarks/host_time.py``.

Taken (``applies``) in plain eager code (``eager_calls.plain_eager``: not traced, no
``torch.func`` transform, plain tensors) for the non-causal call, padded or not, the
products and the core on the Triton kernels; elsewhere the composed call, which
tracers, transforms, the causal form and the PyTorch path need. A backward pass that
is itself differentiated (``create_graph``) is refused with the composed call's
sentence; gradients batched or wrapped by a transform (``autograd.grad(...,
is_grads_batched=True)``, ``torch.func.vmap`` over ``autograd.grad``) are taken by the
composed call's halves with the same landmarks (``torch.func.vjp``: ``_replay``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...amp import autocast_off
from ...linalg.eager_calls import apply, plain_eager, plain_tensors
from ...linalg.functional_ops import _NOT_DIFFERENTIABLE
from ...linalg.kernel_backend import use_triton
from ...linalg.kernel_matmul_triton import (
    PRODUCT_FALLBACK,
    TritonGaussianBlockProduct,
    block_product_backward,
)
from ...linalg.landmark_rows import add_rows_gradient
from ...linalg.lemma3_triton import (
    MAX_M,
    fused_lemma3_applies,
    lemma3_backward_from,
    lemma3_forward_step,
    stores_for,
)
from ...linalg.nystrom import core_iterations, ridge_diagonal
from ...linalg.rows import add_rows, gather_rows, rows_untracked
from ...sketch import Landmarks
from ..shared.inputs import AttentionInputs
from ..shared.modified_nystrom import NystromCore, core_of_rows, every_head

# Whether eligible calls take this path; the benchmarks turn it off to time and weigh
# the composed call beside it (``benchmarks/kernel_flags.composed``)
TWO_NODES = True


@dataclass(frozen=True)
class _Plan:
    """What the nodes need besides tensors: the call's options, and what a replay
    through the composed call needs (``config``, ``landmarks``, ``info``)."""

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

    @property
    def auto(self) -> bool:
        return self.config.kernel == "auto"

    @property
    def implicit(self) -> bool:
        return self.config.pinv_gradient == "implicit"

    def product_options(self, transpose: bool) -> tuple:
        """``TritonGaussianBlockProduct``'s saved options for a product of the call."""
        return (self.scale, True, transpose, self.x_factor, False, self.auto)


def applies(q: Tensor, k: Tensor, v: Tensor, config: Any, landmarks: Landmarks) -> bool:
    """Whether the call may run as the two nodes, before its rows are gathered
    (``attention`` asks the kernels the rest): plain eager code, non-causal, one key
    head per query head, products on Triton, a core that its kernels hold
    (``lemma3_triton.MAX_M``)."""
    size = landmarks.query_index.shape[-1] + landmarks.key_index.shape[-1]
    return TWO_NODES and not config.causal \
        and config.pinv == "iterative" and config.pinv_init == "identity" \
        and max(size, q.shape[-1]) <= MAX_M and q.dim() == 4 \
        and q.shape[:2] == k.shape[:2] == v.shape[:2] \
        and plain_eager() and plain_tensors(q, k, v) \
        and use_triton(config.kernel, q, half=True)  # the rows' dtype: x's (attention)


def attention(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
              landmarks: Landmarks, scale: float, marks: bool) -> Tensor | None:
    """Skyformer's output ``[B, H, Nq, Dv]`` from the two nodes, or None where its
    products or its core do not take the Triton kernels here (the caller then composes
    the call). ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``."""
    with torch.no_grad():  # the key side's node differentiates the rows itself
        flats, rows = rows_untracked((q, k), [every_head(index, q) for index in (
            landmarks.query_index, landmarks.key_index)])  # [B, H, m, D]
        q_rows = rows[..., :flats[0].shape[-1], :]  # what a replay reads of q (_replay)
        # X, its norms (+inf on dead slots) and, for bfloat16 rows, x_bf16, as the
        # composed call makes them
        core = core_of_rows(rows, scale, config, landmarks)
    x, x_norm, live, x_bf16 = core.x, core.x_norm, core.live, core.x_bf16
    size = x.shape[-2]
    steps = core_iterations(config.pinv_gradient, config.pinv_iterations, size,
                            config.gamma, config.pinv, config.pinv_init, x.dtype)
    if not fused_lemma3_applies(config.kernel, x, size, config.pinv, config.pinv_init, steps):
        return None
    auto = config.kernel == "auto"
    if auto and (PRODUCT_FALLBACK.failed_on(q) or PRODUCT_FALLBACK.failed_on(k)):
        return None
    ridge = ridge_diagonal(config.gamma, live, size, x).reshape(-1, size)  # [1 | B, m]
    key_valid = None if info.key_valid is None else info.key_valid[:, None, :].expand(
        *k.shape[:2], k.shape[2]).reshape(-1, k.shape[2])  # [BH, Nk]
    rows_differentiated = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)

    def launch() -> Tensor:
        keep, every_iterate = stores_for(size, config.pinv_gradient == "implicit",
                                         rows_differentiated)  # imports Triton
        plan = _Plan(config, landmarks, info, float(scale), float(core.x_factor), marks,
                     steps, keep, every_iterate, rows_differentiated)
        q_through, x_through, norm_through, z = apply(
            _KeySide, q, k, v, x, x_norm, x_bf16, q_rows, *flats, ridge, key_valid, live,
            plan)[:4]
        out = apply(_QueryProduct, q_through, x_through, norm_through, z, x_bf16,
                    info.query_valid, plan)[0]
        return out.view(*q.shape[:-1], out.shape[-1])  # outside: the output is no view

    # "auto": what fails around the operators (importing Triton) hands the call to the
    # composed one, as ``gaussian_kernel_matmul``'s own fallback does
    return PRODUCT_FALLBACK.run(auto, launch, lambda: None, on=q)


def _flat(*tensors: Tensor | None) -> list[Tensor | None]:
    """``[B, H, ...]`` tensors as ``[BH, ...]`` (None stays None)."""
    return [None if t is None else t.reshape(-1, *t.shape[2:]) for t in tensors]


def _checked(grads: tuple) -> bool:
    """Whether a backward pass may run by hand: refuses a differentiated one (as the
    composed call's Functions do); False for gradients batched or wrapped by a
    transform, which the composed call's halves take (``_replay``)."""
    if torch.is_grad_enabled():  # create_graph
        raise RuntimeError(_NOT_DIFFERENTIABLE)
    return plain_tensors(*grads)


class _KeySide(torch.autograd.Function):
    """(q, X, its norms, Z = W (C(X, K)^T V)) for the landmark rows ``x: [B, H, m, D]``
    (gathered and scaled without a node: ``attention``), their half squared norms
    ``x_norm`` (+inf on dead slots), ``x_bf16`` the rows before their scale where they
    are bfloat16 numbers, ``q_rows`` the rows of q among them (as they are, for a
    replay: ``_replay``), ``flat_q``, ``flat_k`` the rows' numbers in q and k,
    ``ridge: [1 | B, m]``, ``key_valid: [BH, Nk]`` and ``live: [B, m]`` (None where all
    are). q, X and its norms pass through: their gradients come back here, and the
    rows' is added into dq. Also outputs what the backward pass reads."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, x: Tensor,  # type: ignore[override]
                x_norm: Tensor, x_bf16: Tensor | None, q_rows: Tensor, flat_q: Tensor,
                flat_k: Tensor, ridge: Tensor, key_valid: Tensor | None,
                live: Tensor | None, plan: _Plan) -> tuple[Tensor, ...]:
        kf, vf, xf, nf, bf = _flat(k, v, x, x_norm, x_bf16)
        # C(X_S, K) V: [BH, m, Dv]; then W; Z = W (C(X_S, K) V)
        context, a_k = TritonGaussianBlockProduct.forward(
            kf, xf, nf, vf, key_valid, plan.scale, True, True, False, None, bf,
            plan.x_factor, False, plan.auto, plan.marks)
        w, store = lemma3_forward_step(xf, nf, ridge, plan.steps, plan.auto, plan.implicit,
                                       plan.keep, plan.every_iterate)
        if not plan.differentiated:  # no backward pass reads them: the iterates go now
            store = w.new_empty(0)
        # they pass as views: autograd saves no input that is returned as it is (X and
        # its norms are saved, and q is when it is k)
        return (q.view_as(q), x.view_as(x), x_norm.view_as(x_norm), w @ context, context, w,
                a_k, store)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, x, x_norm, x_bf16, q_rows, flat_q, flat_k, ridge, _, live, plan = inputs
        q_out, x_out, norm_out, _, context, w, a_k, store = output
        ctx.mark_non_differentiable(context, w, a_k, store)
        # what passes through needs a gradient only as the composed call's would: the
        # query product then asks for no dq (dX) that would be thrown away
        if not q.requires_grad:
            ctx.mark_non_differentiable(q_out)
        if not (q.requires_grad or k.requires_grad):
            ctx.mark_non_differentiable(x_out, norm_out)
        ctx.set_materialize_grads(False)
        # not q: the query product holds it, and lets it go after its backward step
        ctx.save_for_backward(q_rows, k, v, x, x_norm, x_bf16, flat_q, flat_k, ridge, live,
                              context, w, a_k, store)
        ctx.plan = plan

    @staticmethod
    def backward(ctx: Any, dq: Tensor | None, dx: Tensor | None, dnorm: Tensor | None,
                 dz: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        none = (None,) * 10
        if dz is None:  # Z reached no loss (and X only through it)
            return (dq, None, None, *none)
        saved = list(ctx.saved_tensors)  # read once (activation checkpointing unpacks once)
        # the node's own references go (kept for a second pass, retain_graph=True), so
        # that each tensor is freed once read, as the composed call's nodes free theirs
        getattr(ctx, "maybe_clear_saved_tensors", lambda: None)()
        needs = ctx.needs_input_grad[:3]
        if not _checked((dq, dx, dnorm, dz)):
            return (*_key_side_replay(saved, ctx.plan, needs, dq, dx, dnorm, dz), *none)
        with autocast_off(dz.device.type):  # as the forward ran: the kernels' dtypes
            return (*_key_side_backward(saved, ctx.plan, needs, dq, dx, dnorm, dz), *none)


def _key_side_backward(saved: list, plan: _Plan, needs: tuple, dq: Tensor | None,
                       dx: Tensor | None, dnorm: Tensor | None, dz: Tensor
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk, dv) of ``_KeySide``: its steps' backward in reverse order, X's
    gradients summed in autograd's order and the rows' gradient added into dq (in place:
    the query product's own, which no other node holds) and dk, by one kernel
    (``linalg/landmark_rows.py``: 13 launches by PyTorch operations). ``saved`` is emptied
    and each tensor dropped once read: the Lemma 3 iterates and W before the key
    product's backward makes dk and dv (the peak of the call at short N)."""
    _, k, v, x, x_norm, x_bf16, flat_q, flat_k, ridge, live, context, w, a_k, store = saved
    saved.clear()
    need_q, need_k, need_v = needs
    need_x = need_q or need_k  # X is rows of Q and K
    kf, vf, xf, nf, bf = _flat(k, v, x, x_norm, x_bf16)
    dz = dz.view(w.shape[0], *dz.shape[-2:])  # [BH, m, Dv]
    dcontext = w.mT @ dz  # [BH, m, Dv]
    dw = dz @ context.mT if need_x else None  # [BH, m, m]
    del w, dz
    if need_x:
        dx_core, dnorm_core = lemma3_backward_from(  # of W
            (xf, nf, ridge, store), plan.steps, plan.auto, plan.implicit, dw)
    del store, dw
    dk, dx_keys, dnorm_keys, dv = block_product_backward(  # of C(X_S, K)^T V
        (kf, xf, nf, vf, a_k, context, None, bf), plan.product_options(transpose=True),
        (need_k, need_x, need_x, need_v), dcontext)
    if need_x:  # x = s rows, x_norm = |x|^2 / 2: the rows' gradient, in place
        dx, dnorm = _flat(dx, dnorm)
        dq, dk = add_rows_gradient(
            dq if need_q else None, dk if need_k else None, flat_q, flat_k, xf,
            (dx, dx_core, dx_keys), (dnorm, dnorm_core, dnorm_keys), live, plan.scale,
            auto=plan.auto)
    return (dq if need_q else None, None if dk is None else dk.view(k.shape),
            None if dv is None else dv.view(v.shape))


class _QueryProduct(torch.autograd.Function):
    """C(Q, X) Z ``[BH, Nq, Dv]`` for ``q: [B, H, Nq, D]``, the key side's X, norms
    and Z ``[BH, m, Dv]``; rows of padded queries (``query_valid: [B, Nq]``) zero.
    Also outputs what the backward pass reads."""

    @staticmethod
    def forward(q: Tensor, x: Tensor, x_norm: Tensor, z: Tensor,  # type: ignore[override]
                x_bf16: Tensor | None, query_valid: Tensor | None, plan: _Plan
                ) -> tuple[Tensor, Tensor]:
        qf, xf, nf, bf = _flat(q, x, x_norm, x_bf16)
        out, a_q = TritonGaussianBlockProduct.forward(
            qf, xf, nf, z, None, plan.scale, True, False, False, None, bf, plan.x_factor,
            False, plan.auto, plan.marks)
        if query_valid is not None:  # as zero_padded_queries
            out = torch.where(_query_rows(query_valid, q), out, 0.0)
        return out, a_q

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, x, x_norm, z, x_bf16, query_valid, plan = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, x, x_norm, z, x_bf16, query_valid, output[1])
        ctx.plan = plan

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _: Any) -> tuple[Tensor | None, ...]:
        none = (None,) * 3
        if grad is None:  # the output reached no loss
            return (None,) * 4 + none
        saved = list(ctx.saved_tensors)
        getattr(ctx, "maybe_clear_saved_tensors", lambda: None)()
        needs = ctx.needs_input_grad[:4]
        if not _checked((grad,)):
            return (*_replay(_query_product_replay(saved, ctx.plan), saved[:4], needs,
                             (grad,)), *none)
        q, x, x_norm, z, x_bf16, query_valid, a_q = saved
        del saved
        if query_valid is not None:  # zero_padded_queries' backward
            grad = torch.where(_query_rows(query_valid, q), grad, 0.0)
        qf, xf, nf, bf = _flat(q, x, x_norm, x_bf16)
        with autocast_off(grad.device.type):
            dq, dx, dnorm, dz = block_product_backward(  # of C(Q, X_S) Z
                (qf, xf, nf, z, a_q, None, None, bf), ctx.plan.product_options(False),
                needs, grad)
        return (None if dq is None else dq.view(q.shape),
                None if dx is None else dx.view(x.shape),
                None if dnorm is None else dnorm.view(x_norm.shape), dz, *none)


def _query_rows(query_valid: Tensor, q: Tensor) -> Tensor:
    """``query_valid: [B, Nq]`` as ``[BH, Nq, 1]`` for q's heads."""
    b, h, n = q.shape[:3]
    return query_valid[:, None, :, None].expand(b, h, n, 1).reshape(b * h, n, 1)


def _core(x: Tensor, x_norm: Tensor, x_bf16: Tensor | None, plan: _Plan) -> NystromCore:
    """The composed call's core of the nodes' X (replays)."""
    landmarks = plan.landmarks
    live = None if landmarks.every_slot_live else landmarks.live
    return NystromCore(x, x_norm, plan.config, landmarks, live, x_bf16,
                       plan.x_factor if x_bf16 is not None else 1.0)


def _key_side_replay(saved: list, plan: _Plan, needs: tuple, dq: Tensor | None,
                     dx: Tensor | None, dnorm: Tensor | None, dz: Tensor
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk, dv) of ``_KeySide`` by the composed call's Functions: X, its norms and
    Z as functions of q's landmark rows, k and v (``nystrom_core``'s core of the rows,
    ``skyformer.core_values``), their gradients by ``_replay``, the rows' added to the
    gradient that passed through for q, out of place."""
    from .skyformer import core_values  # it imports this module

    q_rows, k, v, flat_q = saved[0], saved[1], saved[2], saved[6]

    def key_side(q_rows: Tensor, k: Tensor, v: Tensor) -> tuple:
        rows = torch.cat([q_rows, gather_rows(k, every_head(plan.landmarks.key_index, k))],
                         dim=-2)
        core = core_of_rows(rows, plan.scale, plan.config, plan.landmarks)
        z = core_values(k, v, core, plan.info, plan.scale, kernel=plan.config.kernel,
                        show_nonfinite=plan.marks)
        return core.x, core.x_norm, z.flatten(0, 1)

    need_q = needs[0]
    d_rows, dk, dv = _replay(key_side, [q_rows, k, v], needs, (dx, dnorm, dz))
    if need_q:  # dq passed through, and the gradient of q's landmark rows
        dq = add_rows(dq, d_rows, flat_q, in_place=False)
    return dq if need_q else None, dk, dv


def _query_product_replay(saved: list, plan: _Plan) -> Callable[..., tuple]:
    """``_QueryProduct``'s output as the composed call computes it, from (q, X, its
    norms, Z)."""
    from .skyformer import query_product  # it imports this module

    x_bf16 = saved[4]

    def product(q: Tensor, x: Tensor, x_norm: Tensor, z: Tensor) -> tuple:
        out = query_product(q, _core(x, x_norm, x_bf16, plan), z.view(*x.shape[:2],
                                                                        *z.shape[-2:]),
                            plan.info, plan.scale, plan.config.kernel, plan.marks)
        return (out.flatten(0, 1),)

    return product


def _replay(function: Callable[..., tuple], inputs: list, needs: tuple, grads: tuple
            ) -> tuple:
    """The gradients of ``inputs`` (None where not ``needs``) for the outputs'
    ``grads`` by the composed call's Functions (``torch.func.vjp``), whose backward
    passes take gradients batched by the legacy vmap or wrapped by a transform."""
    outputs, vjp = torch.func.vjp(function, *inputs)
    cotangents = tuple(torch.zeros_like(o) if g is None else g
                       for o, g in zip(outputs, grads, strict=True))
    return tuple(g if need else None for g, need in zip(vjp(cotangents), needs,
                                                        strict=True))
