"""Which examples each optimizer step sees, reproducibly and resumably.

Epoch ``e`` visits the training split in the order of a permutation drawn from
``numpy.random.default_rng([seed, e])``, in global batches of ``batch_size``
(the last partial batch of an epoch is dropped). A ``Position`` (epoch, batch) is all
it takes to resume the order exactly. With several processes and gradient
accumulation, a global batch is cut into ``world_size * grad_accum`` equal
micro-batches: process r takes micro-batches ``r * grad_accum .. (r + 1) * grad_accum - 1``,
so the examples of a step (and, for a mean loss, its gradient) do not depend on how
the work is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .cache import SplitData


@dataclass(frozen=True)
class Position:
    """The next global batch: ``batch`` of epoch ``epoch``."""

    epoch: int = 0
    batch: int = 0


class BatchOrder:
    """Global batches of a split, a fresh seeded permutation per epoch."""

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        if batch_size > num_examples:
            raise ValueError(f"the batch size ({batch_size}) exceeds the {num_examples} "
                             "training examples.")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = num_examples // batch_size
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._epoch = epoch
        return self._perm

    def batch(self, position: Position) -> np.ndarray:
        """Example indices ``[batch_size]`` of the global batch at ``position``."""
        start = position.batch * self.batch_size
        return self.permutation(position.epoch)[start:start + self.batch_size]

    def next(self, position: Position) -> Position:
        if position.batch + 1 < self.batches_per_epoch:
            return Position(position.epoch, position.batch + 1)
        return Position(position.epoch + 1, 0)


def micro_batches(indices: np.ndarray, rank: int, world_size: int, grad_accum: int
                  ) -> list[np.ndarray]:
    """This process's ``grad_accum`` micro-batches of a global batch."""
    parts = world_size * grad_accum
    if len(indices) % parts:
        raise ValueError(f"the batch size ({len(indices)}) must be divisible by processes x "
                         f"accumulation steps ({world_size} x {grad_accum}).")
    chunks = np.split(indices, parts)
    return chunks[rank * grad_accum:(rank + 1) * grad_accum]


def fetch(split: SplitData, indices: np.ndarray, device: torch.device, max_len: int | None = None
          ) -> tuple[Tensor, Tensor, Tensor]:
    """``tokens [b, S, N]`` long, ``lengths [b, S]`` long, ``labels [b]`` long on ``device``.

    ``max_len`` truncates the documents to their first ``max_len`` tokens.
    """
    order = np.argsort(indices, kind="stable")  # ascending reads are kinder to memory maps
    rows = indices[order]
    tokens = np.asarray(split.tokens[rows])
    lengths = np.asarray(split.lengths[rows]).astype(np.int64)
    labels = np.asarray(split.labels[rows])
    back = np.argsort(order, kind="stable")
    tokens, lengths, labels = tokens[back], lengths[back], labels[back]
    if max_len is not None and max_len < tokens.shape[-1]:
        tokens = tokens[..., :max_len]
        lengths = np.minimum(lengths, max_len)
    return (_to_device(tokens.astype(np.int64), device), _to_device(lengths, device),
            _to_device(labels.astype(np.int64), device))


def _to_device(array: np.ndarray, device: torch.device | str) -> Tensor:
    """``array`` as a tensor on ``device``; to a GPU through page-locked memory, so the
    copy does not make the host wait for the work queued before it."""
    t = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
