"""Iterative (matrix-product) pseudo-inverse, shared by every Nystrom-type method.

Razavi et al. (2014), "A new iterative method for finding approximate inverses of
complex matrices", the iteration used by Nystromformer and Skyformer:

    V_{k+1} = 1/4 V_k (13 I - A V_k (15 I - A V_k (7 I - A V_k)))

It converges (to A^+) when ||I - A V_0|| < 1. Two starting points are offered,
both computed *per matrix* (never a maximum over the batch, which would make one
sequence's output depend on the others):

- ``"scaled_transpose"``: V_0 = A^T / (||A||_1 ||A||_inf). Converges for any
  matrix (Pan & Schreiber 1991); the Nystromformer choice.
- ``"identity"``: V_0 = I. Converges when ||I - A|| < 1, the condition Skyformer's
  Lemma 3 establishes for D^-1/2 (M + gamma I) D^-1/2 (Skyformer section 4.4
  states exactly this condition for Razavi et al.'s Theorem 2). For such a matrix
  it starts every eigenvalue of A V_0 at lambda instead of lambda^2 / ||A||_1^2,
  so small eigenvalues converge in far fewer iterations.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .eager_calls import apply
from .flush import flush_on_cpu_
from .functional_ops import first_order_backward, functional_ops_only
from .vmap import split_batch

PinvInit = Literal["scaled_transpose", "identity"]
PINV_INITS: tuple[str, ...] = ("scaled_transpose", "identity")


def initial_inverse(a: Tensor, init: PinvInit) -> Tensor:
    """Starting point V_0 for ``a: [..., m, m]`` (see module docstring)."""
    if init == "identity":
        return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    if init == "scaled_transpose":
        abs_a = a.abs()
        norm_1 = abs_a.sum(dim=-2).amax(dim=-1)  # max column sum  [...]
        norm_inf = abs_a.sum(dim=-1).amax(dim=-1)  # max row sum   [...]
        scale = 1.0 / (norm_1 * norm_inf).clamp_min(torch.finfo(a.dtype).tiny)
        return a.transpose(-1, -2) * scale[..., None, None]
    raise ValueError(f"init must be one of {PINV_INITS}, got {init!r}.")


def razavi_step(a3: Tensor, v: Tensor | None, eye: Tensor, eye7: Tensor,
                buffers: tuple[Tensor, Tensor, Tensor, Tensor], out: Tensor) -> Tensor:
    """One Razavi step (``_RazaviIteration``'s Horner form) from V ``[BH, m, m]`` into
    ``out`` (not V), ``v`` None for V_0 = I (P = A, V' = T3 / 4); ``buffers`` (P, T1,
    T2, T3) receive the step's products (P unused from the identity). Iterates and
    products are flushed on the CPU: subnormal ones slow its products down
    (``flush.py``). Returns ``out``."""
    p, t1, t2, t3 = buffers
    flush = flush_on_cpu_
    if v is None:
        p = a3
    else:
        flush(torch.bmm(a3, v, out=p))
    torch.sub(eye7, p, out=t1)
    flush(torch.baddbmm(eye, p, t1, beta=15, alpha=-1, out=t2))
    flush(torch.baddbmm(eye, p, t2, beta=13, alpha=-1, out=t3))
    if v is None:
        return torch.mul(t3, 0.25, out=out)
    return flush(torch.bmm(v, t3, out=out).mul_(0.25))


class _RazaviIteration(torch.autograd.Function):
    """``iterations`` Razavi steps from ``v0`` (``None`` = identity) with a hand-written
    backward pass.

    One step, in Horner form with P = A V (all ``[..., m, m]``):

        T1 = 7I - P,   T2 = 15I - P T1,   T3 = 13I - P T2,   V' = V T3 / 4.

    Its adjoint, for an incoming gradient G' of V':

        dT3 = V^T G' / 4,   dT2 = -P^T dT3,   dT1 = -P^T dT2,
        dP  = -dT3 T2^T - dT2 T1^T - dT1,
        dV  = G' T3^T / 4 + A^T dP,   dA += dP V^T,

    the products autograd would run, without its graph of ~15 nodes per step; each
    "cI - X Y" is one fused ``baddbmm``. From V0 = I the first step needs no product
    with V (P = A, V1 = T3 / 4): 2 products instead of 4 forward, 4 instead of 8 back.
    """

    @staticmethod
    def forward(a, v0, iterations):  # type: ignore[override]
        m = a.shape[-1]
        a3 = a.reshape(-1, m, m)
        eye = torch.eye(m, dtype=a.dtype, device=a.device).expand_as(a3)
        eye7 = 7 * eye
        # Everything the backward pass needs, in one allocation: per step V (its input),
        # P, T2, T3 (T1 = 7I - P is rebuilt). Dozens of separate [BH, m, m] tensors per
        # call cost more in allocation (page faults) than in arithmetic at m = 128.
        store = a3.new_empty(iterations, 4, *a3.shape)
        t1 = torch.empty_like(a3)
        out = torch.empty_like(a3)
        v = None if v0 is None else v0.reshape(-1, m, m)
        for i in range(iterations):
            v_in, p, t2, t3 = store[i]
            if v is not None and i == 0:
                v_in.copy_(v)  # later inputs were written in place
            v_next = out if i == iterations - 1 else store[i + 1, 0]
            v = razavi_step(a3, v, eye, eye7, (p, t1, t2, t3), v_next)
        # ``store`` is returned so that ``setup_context`` can save it (torch.func form).
        return out.reshape(a.shape), store

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        a, v0, _ = inputs
        _, store = output
        ctx.mark_non_differentiable(store)
        # no zero tensor of the store's size as its "gradient" (6 x 4 [BH, m, m]: 3 MiB
        # filled per backward at m = 128, BH = 2), as the Triton twin (lemma3_triton.py)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, store)
        ctx.saved_batch_dims = (0, 2)  # store: [iterations, 4, BH, m, m]
        ctx.identity_start = v0 is None

    @staticmethod
    def vmap(info, in_dims, a, v0, iterations):  # type: ignore[override]
        """The iteration takes any batch shape: the mapped dim becomes the first one
        (and the leading index of the store's flattened batch dim)."""
        a = a.movedim(in_dims[0], 0) if in_dims[0] is not None else a.expand(
            info.batch_size, *a.shape)
        if v0 is not None:
            v0 = v0.movedim(in_dims[1], 0) if in_dims[1] is not None else v0.expand_as(a)
        out, store = _RazaviIteration.apply(a, v0, iterations)
        return (out, split_batch(store, info.batch_size, at=2)), (0, 2)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad, _):  # type: ignore[override]
        a, store = ctx.saved_tensors
        if grad is None:  # the output reached no loss (grads are not materialised)
            return None, None, None
        m = a.shape[-1]
        a3 = a.reshape(-1, m, m)
        g = grad.reshape(-1, m, m).contiguous()
        da = torch.zeros_like(a3)
        a_t = a3.transpose(1, 2)
        eye7 = 7 * torch.eye(m, dtype=a3.dtype, device=a3.device)
        t1, dt3, m1, m2, dp, tmp = torch.empty(6, *a3.shape, dtype=a3.dtype, device=a3.device)
        g_next = torch.empty(2, *a3.shape, dtype=a3.dtype, device=a3.device)
        flush = flush_on_cpu_  # as in the forward pass: products stay normal
        scale = None
        if scales_gradient(g):
            # The backward pass is linear in g: flushing at sqrt(tiny) is safe once each
            # matrix's g is brought to order 1 by an exact power of two (a gradient may be
            # of any size; below 2^-60 the flush dropped the inverse's part of dq, dk).
            scale = _power_of_two_scale(g)
            g = flush(g * scale)
        for i in reversed(range(store.shape[0])):
            v, p, t2, t3 = store[i]
            first_from_identity = i == 0 and ctx.identity_start
            if first_from_identity:
                p = a3
            p_t = p.transpose(1, 2)
            torch.sub(eye7, p, out=t1)
            if first_from_identity:
                torch.mul(g, 0.25, out=dt3)
            else:
                flush(torch.bmm(v.transpose(1, 2), g, out=dt3).mul_(0.25))
            # with the signs folded in: dT2 = -m2, dT1 = m1, dP = -m1 - dT3 T2^T + m2 T1^T
            flush(torch.bmm(p_t, dt3, out=m2))
            flush(torch.bmm(p_t, m2, out=m1))
            torch.baddbmm(m1, dt3, t2.transpose(1, 2), beta=-1, alpha=-1, out=dp)
            flush(dp.baddbmm_(m2, t1.transpose(1, 2)))
            if first_from_identity:  # P = A
                da.add_(dp)
                break
            da.baddbmm_(dp, v.transpose(1, 2))
            torch.bmm(a_t, dp, out=tmp)
            g = flush(torch.baddbmm(tmp, g, t3.transpose(1, 2), alpha=0.25, out=g_next[i % 2]))
        if scale is not None:  # back to the gradient's own size, exactly
            da.div_(scale)
            g = g / scale
        # a's shape, not [..., m, m] per matrix: under a transform of this backward pass
        # (jacrev) one [m, m] matrix arrives with the mapped dim folded into its rows
        dv0 = None if ctx.identity_start else g.reshape(a.shape).clone()
        return da.reshape(a.shape), dv0, None


def scales_gradient(g: Tensor) -> bool:
    """Whether the backward pass brings ``g`` to order 1 before flushing: where it
    flushes, on a CPU (``benchmarks/launch_counts.py`` counts a CUDA call's operations
    on a CPU with this answering False)."""
    return g.device.type == "cpu"


def _power_of_two_scale(g: Tensor) -> Tensor:
    """``[n, 1, 1]``: 2^-e with 2^(e-1) <= max |g| of each matrix < 2^e, so that g times it
    has entries of order 1 and nothing is rounded (1 where g is 0 or not finite; e kept
    within the dtype's exponent range)."""
    top = g.abs().amax(dim=(1, 2), keepdim=True)
    exponent = torch.frexp(torch.where(torch.isfinite(top), top, 0.0)).exponent
    limit = int(math.log2(torch.finfo(g.dtype).max)) - 2
    return torch.ldexp(torch.ones_like(top), (-exponent).clamp(-limit, limit))


def iterative_pinv(
    a: Tensor,
    iterations: int = 6,
    *,
    init: PinvInit = "scaled_transpose",
) -> Tensor:
    """Approximate pseudo-inverse of ``a: [..., m, m]`` by ``iterations`` Razavi steps.

    Each step costs four batched m x m products (two for the first step from the
    identity). Differentiable, by a hand-written backward pass (``_RazaviIteration``);
    under ``torch.export`` and forward-mode AD the same steps in plain operators.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}.")
    v0 = None if init == "identity" else initial_inverse(a, init)
    if iterations == 0:
        return initial_inverse(a, init) if v0 is None else v0
    if functional_ops_only():  # torch.export, forward-mode AD (functional_ops.py)
        return _iterate_by_autograd(a, initial_inverse(a, init) if v0 is None else v0,
                                    iterations)
    return apply(_RazaviIteration, a, v0, iterations)[0]


def _iterate_by_autograd(a: Tensor, v: Tensor, iterations: int) -> Tensor:
    """The Razavi steps of the module docstring in plain ops: ``[..., m, m]``."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        p = a @ v
        v = 0.25 * v @ (13 * eye - p @ (15 * eye - p @ (7 * eye - p)))
    return v


def inverse_residual(a: Tensor, v: Tensor) -> Tensor:
    """Spectral norm ||I - A V||_2 per matrix, ``[...]``: how far V is from inverting A."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.matrix_norm(eye - a @ v, ord=2)
