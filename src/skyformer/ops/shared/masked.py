"""Softmax restricted to a visibility mask, shared by the sparse and projected methods."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None) -> Tensor:
    """``masked_softmax(q @ k^T, visible) @ v`` without materialising the logits.

    Through ``scaled_dot_product_attention`` (scale 1: scale ``q`` beforehand), whose
    fused kernels take O(Nq + Nk) memory instead of O(Nq Nk), also with a boolean mask.

    Args:
        q: ``[..., Nq, D]``; k: ``[..., Nk, D]``; v: ``[..., Nk, Dv]``.
        visible: bool broadcastable to ``[..., Nq, Nk]`` (typically ``[..., 1, Nk]``), or
            ``None`` when every key is visible.
    Returns:
        ``[..., Nq, Dv]``; rows with no visible key are zero.
    """
    if visible is None:
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)
    has_key = visible.any(dim=-1, keepdim=True)
    # A row without keys would be NaN: let it attend to everything, then zero it.
    safe = visible | ~has_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=1.0)
    return out * has_key.to(out.dtype)
