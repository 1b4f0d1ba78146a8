"""Exact kernelized attention's weights formed from its exponents: ``C_ij exp(m_ij)``
with ``C_ij = exp(-s |q_i - k_j|^2 / 2)`` (Skyformer eq. (3)) and the method's own masks
(``masked.attention_bias``: ``attn_mask``, key padding, causal), O(Nq Nk D) where the
identity appended to the values (``skyformer.weights``) costs O(Nq Nk^2). Rows of padded
queries are zero, as the method's output."""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg import kernel_scale
from ...linalg.kernels import gaussian_exponent, half_sq_norm
from ..shared.centring import keys_mean
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from ..shared.masked import attention_bias
from .kernelized import KernelizedConfig


def kernelized_weights(q: Tensor, k: Tensor, config: KernelizedConfig, *,
                       key_padding_mask: Tensor | None = None,
                       query_padding_mask: Tensor | str | None = "auto",
                       attn_mask: Tensor | None = None) -> Tensor:
    """The weights ``[B, H, Nq, Nk]`` that ``kernelized_attention(q, k, v, config, ...)``
    applies to ``v`` (``out = weights @ v``; not normalised), in float64 for float64
    inputs, else float32. The keys' mean is taken out of q and k before they are scaled
    (the kernel does not change), so that the distances do not cancel at large offsets;
    blocked entries are 0 whatever the padded positions hold."""
    info = check_attention_inputs(q, k, k, key_padding_mask, method="kernelized",
                                  query_padding_mask=query_padding_mask)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    root = kernel_scale(info.head_dim, config.scale)  # sqrt(s)
    x1, x2 = q.to(work), k.to(work)
    shift = keys_mean(x2, info.key_valid)
    if shift is not None:
        x1, x2 = x1 - shift, x2 - shift
    x1, x2 = x1 * root, x2 * root
    exponent = gaussian_exponent(x1, x2, half_sq_norm(x1), half_sq_norm(x2)).clamp_max(0.0)
    given = attn_mask if attn_mask is not None else torch.ones(1, dtype=torch.bool,
                                                               device=q.device)
    bias = attention_bias(given, info.key_valid, config.causal, tuple(exponent.shape), work,
                          q.device, "kernelized")
    weights = torch.where(bias == float("-inf"), 0.0, torch.exp(exponent + bias))
    return zero_padded_queries(weights, info.query_valid)
