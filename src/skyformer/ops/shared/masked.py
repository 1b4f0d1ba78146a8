"""Softmax restricted to a visibility mask (the sparse and projected methods), and
SDPA-style attention masks as one additive bias (the exact methods)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.tracing import strides_hold
from .inputs import check_device
from .sdpa import sdpa


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
        return sdpa(q, k, v, scale=1.0)
    has_key = visible.any(dim=-1, keepdim=True)
    # A row without keys would be NaN: let it attend to everything, then zero it.
    safe = visible | ~has_key
    out = sdpa(q, k, v, attn_mask=safe, scale=1.0)
    return out * has_key.to(out.dtype)


def attention_bias(attn_mask: Tensor, key_valid: Tensor | None, causal: bool,
                   shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   method: str) -> Tensor:
    """One additive bias ``[B|1, H|1, Nq, Nk]`` from an SDPA-style ``attn_mask`` (bool:
    True = may attend; float: added to the logits), the key padding and the causal
    pattern; blocked entries are ``-inf``.

    ``attn_mask`` must broadcast to ``shape`` = ``[B, H, Nq, Nk]`` and be on the inputs'
    ``device``; checked here with a sentence.
    """
    check_device(method, "attn_mask", attn_mask, device)
    _check_broadcasts(attn_mask, tuple(shape), method)
    attn_mask = _broadcast_dims_as_one(attn_mask)
    if attn_mask.dtype == torch.bool:
        bias = torch.where(attn_mask, 0.0, float("-inf")).to(dtype)
    elif attn_mask.is_floating_point():
        bias = attn_mask.to(dtype)
    else:
        raise TypeError(
            f"{method}: attn_mask must be bool (True = may attend) or a float additive mask, "
            f"got {attn_mask.dtype}."
        )
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    bias = bias.expand(*bias.shape[:-1], shape[-1])  # a column [..., Nq, 1] over every key
    blocked = float("-inf")
    if key_valid is not None:
        bias = torch.where(key_valid[:, None, None, :], bias, blocked)
    if causal:
        tril = torch.ones(*shape[-2:], dtype=torch.bool, device=bias.device).tril()
        bias = torch.where(tril, bias, blocked)
    return bias


def _broadcast_dims_as_one(attn_mask: Tensor) -> Tensor:
    """``attn_mask`` with each dim it repeats by stride 0 (a key padding row expanded
    over the queries, ``[B, 1, Nq, Nk]`` as ``skyformer.hf`` builds it) cut to size 1:
    the same mask under broadcasting, so that the bias built from it and kept for the
    backward pass is one row per batch element, not ``[B, 1, Nq, Nk]``. Not in a
    program being recorded (``strides_hold``): it would cut any mask given to it later."""
    if not strides_hold():
        return attn_mask
    for dim, (size, stride) in enumerate(zip(attn_mask.shape, attn_mask.stride(), strict=True)):
        if size > 1 and stride == 0:
            attn_mask = attn_mask.narrow(dim, 0, 1)
    return attn_mask


def shared_key_row(attn_mask: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """The keys a boolean ``attn_mask`` lets every query of every head see, ``[B, Nk]``
    bool (expanded), where it is one row over the keys for all of them: a key padding
    mask, ``[B|1, 1, 1, Nk]``, or ``[B, 1, Nq, Nk]`` repeated over the queries by stride
    0 as ``skyformer.hf`` builds it. None for any other mask: float, a row per query or
    per head, one that does not broadcast to ``shape`` = ``[B, H, Nq, Nk]``, and a
    stride-0 repeat in a program being recorded (``strides_hold``), which would read
    one row of any mask given to it later."""
    if attn_mask.dtype != torch.bool or not mask_broadcasts(attn_mask, shape) \
            or attn_mask.dim() == 0:
        return None
    row = _broadcast_dims_as_one(attn_mask)
    if any(size != 1 for size in row.shape[-3:-1]):  # heads and queries: one of each
        return None
    batch = row.shape[0] if row.dim() == 4 else 1
    return row.reshape(batch, row.shape[-1]).expand(shape[0], shape[3])


def mask_broadcasts(attn_mask: object, shape: tuple[int, ...]) -> bool:
    """Whether ``attn_mask`` is a tensor of at most 4 dims that broadcasts to ``shape``
    ``[B, H, Nq, Nk]``, as SDPA's masks do."""
    try:
        return isinstance(attn_mask, Tensor) and attn_mask.dim() <= 4 \
            and torch.broadcast_shapes(attn_mask.shape, shape) == shape
    except RuntimeError:
        return False


def _check_broadcasts(attn_mask: Tensor, shape: tuple[int, ...], method: str) -> None:
    """``attn_mask`` broadcasts to ``shape`` ``[B, H, Nq, Nk]``, or a sentence."""
    if not (mask_broadcasts(attn_mask, shape) and attn_mask.dim() >= 1):
        got = tuple(attn_mask.shape) if isinstance(attn_mask, Tensor) else type(attn_mask)
        raise ValueError(
            f"{method}: attn_mask must broadcast to [B, H, Nq, Nk] = {list(shape)}, got {got}."
        )


def biased_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, *, scale: float,
                     dropout_p: float = 0.0) -> Tensor:
    """``softmax(scale q k^T + bias) v`` through SDPA, rows whose every bias entry is
    ``-inf`` (no key) returning zeros, not NaN; a NaN entry stays NaN, as in SDPA.
    ``bias`` from ``attention_bias``."""
    has_key = (bias != float("-inf")).any(dim=-1, keepdim=True)  # NaN != -inf: kept
    safe = torch.where(has_key, bias, torch.zeros((), dtype=bias.dtype, device=bias.device))
    out = sdpa(q, k, v, attn_mask=safe, dropout_p=dropout_p, scale=scale)
    return out * has_key.to(out.dtype)
