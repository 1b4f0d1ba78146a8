"""The modified Nystrom softmax with the [N, m] blocks formed whole (autograd backward).

Same arguments, landmarks and result (up to rounding) as ``nystrom_softmax_attention``;
the path the fused one is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg import half_sq_norm
from ...registry import with_options
from ..shared.causal_nystrom import refuse_causal_in_materialised
from ..shared.modified_nystrom import modified_nystrom_factors
from .nystrom_softmax import NystromSoftmaxConfig, in_float64_where_needed, normalise, prepare


@with_options(NystromSoftmaxConfig, "nystrom_softmax")
def materialised_nystrom_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: NystromSoftmaxConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """``nystrom_softmax_attention`` with the [N, m] blocks formed whole.

    Args and returns as ``nystrom_softmax_attention`` (computed in float64 where it is:
    ``needs_float64``), non-causal only (``causal=True`` and the causal form's options
    are refused in a sentence).
    """
    return in_float64_where_needed(_materialised, q, k, v, config, generator=generator,
                                   key_padding_mask=key_padding_mask,
                                   query_padding_mask=query_padding_mask)


def _materialised(q: Tensor, k: Tensor, v: Tensor, config: NystromSoftmaxConfig, *,
                  key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
                  generator: torch.Generator | Tensor | None) -> Tensor:
    refuse_causal_in_materialised("nystrom_softmax", config)
    info, landmarks, root, work = prepare(
        q, k, v, config, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, generator=generator)
    q_hat = q.to(work) * root
    k_hat = k.to(work) * root
    f = modified_nystrom_factors(q_hat, k_hat, info, config, landmarks, shift_query_rows=True)

    # E_K up to a common factor: exp(|k^|^2/2 - max over valid keys), 0 for padded keys.
    log_e_k = half_sq_norm(k_hat)  # [B, H, Nk]
    if info.key_valid is not None:
        log_e_k = log_e_k.masked_fill(~info.key_valid[:, None, :], float("-inf"))
    shift = log_e_k.detach().amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    e_k = (log_e_k - shift).exp()[..., None]  # [B, H, Nk, 1]

    v_and_one = torch.cat([v.to(work) * e_k, e_k], dim=-1)  # [B, H, Nk, Dv + 1]
    z = f.w @ (f.c_kx.transpose(-1, -2) @ v_and_one)  # [B, H, m, Dv + 1]
    o = f.c_qx @ z  # [B, H, Nq, Dv + 1]
    bound = f.c_qx @ z[..., -1:].abs()  # >= |denominator|  [B, H, Nq, 1]
    return normalise(o[..., :-1], o[..., -1:], bound, v.to(work), info, config, q.dtype)
