"""Attention functions that fail, for ``bench`` runs (``module:function@target`` names):
one never timed, one that fails above 16 tokens, one whose output is not finite."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this method always fails")


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention up to 16 tokens; longer inputs fail."""
    if q.shape[-2] > 16:
        raise RuntimeError("this method fails above 16 tokens")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def nan_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention with one NaN in the last head's first row: a method
    whose output is not finite on one head of the batch."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    spoil = torch.zeros_like(out)
    spoil[:, -1, 0, 0] = float("nan")
    return out + spoil  # out of place: SDPA's backward needs its output as it was
