"""The collectives of sequence-parallel attention, differentiable where values flow,
and counted: every payload sent goes through here, so its bytes can be measured.

``all_reduce_sum`` is differentiable: with y = sum_r x_r on every rank and each rank's
loss L_r computed from its copy of y, dL/dx_r = sum_r' dL_r'/dy, an all-reduce of the
gradients (``AllReduceSum.backward``), itself differentiable the same way, so that
second derivatives by reverse over reverse cross the ranks too; forward mode
(``jvp``) all-reduces the tangents. ``vmap`` (``jacfwd``, ``jacrev``, ``hessian``) is
refused: each rank would map over directions of its own shard. The autograd engine
runs the backward passes of identical graphs in the same order on every rank, so the
backward collectives match up.
``all_reduce_max`` and ``all_gather`` carry constants (shifts, shapes, landmark keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(eq=False)  # compared by identity: nested blocks' counters may hold equal calls
class Traffic:
    """Payload bytes each rank contributed to collectives, by kind: ``all_reduce``
    counts the tensor reduced (a ring all-reduce moves 2 (P-1)/P times that per rank),
    ``all_gather`` the rank's own tensor (it receives P-1 of them)."""

    calls: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size for _, _, size in self.calls)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _, size in self.calls:
            out[kind] = out.get(kind, 0) + size
        return out


_COUNTERS: list[Traffic] = []


@contextmanager
def count_communication() -> Iterator[Traffic]:
    """Count the collectives of sequence-parallel attention made inside the block
    (forward and backward passes alike; a nested block counts its own calls, which the
    outer one counts too)::

        with count_communication() as traffic:
            loss = layer(x_shard).sum(); loss.backward()
        traffic.bytes
    """
    traffic = Traffic()
    _COUNTERS.append(traffic)
    try:
        yield traffic
    finally:
        _COUNTERS.remove(traffic)


def _record(kind: str, t: Tensor) -> None:
    for traffic in _COUNTERS:
        traffic.calls.append((kind, tuple(t.shape), t.numel() * t.element_size()))


def _reduce(t: Tensor, op: Any, group: Any) -> Tensor:
    out = t.detach().clone(memory_format=torch.contiguous_format)
    _record("all_reduce", out)
    dist.all_reduce(out, op=op, group=group)
    return out


class AllReduceSum(torch.autograd.Function):
    """y = sum over the group's ranks of x; backward: the gradients' sum (module doc);
    forward mode: the tangents' sum (the sum is linear)."""

    @staticmethod
    def forward(x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        return _reduce(x, dist.ReduceOp.SUM, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        # Through this Function again, not ``_reduce``: the gradient is itself a sum over
        # the ranks, so a differentiated backward (create_graph=True: Hessian-vector
        # products, gradient penalties) all-reduces its own gradient in turn.
        return AllReduceSum.apply(grad, ctx.group), None

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, _: Any) -> Tensor:
        # Through this Function too: tangents batched by jacfwd or hessian then reach
        # ``vmap`` below and its sentence, not the collective's missing batching rule.
        return AllReduceSum.apply(tangent, ctx.group)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, group: Any) -> tuple[Tensor, int]:
        # Under jacfwd, jacrev and hessian each rank maps over the directions of its own
        # shard (as many as its rows); summing the ranks' i-th ones would add unrelated
        # directions, and shards of different lengths would not even agree on the count.
        raise RuntimeError(_NO_VMAP)


_NO_VMAP = (
    "sequence-parallel attention cannot run under torch.func.vmap where the mapped tensors "
    "reach the sums across ranks (as in jacfwd, jacrev and hessian): each rank would map "
    "over directions of its own shard, which the sums would mix. Across processes use "
    "torch.func.jvp (each rank passing its shard of one tangent of the whole sequence), "
    "torch.func.grad, and torch.func.jvp of torch.func.grad for Hessian-vector products; "
    "or take Jacobians in one process.")


def all_reduce_sum(x: Tensor, group: Any) -> Tensor:
    """Sum of ``x`` over the ranks of ``group``, differentiable (a new tensor)."""
    return AllReduceSum.apply(x, group)


def all_reduce_max(x: Tensor, group: Any) -> Tensor:
    """Elementwise maximum of ``x`` over the ranks of ``group`` (no gradient)."""
    return _reduce(x, dist.ReduceOp.MAX, group)


def all_gather(x: Tensor, group: Any) -> Tensor:
    """Every rank's ``x`` (same shape on all), stacked: ``[P, *x.shape]`` (no gradient)."""
    x = x.detach().contiguous()
    _record("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)
