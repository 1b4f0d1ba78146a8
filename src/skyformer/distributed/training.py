"""Helpers for training with a sharded sequence: cutting the shards, and completing the
parameters' gradients.

Under sequence parallelism each rank's backward pass gives the parameters the gradient
of its own shard's share of the loss; the model's gradient is their sum over the group
(over data-parallel groups too, usually divided by their count, as DDP averages).
"""

from __future__ import annotations

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
    process) in one all-reduce, then divide by ``divide_by`` (e.g. the number of
    data-parallel groups). Parameters without a gradient are left alone."""
    group = resolve_group(group, "sum_gradients")
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide_by != 1.0:
        flat /= divide_by
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
