"""Accuracy and mean loss of a model on a split, shared out over processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F

from .batches import fetch
from .cache import SplitData
from .distributed import DistInfo, all_reduce_sum
from .model import LRAClassifier


def correct_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many rows of ``logits: [B, C]`` pick their label ``[B]`` (a 0-d tensor): a row
    with a non-finite logit picks none (``argmax`` of NaNs is class 0, so a diverged
    model scored the share of class 0 and could be kept as the best)."""
    picked = logits.argmax(dim=-1) == labels
    return (picked & torch.isfinite(logits).all(dim=-1)).sum()


@torch.no_grad()
def evaluate(model: LRAClassifier, split: SplitData, *, batch_size: int, device: torch.device,
             info: DistInfo, seed: int, limit: int | None = None, max_len: int | None = None,
             autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
             ) -> dict[str, float]:
    """``{"accuracy", "loss", "count"}`` over the first ``limit`` examples (None = all).

    Process r takes examples r, r + world_size, ...; sums are reduced over processes.
    Randomised attention draws from a generator seeded with ``seed``, so an evaluation
    is reproducible and leaves the training generators untouched.
    """
    was_training = model.training
    model.eval()
    total = len(split) if limit is None else min(limit, len(split))
    mine = np.arange(info.rank, total, info.world_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        for start in range(0, len(mine), batch_size):
            tokens, lengths, labels = fetch(split, mine[start:start + batch_size], device,
                                            max_len)
            with autocast():
                logits = model(tokens, lengths, generator=generator)
            sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum").double()
            sums[1] += correct_predictions(logits, labels).double()
            sums[2] += labels.numel()
    finally:  # an error (out of memory, an interruption) leaves the mode as it was
        model.train(was_training)
    sums = all_reduce_sum(sums, info)
    loss, correct, count = sums.tolist()
    return {"accuracy": correct / max(count, 1.0), "loss": loss / max(count, 1.0),
            "count": int(count)}
