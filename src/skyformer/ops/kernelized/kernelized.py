"""Exact kernelized (Gaussian) attention, Skyformer section 3.1.

    out = C V,   C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))),   p = head dim.

Fast path without an n x n matrix, through the fused softmax kernels of
``scaled_dot_product_attention`` (O(N) memory). With q^ = q p^-1/4, k^ = k p^-1/4:

    C_ij = exp(q^.k^_j - |k^_j|^2/2 - |q^_i|^2/2).

Augment q' = [q^, 1, |q^|^2/2], k'_j = [k^_j, -|k^_j|^2/2, 0], and add one extra key
k'_0 = [0, 0, 1] whose value is a one-hot extra channel (real values get 0 there).
Then q'.k'_j - q'.k'_0 = log C_ij <= 0, so softmax over the N+1 keys gives

    O_i[:D] = sum_j C_ij v_j / (1 + sum_j C_ij),   O_i[D] = 1 / (1 + sum_j C_ij),

and O_i[:D] / O_i[D] = sum_j C_ij v_j exactly. The extra key is always the row
maximum, so the softmax's own max-shift is exactly the Gaussian's normaliser and
nothing can overflow. Padded keys get k' = [0, -1e6, 0]: weight exp(-1e6) = 0.
Causal masking prepends the extra key and one dummy query, so that SDPA's causal
mask lets query i see the extra key and real keys 0..i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg import KERNELS, gaussian_kernel_matmul, half_sq_norm, kernel_scale
from ...registry import Capabilities, register
from ..shared.inputs import check_attention_inputs, compute_dtype, zero_padded_queries
from ..shared.masked import attention_bias
from ..shared.options import check_bool, check_choice, check_scale

_MASKED_LOGIT = -1e6


@dataclass(frozen=True)
class KernelizedConfig:
    """Options of exact kernelized attention.

    scale: s of the Gaussian kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(head dim)
        (Skyformer eq. (1)); a model that pre-scales its queries passes its own.
    causal: query i attends to keys j <= i (requires Nq == Nk).
    kernel: ``"torch"`` (the SDPA augmentation below), ``"triton"`` (the fused Gaussian
        block product of ``linalg.kernel_matmul`` with every key as a column: a
        flash-style kernel, O(N) memory, no mask other than padding, not causal) or
        ``"auto"`` (``"torch"``).
    """

    scale: float | None = None
    causal: bool = False
    kernel: str = "auto"

    def __post_init__(self) -> None:
        check_scale("kernelized", self.scale)
        check_bool("kernelized", "causal", self.causal)
        check_choice("kernelized", "kernel", self.kernel, KERNELS)


@register(
    "kernelized",
    KernelizedConfig,
    Capabilities(target="gaussian", exact=True, causal=True, cross_attention=True,
                 attn_mask=True),
    summary="exact Gaussian kernelized attention C V (Skyformer eq. (1)), O(N) memory",
)
def kernelized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: KernelizedConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Exact Gaussian kernelized attention ``C V`` (Skyformer section 3.1).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: unused (exact method).
        attn_mask: SDPA's mask, broadcastable to ``[B, H, Nq, Nk]``: bool (False: weight
            0) or float m_ij (weights C_ij exp(m_ij)); combined with padding and causal.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types are computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="kernelized",
                                  query_padding_mask=query_padding_mask)
    causal = config.causal
    if causal and info.query_len != info.key_len:
        raise ValueError(
            f"kernelized: causal=True needs as many queries as keys, got Nq={info.query_len}, "
            f"Nk={info.key_len}."
        )
    dtype = q.dtype
    work = compute_dtype(dtype)
    scale = kernel_scale(info.head_dim, config.scale)
    if config.kernel == "triton":
        if causal or attn_mask is not None:
            raise ValueError('kernelized: kernel="triton" takes no attn_mask and no causal '
                             'mask (padding only); use kernel="torch" for those.')
        ks = k.to(work) * scale
        k_norm = half_sq_norm(ks)
        if info.key_valid is not None:
            k_norm = k_norm.masked_fill(~info.key_valid[:, None, :], float("inf"))
        out = gaussian_kernel_matmul(q.to(work), ks, v.to(work), k_norm, scale=scale,
                                     kernel="triton")  # [B, H, Nq, Dv]
        return zero_padded_queries(out, info.query_valid).to(dtype)
    qs = q.to(work) * scale
    ks = k.to(work) * scale
    vw = v.to(work)

    q_aug = torch.cat([qs, torch.ones_like(qs[..., :1]), half_sq_norm(qs)[..., None]], dim=-1)
    k_bias = -half_sq_norm(ks)
    if info.key_valid is not None:
        ks = ks * info.key_valid[:, None, :, None].to(work)
        k_bias = torch.where(info.key_valid[:, None, :], k_bias, _MASKED_LOGIT)
    k_aug = torch.cat([ks, k_bias[..., None], torch.zeros_like(ks[..., :1])], dim=-1)

    b, h, _, dv = vw.shape
    d_aug = q_aug.shape[-1]
    extra_key = torch.zeros((b, h, 1, d_aug), dtype=work, device=q.device)
    extra_key[..., -1] = 1.0
    # Values padded to the key width (the fused CPU kernels need equal head dims),
    # with the one-hot channel at index dv.
    width = max(dv + 1, d_aug)
    v_aug = F.pad(vw, (0, width - dv))
    extra_value = torch.zeros((b, h, 1, width), dtype=work, device=q.device)
    extra_value[..., dv] = 1.0
    if d_aug < width:
        q_aug = F.pad(q_aug, (0, width - d_aug))
        k_aug = F.pad(k_aug, (0, width - d_aug))
        extra_key = F.pad(extra_key, (0, width - d_aug))

    if attn_mask is not None:
        bias = attention_bias(attn_mask, None, causal, info.query_len, info.key_len, work,
                              "kernelized")
        bias = F.pad(bias.expand(*bias.shape[:2], info.query_len, info.key_len), (0, 1))
        out = F.scaled_dot_product_attention(  # the extra key (last column) always visible
            q_aug, torch.cat([k_aug, extra_key], dim=2),
            torch.cat([v_aug, extra_value], dim=2), attn_mask=bias, scale=1.0,
        )
    elif causal:
        dummy_query = torch.zeros_like(q_aug[..., :1, :])
        out = F.scaled_dot_product_attention(
            torch.cat([dummy_query, q_aug], dim=2),
            torch.cat([extra_key, k_aug], dim=2),
            torch.cat([extra_value, v_aug], dim=2),
            scale=1.0,
            is_causal=True,
        )[..., 1:, :]
    else:
        out = F.scaled_dot_product_attention(
            q_aug,
            torch.cat([k_aug, extra_key], dim=2),
            torch.cat([v_aug, extra_value], dim=2),
            scale=1.0,
        )
    out = out[..., :dv] / out[..., dv : dv + 1]
    return zero_padded_queries(out, info.query_valid).to(dtype)
