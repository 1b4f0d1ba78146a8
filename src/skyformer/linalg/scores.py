"""Materialised attention matrices ``[B, H, Nq, Nk]``: the exact targets, whole.

For analyses and naive references on small inputs (O(Nq Nk) memory); the attention
functions never form them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .kernels import gaussian_kernel_block


def logit_scale(head_dim: int, scale: float | None = None) -> float:
    """s, the factor of the logits q_i . k_j: ``scale`` or, by default, 1/sqrt(p) (the
    softmax attention of Vaswani et al.; its square root scales the inputs of the
    methods that write softmax as a kernel of scaled q and k)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def kernel_scale(head_dim: int, scale: float | None = None) -> float:
    """sqrt(s), the factor the inputs are scaled by so that the Gaussian kernel is
    exp(-s |q_i - k_j|^2 / 2); s = ``scale`` or, by default, 1/sqrt(p): p^(-1/4), the
    bandwidth p^(1/4) of Skyformer eq. (3), C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p)))."""
    return float(head_dim) ** -0.25 if scale is None else math.sqrt(scale)


def softmax_scores(
    q: Tensor,
    k: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> Tensor:
    """The softmax attention matrix softmax(scale Q K^T) ``[B, H, Nq, Nk]`` (rows sum to 1).

    ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``key_padding_mask: [B, Nk]`` (True = real);
    ``scale`` ``None`` = 1/sqrt(D). Rows with no visible key are zero.
    """
    s = logit_scale(q.shape[-1], scale)
    logits = (q @ k.transpose(-1, -2)) * s
    visible = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.tril(visible)
    visible = visible.expand(q.shape[0], 1, -1, -1)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def gaussian_scores(
    q: Tensor, k: Tensor, *, key_padding_mask: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The kernelized attention matrix C ``[B, H, Nq, Nk]`` (Skyformer eq. (3)),
    exp(-s |q_i - k_j|^2 / 2) with s = ``scale`` (``None``: 1/sqrt(D)).

    Columns of padded keys (and, with ``causal``, entries j > i) are zero; no other
    entry is (none is flushed: rows of far queries hold tiny entries, not zeros).
    """
    scale = kernel_scale(q.shape[-1], scale)
    c = gaussian_kernel_block(q * scale, k * scale, flush=False)
    if key_padding_mask is not None:
        c = c * key_padding_mask[:, None, None, :].to(c.dtype)
    if causal:
        c = torch.tril(c)
    return c
