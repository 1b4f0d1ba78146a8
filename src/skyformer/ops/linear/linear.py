"""Linear attention (Katharopoulos et al., ICML 2020, "Transformers are RNNs").

Softmax's similarity exp(q.k) is replaced by phi(q).phi(k) with the feature map
phi(x) = elu(x) + 1 (their eq. (7)), and associativity gives O(N D Dv) time and
O(N D) memory (their eqs. (4)-(6)):

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps).

It does not approximate softmax attention (no parameter makes it converge to it): it is
the simplest linear-cost replacement, the baseline the Nystromformer and Skyformer
papers include; its error is reported against softmax attention, the attention it
replaces. ``eps`` = 1e-6 is the reference implementation's guard of the denominator.

``num_features`` is accepted but has no effect: phi is applied elementwise, so the
feature dimension is the head dim D, and no setting of the paper changes it. The option
exists so that a sweep over the common knob includes linear attention as a constant
baseline (``None`` or any positive integer; invalid values are rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...registry import Capabilities, register
from ..shared.inputs import (
    check_attention_inputs,
    check_generator,
    compute_dtype,
    zero_padded_queries,
)
from ..shared.options import check_nonnegative_float, check_optional_positive_int


@dataclass(frozen=True)
class LinearConfig:
    """Options of linear attention.

    num_features: accepted for uniform sweeps, no effect (the feature dimension of
        elu + 1 is the head dim; module docstring).
    eps: added to the denominator (1e-6, as the reference implementation).
    """

    num_features: int | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_optional_positive_int("linear", "num_features", self.num_features)
        check_nonnegative_float("linear", "eps", self.eps)


def elu_feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. eq. (7))."""
    return F.elu(x) + 1.0


@register(
    "linear",
    LinearConfig,
    Capabilities(target="softmax"),
    summary="linear attention with the elu(x)+1 feature map (Katharopoulos et al.)",
)
def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: LinearConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Linear attention phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1 + eps), O(N).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token (padded keys are dropped
            from both sums).
        generator: unused (deterministic method).
        config: the options (``LinearConfig``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="linear",
                                  query_padding_mask=query_padding_mask)
    check_generator("linear", generator, q.device)
    dtype = q.dtype
    work = compute_dtype(dtype)
    phi_q = elu_feature_map(q.to(work))  # [B, H, Nq, D]
    phi_k = elu_feature_map(k.to(work))  # [B, H, Nk, D]
    if info.key_valid is not None:
        phi_k = phi_k * info.key_valid[:, None, :, None].to(work)
    kv = phi_k.transpose(-1, -2) @ v.to(work)  # [B, H, D, Dv]
    normaliser = phi_q @ phi_k.sum(dim=2)[..., None]  # [B, H, Nq, 1]
    out = (phi_q @ kv) / (normaliser + config.eps)
    return zero_padded_queries(out, info.query_valid).to(dtype)
