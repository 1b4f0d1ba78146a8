"""Uniform landmark sampling from the rows of [Q; K] (Skyformer eq. (5), Definition 1).

Skyformer sub-samples d rows of the lifted 2n-row matrix [Q; K]. As the reference
implementation does, half of the landmarks come from Q and half from K, drawn per
batch element and shared by the heads. Unlike the reference we

- draw without replacement (a repeated landmark adds nothing to the Nystrom span),
  so that with ``num_features >= 2 n`` every valid row is used exactly once;
- draw only among *valid* rows wherever the padding is (the reference assumes
  right padding);
- take randomness only from the caller's ``generator``.

Sampling is a top-k of uniform scores with padded rows scored out of reach. Each
score is a counter-based draw indexed by the batch element and the row's rank among
the valid rows (``rng.row_uniform``): a sequence draws the same landmarks whatever its
padding (left, right, holes), its padded width and the other sequences of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .rng import random_key, row_uniform, stream

_OUT_OF_REACH = 2.0  # uniform scores lie in [0, 1)


@dataclass(frozen=True)
class Landmarks:
    """Indices of the sampled rows of Q and K, with slots that hold no landmark."""

    query_index: Tensor  # [B, mq] long
    query_live: Tensor  # [B, mq] bool
    key_index: Tensor  # [B, mk] long
    key_live: Tensor  # [B, mk] bool

    @property
    def live(self) -> Tensor:
        """``[B, mq + mk]`` bool, in the order [query landmarks, key landmarks]."""
        return torch.cat([self.query_live, self.key_live], dim=1)


def _pick(scores: Tensor, valid: Tensor | None, count: int) -> tuple[Tensor, Tensor]:
    if valid is not None:
        scores = scores.masked_fill(~valid, _OUT_OF_REACH)
    count = min(count, scores.shape[1])
    picked, index = scores.topk(count, dim=1, largest=False, sorted=False)
    return index, picked < _OUT_OF_REACH


def uniform_landmarks(
    num_features: int,
    *,
    batch: int,
    query_len: int,
    key_len: int,
    query_valid: Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
    generator: torch.Generator | Tensor | None = None,
) -> Landmarks:
    """Sample ``ceil(m/2)`` rows of Q and ``floor(m/2)`` rows of K without replacement.

    Each side is capped by its number of valid rows; unused slots are marked dead.
    ``generator``: a generator or a random key (``rng.random_key``).
    """
    key = random_key(generator, device)
    q_scores = row_uniform(stream(key, "landmarks/queries"), query_valid, batch, query_len)
    k_scores = row_uniform(stream(key, "landmarks/keys"), key_valid, batch, key_len)
    q_index, q_live = _pick(q_scores, query_valid, (num_features + 1) // 2)
    k_index, k_live = _pick(k_scores, key_valid, num_features // 2)
    return Landmarks(q_index, q_live, k_index, k_live)
