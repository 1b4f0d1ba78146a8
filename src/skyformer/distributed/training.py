"""Helpers for training with a sharded sequence: cutting the shards, completing the
parameters' gradients, and ending the run.

Under sequence parallelism each rank's backward pass gives the parameters the gradient
of its own shard's share of the loss; the model's gradient is their sum over the group
(over data-parallel groups too, usually divided by their count, as DDP averages).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layout import resolve_group


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s contiguous shard of ``n`` rows cut into
    ``world`` near-equal shards (the first ``n % world`` one row longer)."""
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
    all-reduce; a parameter with a gradient on no rank keeps ``grad = None``."""
    group = resolve_group(group, "sum_gradients")
    params = [p for p in module.parameters() if p.requires_grad]
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
        flat /= divide_by
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


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
