"""Skyformer: kernelized attention approximated by the modified Nystrom method.

Skyformer (Chen et al., NeurIPS 2021) eqs. (4)-(6) with the Lemma 3 inverse:

    out = C(Q, X_S) [ W ( C(X_S, K) V ) ],   C(x, y) = exp(-|x - y|^2 / (2 sqrt(p))),

where X_S are m landmarks drawn uniformly from the valid rows of [Q; K] and W the
regularised, normalised iterative inverse of C(X_S, X_S). Differences from the
reference implementation (deliberate): the kernel scale uses the input's head dim
(the reference hard-codes 32), the inverse's starting point is computed per matrix
(the reference takes a maximum over the whole batch), landmarks are drawn among the
valid rows wherever the padding is (the reference assumes right padding), without
replacement, and nothing defaults to CUDA.

Evaluation: the [N, m] blocks C(Q, X_S) and C(K, X_S) are never held whole; both
products go through ``gaussian_kernel_matmul`` (row chunks, a backward pass that
rebuilds each chunk), so time is O(N m D) and memory O(N D) beyond the inputs.
``materialised_skyformer_attention`` is the same computation with the blocks formed
whole and differentiated by autograd: the path the fused one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..inputs import (
    AttentionInputs,
    check_attention_inputs,
    check_generator,
    compute_dtype,
    zero_padded_queries,
)
from ..linalg import gaussian_kernel_matmul
from ..registry import Capabilities, register
from ..sketch import Landmarks
from .kernelized import kernel_scale
from .modified_nystrom import (
    NystromOptions,
    modified_nystrom_factors,
    nystrom_core,
    sample_landmarks,
)


@dataclass(frozen=True)
class SkyformerConfig(NystromOptions):
    """Options of Skyformer; defaults are the paper's (128 features, gamma 0.1, 6 iterations)."""

    def __post_init__(self) -> None:
        self.validate("skyformer")


@register(
    "skyformer",
    SkyformerConfig,
    Capabilities(target="gaussian", randomized=True),
    summary="modified Nystrom approximation of kernelized attention (Skyformer)",
)
def skyformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    num_features: int = SkyformerConfig.num_features,
    gamma: float = SkyformerConfig.gamma,
    pinv: str = SkyformerConfig.pinv,
    pinv_iterations: int = SkyformerConfig.pinv_iterations,
    pinv_init: str = SkyformerConfig.pinv_init,
) -> Tensor:
    """Skyformer attention, an O(N m) approximation of ``kernelized_attention``.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token. Padded rows are never
            landmarks and padded keys get zero weight.
        generator: draws the landmarks (the only randomness).
        num_features, gamma, pinv, pinv_iterations, pinv_init: see ``SkyformerConfig``.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    options = SkyformerConfig(num_features, gamma, pinv, pinv_iterations, pinv_init)
    info, landmarks, scale, work = _prepare(q, k, v, key_padding_mask, generator, options)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    core = nystrom_core(qw, kw, scale, options, landmarks)
    key_valid = None if info.key_valid is None else info.key_valid[:, None, :]  # [B, 1, Nk]
    context = gaussian_kernel_matmul(
        kw, core.x, vw, core.x_norm, scale=scale, row_valid=key_valid, transpose=True
    )  # C(X_S, K) V: [B, H, m, Dv]
    out = gaussian_kernel_matmul(qw, core.x, core.w @ context, core.x_norm, scale=scale)
    return zero_padded_queries(out, info.query_valid).to(q.dtype)  # [B, H, Nq, Dv]


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
    generator: torch.Generator | None, options: SkyformerConfig,
) -> tuple[AttentionInputs, Landmarks, float, torch.dtype]:
    """Checks, landmarks, kernel scale p^-1/4 and compute dtype (both evaluations)."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="skyformer")
    check_generator("skyformer", generator, q.device)
    landmarks = sample_landmarks(info, options.num_features, q.device, generator)
    return info, landmarks, kernel_scale(info.head_dim), compute_dtype(q.dtype)


def materialised_skyformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    num_features: int = SkyformerConfig.num_features,
    gamma: float = SkyformerConfig.gamma,
    pinv: str = SkyformerConfig.pinv,
    pinv_iterations: int = SkyformerConfig.pinv_iterations,
    pinv_init: str = SkyformerConfig.pinv_init,
) -> Tensor:
    """``skyformer_attention`` with the [N, m] blocks formed whole and autograd backward.

    Same arguments, same landmarks for the same ``generator``, same result up to
    rounding; O(N m) memory per head. The reference for the fused path (tests) and
    the "before" of the benchmark.
    """
    options = SkyformerConfig(num_features, gamma, pinv, pinv_iterations, pinv_init)
    info, landmarks, scale, work = _prepare(q, k, v, key_padding_mask, generator, options)
    f = modified_nystrom_factors(q.to(work) * scale, k.to(work) * scale, info, options, landmarks)
    context = f.c_kx.transpose(-1, -2) @ v.to(work)  # [B, H, m, Dv]
    out = f.c_qx @ (f.w @ context)  # [B, H, Nq, Dv]
    return zero_padded_queries(out, info.query_valid).to(q.dtype)
