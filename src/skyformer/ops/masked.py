"""Softmax restricted to a visibility mask, shared by the sparse and projected methods."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_softmax(logits: Tensor, visible: Tensor) -> Tensor:
    """Softmax over the last dim of ``logits`` restricted to ``visible``.

    Args:
        logits: ``[..., N]``.
        visible: bool, broadcastable to ``logits``; False entries get weight exactly 0.
    Returns:
        ``[..., N]``; a row with no visible entry is all zero. Neither values nor
        gradients are ever NaN (hidden entries are filled with the dtype's minimum,
        not -inf, so a fully hidden row is a finite uniform row that is then zeroed).
    """
    filled = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    return torch.softmax(filled, dim=-1) * visible.to(logits.dtype)
