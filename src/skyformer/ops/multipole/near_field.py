"""The multipole near field, block by block, without keeping its score blocks.

Each block g of ``s`` queries (one cluster, ``layout.block_layout``) meets the
cluster's ``t`` near keys exactly:

    l = q k^T + b,   M = max_j l (per query, no gradient),   out = exp(l - M) [v, 1]

Formed whole, the scores and their exponentials are 1.5 N t floats per head, kept for the
backward pass. Here groups of blocks small enough to stay in cache are computed at
once and the backward pass rebuilds them (as ``linalg.kernel_matmul`` does for the
[N, m] kernel blocks), with E = exp(l - M) and G the output gradient:

    dE = (G [v, 1]^T) * E,   dq = dE k,   dk = dE^T q,   db = 1^T dE,   d[v, 1] = E^T G.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...amp import autocast_off
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import first_order_backward, functional_ops_only
from ...linalg.kernel_matmul import chunk_starts
from ...linalg.kernels import overwrite_allowed
from ...linalg.vmap import vmap_into_batch

# Elements of one group of score blocks: 2^18 float32 = 1 MiB, as kernel_matmul's chunks.
CHUNK_ELEMENTS = 2**18


def _scores(q: Tensor, kt: Tensor, bias: Tensor, top: Tensor | None) -> tuple[Tensor, Tensor]:
    """exp(q k^T + b - M) for one group and M (0 for rows without a finite score)."""
    e = torch.baddbmm(bias, q, kt)  # [g, s, t]
    if top is None:
        top = e.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    if overwrite_allowed():
        return e.sub_(top).exp_(), top
    return (e - top).exp(), top  # selective checkpointing may keep baddbmm's output


def _write(target: Tensor, rows: slice, op: Callable[..., Tensor], *args: Any,
           **kwargs: Any) -> None:
    """``target[rows] = op(*args, **kwargs)``: eagerly into the rows (``out=``, no
    temporary); traced, assigned, as torch 2.11's dynamo fixed the length in the graph
    at a product written into a view, so every new length compiled again."""
    if torch.compiler.is_compiling():
        target[rows] = op(*args, **kwargs)
    else:
        op(*args, **kwargs, out=target[rows])


class _NearField(torch.autograd.Function):
    """(M, exp(l - M) V) per block; see the module docstring. M carries no gradient."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, bias: Tensor, v: Tensor,  # type: ignore[override]
                chunk: int) -> tuple[Tensor, Tensor]:
        groups, s, _ = q.shape
        out = q.new_empty(groups, s, v.shape[-1])
        top = q.new_empty(groups, s, 1)
        kt = k.transpose(1, 2)
        for g in chunk_starts(groups, chunk):  # one group keeps a compiled N symbolic
            rows = slice(g, g + chunk)
            e, top[rows] = _scores(q[rows], kt[rows], bias[rows], None)
            _write(out, rows, torch.bmm, e, v[rows])
        return top, out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, bias, v, chunk = inputs
        top, _ = output
        ctx.save_for_backward(q, k, bias, v, top)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(_NearField.apply, info, in_dims, args, tensors=(0, 1, 2, 3),
                               outputs=2)

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, _: Tensor | None, grad: Tensor) -> tuple[Tensor | None, ...]:
        # in the inputs' dtype, also where the backward pass runs under autocast (the
        # rebuilt scores would be half and the products' outputs are not)
        with autocast_off(grad.device.type):
            return _NearField._gradients(ctx, grad)

    @staticmethod
    def _gradients(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, bias, v, top = ctx.saved_tensors
        chunk = ctx.chunk
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        db, dv = torch.empty_like(bias), torch.empty_like(v)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        for g in chunk_starts(q.shape[0], chunk):
            rows = slice(g, g + chunk)
            e, _ = _scores(q[rows], kt[rows], bias[rows], top[rows])
            _write(dv, rows, torch.bmm, e.transpose(1, 2), grad[rows])
            de = torch.bmm(grad[rows], vt[rows]).mul_(e)  # [g, s, t]
            _write(dq, rows, torch.bmm, de, k[rows])
            _write(dk, rows, torch.bmm, de.transpose(1, 2), q[rows])
            _write(db, rows, torch.sum, de, dim=1, keepdim=True)
        return dq, dk, db, dv, None


def near_field(q: Tensor, k: Tensor, bias: Tensor, v: Tensor, *, chunk: int | None = None
               ) -> tuple[Tensor, Tensor]:
    """Exact near-field sums of query blocks against their key blocks.

    Args:
        q: ``[G, s, D]`` query rows of each block; k: ``[G, t, D]`` its near keys.
        bias: ``[G, 1, t]`` per-key logit bias (-inf: no key); v: ``[G, t, R]``.
        chunk: blocks per group (default: about 1 MiB of scores).
    Returns:
        (M ``[G, s, 1]``, no gradient; exp(q k^T + b - M) v ``[G, s, R]``), differentiable
        in q, k, bias and v; the scores are rebuilt in the backward pass, not stored.
    """
    groups, s, _ = q.shape
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // max(1, s * k.shape[1]))
    bias = bias.expand(groups, 1, k.shape[1]).contiguous()
    if functional_ops_only():  # export, forward-mode AD (functional_ops.py)
        e = torch.baddbmm(bias, q, k.transpose(1, 2))
        top = e.detach().amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        return top, (e - top).exp() @ v
    return apply(_NearField, q.contiguous(), k.contiguous(), bias, v.contiguous(), chunk)
