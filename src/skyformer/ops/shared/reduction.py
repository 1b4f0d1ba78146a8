"""Sums and maxima over the keys: complete in one process, partial in a shard.

Linear-cost attention methods touch the keys only through sums over them (Skyformer's
C(X_S, K) V, linear attention's phi(K)^T V, the normalisers) and through maxima that
stabilise exponentials. When one process holds the whole sequence those sums are
complete (``WHOLE``); under sequence parallelism (``skyformer.distributed``) each
process holds a shard of the keys, and a subclass completes them across processes.
The methods' evaluation functions take the reduction as an argument, so that the
sequence-parallel forms run the same code as the single-process ones.
"""

from __future__ import annotations

from torch import Tensor


class KeyReduction:
    """Completes a sum or a maximum over the keys (here: nothing to complete)."""

    def sum(self, partial: Tensor) -> Tensor:
        """The sum over every key of a tensor summed over this process's keys."""
        return partial

    def max(self, partial: Tensor) -> Tensor:
        """The maximum over every key (no gradient) of this process's maximum."""
        return partial


WHOLE = KeyReduction()
