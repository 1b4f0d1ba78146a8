"""Multipole attention: exact near field + first-order far-field expansion.

Two registered methods share the core of ``multipole_core.py``:

- ``softmax_multipole`` approximates softmax attention softmax(s Q K^T) V: logits
  s q_i.k_j, output S_i[:Dv] / S_i[Dv];
- ``skyformer_multipole`` approximates Skyformer's Gaussian kernelized attention C V
  (Skyformer eq. (1)): with q^ = q p^-1/4, k^ = k p^-1/4, C_ij = exp(q^_i.k^_j -
  |k^_j|^2/2) exp(-|q^_i|^2/2), so the logits are q^_i.k^_j - |k^_j|^2/2 and the
  output is exp(-|q^_i|^2/2) S_i[:Dv].

Both follow the directions named in Skyformer's conclusion (section 6): a local +
global (sparse + low-rank) approximation, with landmarks (cluster centres) adapted to
the data. Derivation, budget accounting and measurements: ``docs/accuracy-first.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..inputs import check_attention_inputs, check_generator, compute_dtype, zero_padded_queries
from ..linalg import half_sq_norm
from ..registry import Capabilities, register
from .kernelized import kernel_scale
from .multipole_core import MultipoleOptions, multipole_sums


@dataclass(frozen=True)
class SkyformerMultipoleConfig(MultipoleOptions):
    """Options of ``skyformer_multipole`` (see ``MultipoleOptions``)."""

    def __post_init__(self) -> None:
        self.validate("skyformer_multipole")


@dataclass(frozen=True)
class SoftmaxMultipoleConfig(MultipoleOptions):
    """Options of ``softmax_multipole``; ``scale``: logit scale s, ``None`` = 1/sqrt(D)."""

    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate("softmax_multipole")
        if self.scale is not None and not (
            isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool) and self.scale > 0
        ):
            raise ValueError(
                f"softmax_multipole: scale must be a positive number or None, got {self.scale!r}."
            )


def masked_bias(bias: Tensor, key_valid: Tensor | None) -> Tensor:
    """Per-key logit bias ``[B, H, Nk]`` with -inf for padded keys."""
    if key_valid is None:
        return bias
    return bias.masked_fill(~key_valid[:, None, :], float("-inf"))


@register(
    "skyformer_multipole",
    SkyformerMultipoleConfig,
    Capabilities(target="gaussian", randomized=True),
    summary="kernelized attention: exact near field (cluster heavy keys + local window) "
    "+ first-order far-field expansion around k-means query centres",
)
def skyformer_multipole_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    num_features: int = SkyformerMultipoleConfig.num_features,
    window: int = SkyformerMultipoleConfig.window,
    clusters: int | None = SkyformerMultipoleConfig.clusters,
    tilt_rank: int | None = SkyformerMultipoleConfig.tilt_rank,
    tilt_sample: int | None = SkyformerMultipoleConfig.tilt_sample,
    kmeans_iterations: int = SkyformerMultipoleConfig.kmeans_iterations,
    kmeans_sample: int | None = SkyformerMultipoleConfig.kmeans_sample,
) -> Tensor:
    """Gaussian kernelized attention ``C V`` by near field + far-field expansion.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the k-means sub-sample and initial centres.
        num_features, window, clusters, tilt_rank, tilt_sample, kmeans_iterations,
            kmeans_sample: see ``MultipoleOptions``.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="skyformer_multipole")
    check_generator("skyformer_multipole", generator, q.device)
    options = SkyformerMultipoleConfig(
        num_features=num_features, window=window, clusters=clusters, tilt_rank=tilt_rank,
        tilt_sample=tilt_sample, kmeans_iterations=kmeans_iterations, kmeans_sample=kmeans_sample,
    )
    dtype = q.dtype
    work = compute_dtype(dtype)
    scale = kernel_scale(info.head_dim)
    q_hat, k_hat = q.to(work) * scale, k.to(work) * scale
    bias = masked_bias(-half_sq_norm(k_hat), info.key_valid)
    sums = multipole_sums(q_hat, k_hat, v.to(work), bias, info, options, generator)
    out = (sums.log_scale - half_sq_norm(q_hat)[..., None]).exp() * sums.numerator
    return zero_padded_queries(out, info.query_valid).to(dtype)


@register(
    "softmax_multipole",
    SoftmaxMultipoleConfig,
    Capabilities(target="softmax", randomized=True),
    summary="softmax attention: exact near field (cluster heavy keys + local window) "
    "+ first-order far-field expansion around k-means query centres",
)
def softmax_multipole_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    num_features: int = SoftmaxMultipoleConfig.num_features,
    window: int = SoftmaxMultipoleConfig.window,
    clusters: int | None = SoftmaxMultipoleConfig.clusters,
    tilt_rank: int | None = SoftmaxMultipoleConfig.tilt_rank,
    tilt_sample: int | None = SoftmaxMultipoleConfig.tilt_sample,
    kmeans_iterations: int = SoftmaxMultipoleConfig.kmeans_iterations,
    kmeans_sample: int | None = SoftmaxMultipoleConfig.kmeans_sample,
    scale: float | None = SoftmaxMultipoleConfig.scale,
) -> Tensor:
    """Softmax attention by near field + far-field expansion (normaliser from the same
    expansion, hence always positive).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the k-means sub-sample and initial centres.
        num_features, window, clusters, tilt_rank, tilt_sample, kmeans_iterations,
            kmeans_sample, scale: see ``SoftmaxMultipoleConfig``.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries and of queries
        without any real key are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="softmax_multipole")
    check_generator("softmax_multipole", generator, q.device)
    options = SoftmaxMultipoleConfig(
        num_features=num_features, window=window, clusters=clusters, tilt_rank=tilt_rank,
        tilt_sample=tilt_sample, kmeans_iterations=kmeans_iterations, kmeans_sample=kmeans_sample,
        scale=scale,
    )
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = options.scale if options.scale is not None else 1.0 / math.sqrt(info.head_dim)
    bias = masked_bias(q.new_zeros(q.shape[0], q.shape[1], k.shape[2], dtype=work), info.key_valid)
    sums = multipole_sums(q.to(work) * s, k.to(work), v.to(work), bias, info, options, generator)
    den = sums.denominator
    out = torch.where(den > 0, sums.numerator / den.clamp_min(torch.finfo(work).tiny), 0.0)
    return zero_padded_queries(out, info.query_valid).to(dtype)
