"""Skyformer with the [N, m] kernel blocks formed whole, differentiated by autograd.

The same computation as ``skyformer.py`` (same landmarks for the same generator, same
result up to rounding) with O(N m) memory per head: the path the fused one is tested
against, and the "before" of the benchmarks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import with_options
from ..shared.causal_nystrom import refuse_causal_in_materialised
from ..shared.inputs import zero_padded_queries
from ..shared.modified_nystrom import modified_nystrom_factors
from .skyformer import SkyformerConfig, prepare


@with_options(SkyformerConfig, "skyformer")
def materialised_skyformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SkyformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """``skyformer_attention`` with the [N, m] blocks formed whole and autograd backward.

    Args and returns as ``skyformer_attention``, non-causal only (``causal=True`` and
    the causal form's options are refused in a sentence).
    """
    refuse_causal_in_materialised("skyformer", config)
    info, landmarks, scale, work = prepare(
        q, k, v, config, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, generator=generator)
    f = modified_nystrom_factors(q.to(work) * scale, k.to(work) * scale, info, config, landmarks)
    context = f.c_kx.transpose(-1, -2) @ v.to(work)  # [B, H, m, Dv]
    out = f.c_qx @ (f.w @ context)  # [B, H, Nq, Dv]
    return zero_padded_queries(out, info.query_valid).to(q.dtype)
