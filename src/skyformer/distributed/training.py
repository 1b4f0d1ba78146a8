"""Helpers for training with a sharded sequence: cutting the shards, completing the
parameters' gradients, and ending the run.

Under sequence parallelism each rank's backward pass gives the parameters the gradient
of its own shard's share of the loss; the model's gradient is their sum over the group
(over data-parallel groups too, usually divided by their count, as DDP averages).
"""

from __future__ import annotations

import gc
import math
import numbers
import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layout import comm_device, fingerprint, resolve_group


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s contiguous shard of ``n`` rows cut into
    ``world`` near-equal shards (the first ``n % world`` one row longer)."""
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral)
           for x in (n, world, rank)):
        raise ValueError(f"shard_bounds: n, world and rank must be integers, got n={n!r}, "
                         f"world={world!r}, rank={rank!r}.")
    n, world, rank = int(n), int(world), int(rank)  # numpy's integers too
    if not 0 <= rank < world or n < world:
        raise ValueError(f"shard_bounds: need 0 <= rank < world <= n, got rank={rank}, "
                         f"world={world}, n={n}.")
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


@torch.no_grad()
def sum_gradients(module: nn.Module, group: Any = None, divide_by: float = 1.0) -> None:
    """Sum the gradients of ``module``'s parameters over ``group`` (``None`` = every
    process) and divide by ``divide_by`` (e.g. the number of data-parallel groups).

    A parameter may have a gradient on some ranks only (a head reading a token that one
    shard holds): it counts as zero where missing, as in DDP. The ranks first agree on
    which parameters have one (an all-reduce of one flag each), then sum those in one
    all-reduce; a parameter with a gradient on no rank keeps ``grad = None``. The
    trainable parameters' number, shapes and dtypes must agree across ranks, their
    gradients be dense, and, at a module's first sum, their values agree (checked first,
    by an all-gather of four integers)."""
    if isinstance(divide_by, torch.Tensor) and divide_by.dim() == 0 \
            and not divide_by.is_complex():
        divide_by = divide_by.item()  # a count summed by a collective
    if isinstance(divide_by, bool) or not isinstance(divide_by, numbers.Real) \
            or not 0 < divide_by < math.inf:  # numpy's numbers too
        raise ValueError(f"sum_gradients: divide_by must be a positive number (the number of "
                         f"data-parallel groups to average over, 1 for a sum), got "
                         f"{divide_by!r}.")
    group = resolve_group(group, "sum_gradients", alone="leave sum_gradients out where one "
                          "process trains (there is nothing to sum)")
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    first = module not in _SUMMED  # the values are compared at a module's first sum
    _check_alike(named, group, values=first)
    _SUMMED.add(module)
    params = [p for _, p in named]
    if not params:
        return
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                           device=params[0].device)
    dist.all_reduce(present, group=group)
    params = [p for p, n in zip(params, present.tolist(), strict=True) if n > 0]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide_by != 1.0:
        flat /= float(divide_by)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


# Modules whose parameter values sum_gradients has compared across ranks (at their first
# sum: summed gradients keep alike parameters alike, so later sums need not compare).
_SUMMED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _check_alike(named: list[tuple[str, nn.Parameter]], group: Any, values: bool) -> None:
    """Refuse, on every rank, trainable parameters whose number, shapes or dtypes differ
    between ranks (a head sized by each rank's own data): summed in all-reduces of other
    sizes, they abort the process (gloo) or wait forever; and sparse gradients (an
    embedding built with ``sparse=True``), which the flat sum cannot hold, on any rank.
    With ``values``, parameters whose values differ (built without a common seed): their
    summed gradients would train each rank's model apart, in silence."""
    layout = repr([(tuple(p.shape), str(p.dtype)) for _, p in named])
    sparse = [name for name, p in named if p.grad is not None and p.grad.is_sparse]
    mine = torch.tensor([len(named), zlib.crc32(layout.encode()), len(sparse),
                         int(fingerprint(p for _, p in named)) if values else 0],
                        device=comm_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).tolist()
    with_sparse = [r for r, row in enumerate(rows) if row[2]]
    if with_sparse:
        here = f" (here: {', '.join(sparse)})" if sparse else ""
        raise ValueError(f"sum_gradients: rank(s) {with_sparse} hold sparse gradients{here}, "
                         "which it does not sum; build those embeddings with sparse=False "
                         "(nn.Embedding's default), or sum their gradients yourself.")
    differ = [r for r, row in enumerate(rows) if row[:2] != rows[0][:2]]
    if differ:
        counts = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
        raise ValueError(f"sum_gradients: the trainable parameters differ between ranks: "
                         f"rank(s) {differ} hold another number of them ({counts}) or other "
                         "shapes or dtypes than rank 0; build the model alike on every rank, "
                         "with the same parameters requiring gradients.")
    differ = [r for r, row in enumerate(rows) if row[3] != rows[0][3]]
    if differ:
        raise ValueError(f"sum_gradients: the trainable parameters' values differ between "
                         f"ranks: rank(s) {differ} hold other values than rank 0, so summed "
                         f"gradients would train each rank's model apart; build the model "
                         f"under one seed on every rank (torch.manual_seed(0) before it), or "
                         f"broadcast rank 0's parameters first (torch.distributed.broadcast of "
                         f"each).")


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group`` after a garbage collection; call it
    at the end of a run instead of torch's.

    The autograd graph of a sequence-parallel call holds its process group (the
    backward pass all-reduces over it). A graph caught in a reference cycle keeps the
    group alive after torch's ``destroy_process_group``, until the collection at
    interpreter shutdown, where gloo's worker threads, still releasing finished work,
    can no longer take the GIL and abort the process ("terminate called without an
    active exception", SIGABRT after a run that succeeded; seen on a 2-core machine
    under load). Collecting first frees those graphs while the threads can still
    finish."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group(group)
