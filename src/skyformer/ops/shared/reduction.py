"""Sums and maxima over the keys: complete in one process, partial in a shard.

Linear-cost attention methods touch the keys only through sums over them (Skyformer's
C(X_S, K) V, linear attention's phi(K)^T V, the normalisers) and through maxima that
stabilise exponentials; causal methods, through the same sums over the keys before a
query (prefix sums). When one process holds the whole sequence those sums are
complete (``WHOLE``); under sequence parallelism (``skyformer.distributed``) each
process holds a shard of the keys, and a subclass completes them across processes.
The methods' evaluation functions take the reduction as an argument, so that the
sequence-parallel forms run the same code as the single-process ones.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KeyReduction:
    """Completes a sum or a maximum over the keys (here: nothing to complete)."""

    sharded = False  # whether other processes hold keys (else ``earlier`` is empty)

    def sum(self, partial: Tensor) -> Tensor:
        """The sum over every key of a tensor summed over this process's keys."""
        return partial

    def max(self, partial: Tensor) -> Tensor:
        """The maximum over every key (no gradient) of this process's maximum."""
        return partial

    def earlier(self, partial: Tensor) -> Tensor:
        """The partials of the shards before this process's (keys earlier in the
        sequence), stacked ``[R, *partial.shape]`` in order and differentiable, for the
        prefix sums of causal methods: none in one process (``R = 0``; callers skip the
        work where ``sharded`` is False). The first shard's ``R = 0`` rows stay tied to
        the exchange, so that its backward pass joins the other processes'."""
        return partial[None][:0]

    def earlier_each(self, *partials: Tensor) -> tuple[Tensor, ...]:
        """``earlier`` of each partial, by one exchange: the partials packed into one
        flat tensor (their promoted dtype), the result split back into ``[R, *shape]``
        in each partial's dtype. Every part comes back tied to the one exchange, so a
        constant packed beside partials that record gradients records them too: the
        caller detaches it."""
        stacked = self.earlier(torch.cat([p.reshape(-1) for p in partials]))  # [R, total]
        parts = stacked.split([p.numel() for p in partials], dim=1)
        return tuple(part.reshape(stacked.shape[0], *p.shape).to(p.dtype)
                     for part, p in zip(parts, partials, strict=True))


WHOLE = KeyReduction()
