"""Skyformer with adaptive landmarks: k-means query centres + ridge-leverage keys.

Skyformer eqs. (5)-(6) with the Lemma 3 inverse, unchanged, but with landmarks chosen
from the data instead of uniformly (Skyformer section 6 names importance sampling for
Nystrom as the way forward):

    out = C(Q, X) [ W ( C(X, K) V ) ],   X = [Z; K_J],   W = Lemma-3 inverse of C(X, X),

- Z: the k-means centres of the scaled queries (``query_fraction`` of the landmarks);
  the lifted matrix of [Q; K] has a statistical dimension close to 2n on real data (far
  apart tokens give a near-identity kernel), so uniform rows waste the budget;
- K_J: the keys with the largest approximate ridge leverage scores of the Q-vs-K block,
  computed from the kernel rows of the centres, each weighted by sqrt(cluster size)
  (``sketch/leverage.py``): the heavy columns ([CLS], [SEP], punctuation in BERT) that a
  uniform sample misses and that dominate C V.

Cost O(N m D + N s^2) with s = query_fraction m. Gradients flow through the centres
(member means) and the selected keys' rows; the assignments and the selection are
piecewise constant and carry none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import (
    gaussian_kernel_block,
    gaussian_kernel_matmul,
    half_sq_norm,
    kernel_scale,
    landmark_inverse,
)
from ...registry import Capabilities, register
from ...sketch.kmeans import kmeans_clusters
from ...sketch.leverage import sketched_ridge_leverage, top_keys
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    compute_dtype,
    resolve_key,
    zero_padded_queries,
)
from ..shared.modified_nystrom import NystromOptions
from ..shared.options import (
    check_fraction,
    check_nonnegative_int,
    check_optional_positive_int,
    check_positive_float,
    check_scale,
)


@dataclass(frozen=True)
class SkyformerAdaptiveConfig(NystromOptions):
    """Options of ``skyformer_adaptive`` (Nystrom options as ``skyformer``).

    num_features: landmarks m, chosen from the data rather than sampled half from each
        of Q and K: ``query_fraction`` of them query centres, the rest keys.
    query_fraction: share of the landmarks that are k-means centres of the queries (at
        least one, at most the sequence's real queries); the rest are keys chosen by
        ridge leverage.
    ridge: lambda of the leverage scores, relative to the mean diagonal of the sketch's Gram.
    kmeans_iterations, kmeans_sample: Lloyd iterations and sub-sample size.
    scale: s of the Gaussian kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(head dim)
        (Skyformer eq. (3)); a model that pre-scales its queries passes its own.
    """

    query_fraction: float = 0.25
    ridge: float = 1e-3
    kmeans_iterations: int = 10
    kmeans_sample: int | None = 2048
    scale: float | None = None

    def __post_init__(self) -> None:
        method = "skyformer_adaptive"
        self.validate(method)
        check_fraction(method, "query_fraction", self.query_fraction)
        check_positive_float(method, "ridge", self.ridge)
        check_nonnegative_int(method, "kmeans_iterations", self.kmeans_iterations)
        check_optional_positive_int(method, "kmeans_sample", self.kmeans_sample)
        check_scale(method, self.scale)


@dataclass(frozen=True)
class AdaptiveLandmarks:
    """Landmark points X = [centres; selected keys] per head."""

    points: Tensor  # [B, H, m, D] (scaled)
    live: Tensor  # [B, H, m] bool
    centres: int  # number of leading centre slots
    key_index: Tensor  # [B, H, r] the selected keys, in the order of their scores
    key_live: Tensor  # [B, H, r] bool: which of them are landmarks


def adaptive_landmarks(
    q_hat: Tensor, k_hat: Tensor, info: AttentionInputs, options: SkyformerAdaptiveConfig,
    generator: torch.Generator | Tensor | None,
) -> AdaptiveLandmarks:
    """k-means centres of ``q_hat`` and ridge-leverage keys of ``k_hat`` (scaled inputs).

    A sequence with fewer real queries than centre slots spends the rest of its budget
    on keys, as its truncation does: the keys ranked past the key slots take the centre
    slots that no query holds.
    """
    m = options.num_features
    nq, nk = q_hat.shape[2], k_hat.shape[2]
    centres = min(max(1, round(options.query_fraction * m)), m, nq)
    clusters = kmeans_clusters(
        q_hat, centres, valid=info.query_valid, generator=generator,
        iterations=options.kmeans_iterations, sample=options.kmeans_sample,
    )
    sketch = gaussian_kernel_block(clusters.centres.detach(), k_hat.detach())
    sketch = sketch * clusters.sizes.sqrt()[..., None]  # [B, H, s, Nk]; empty clusters weigh 0
    scores = sketched_ridge_leverage(sketch, options.ridge, info.key_valid)
    slots = min(m - centres, nk)
    # at least one real query holds a centre: at most m - 1 keys
    ranked = slots if info.query_valid is None else min(m - 1, nk)
    key_index, key_live = top_keys(scores, ranked)
    d = k_hat.shape[-1]
    keys = k_hat.gather(2, key_index[..., None].expand(-1, -1, -1, d))
    points, live = clusters.centres, clusters.live
    if ranked > slots:
        points, live, key_live = _spare_slots_to_keys(points, live, keys, key_live, slots,
                                                      info.query_valid, m)
    points = torch.cat([points, keys[:, :, :slots]], dim=2)
    live = torch.cat([live, key_live[..., :slots]], dim=2)
    return AdaptiveLandmarks(points, live, centres, key_index, key_live)


def _spare_slots_to_keys(
    centres: Tensor, live: Tensor, keys: Tensor, key_live: Tensor, slots: int,
    query_valid: Tensor, m: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Centre slots ``[B, H, c, D]`` with those past a sequence's real queries (empty
    clusters) holding the keys ranked ``slots``, ``slots + 1``, ... of ``keys [B, H, r,
    D]``, so that each sequence has m landmarks. Returns the slots, their live mask and
    ``key_live`` with the keys used."""
    b, h, c, d = centres.shape
    # slots the real queries hold (a sequence without any keeps its one live zero centre)
    held = query_valid.sum(-1).clamp(1, c)[:, None, None]  # [B, 1, 1]
    slot = torch.arange(c, device=centres.device)
    rank = slots + slot - held  # [B, 1, c] the key a spare slot takes
    spare = (slot >= held) & (rank < keys.shape[2])
    rank = torch.where(spare, rank, 0).expand(b, h, c)
    taken = spare & key_live.gather(2, rank)
    points = torch.where(taken[..., None], keys.gather(2, rank[..., None].expand(b, h, c, d)),
                         centres)
    # budget: the key slots and the spare centre slots, m - held keys in all
    key_live = key_live & (torch.arange(keys.shape[2], device=keys.device) < m - held)
    return points, torch.where(spare, taken, live), key_live


def nystrom_with_landmarks(
    q_hat: Tensor, k_hat: Tensor, v: Tensor, landmarks: AdaptiveLandmarks, info: AttentionInputs,
    options: NystromOptions, *, scale: float = 1.0,
) -> Tensor:
    """C(Q, X) W C(X, K) V for landmark points X (Skyformer eqs. (5)-(6), Lemma 3).

    ``q_hat``, ``k_hat`` are the rows before the factor ``scale`` (1: already scaled);
    X is in the scaled space. The [N, m] blocks are never held whole: both products go
    through ``gaussian_kernel_matmul``, as in ``skyformer``.
    """
    inf = torch.full((), float("inf"), dtype=q_hat.dtype, device=q_hat.device)  # no copy
    x = landmarks.points
    x_norm = torch.where(landmarks.live, half_sq_norm(x), inf)  # dead landmarks -> zero columns
    b, h, m, _ = x.shape
    w = landmark_inverse(  # of C(X, X): [B, H, m, m]
        x.reshape(b * h, 1, m, -1), x_norm.reshape(b * h, 1, m), gamma=options.gamma,
        pinv=options.pinv,  # type: ignore[arg-type]
        iterations=options.pinv_iterations, init=options.pinv_init,  # type: ignore[arg-type]
        live=landmarks.live.reshape(b * h, m), kernel=options.kernel,
        gradient=options.pinv_gradient,
    ).view(b, h, m, m)
    key_valid = None if info.key_valid is None else info.key_valid[:, None, :]  # [B, 1, Nk]
    context = gaussian_kernel_matmul(
        k_hat, x, v, x_norm, scale=scale, row_valid=key_valid, transpose=True,
        kernel=options.kernel,
    )  # C(X, K) V: [B, H, m, Dv]
    return gaussian_kernel_matmul(q_hat, x, w @ context, x_norm, scale=scale,
                                  kernel=options.kernel)


@register(
    "skyformer_adaptive",
    SkyformerAdaptiveConfig,
    Capabilities(target="gaussian", randomized=True, weights=True,
                 fixed_shapes_because="its k-means sample is capped by N"),
    summary="Skyformer with adaptive landmarks: k-means query centres + ridge-leverage keys",
)
def skyformer_adaptive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SkyformerAdaptiveConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Kernelized attention by the modified Nystrom method with adaptive landmarks.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token; padded rows never
            influence the landmarks.
        generator: draws the k-means sub-sample and initial centres (the only randomness).
        config: the options (``SkyformerAdaptiveConfig``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="skyformer_adaptive",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("skyformer_adaptive", generator, q.device)
    dtype = q.dtype
    work = compute_dtype(dtype)
    scale = kernel_scale(info.head_dim, config.scale)
    qw, kw = q.to(work), k.to(work)
    landmarks = adaptive_landmarks(qw * scale, kw * scale, info, config, key)
    # The fused products scale the rows themselves: no scaled [N, D] copies kept for backward.
    out = nystrom_with_landmarks(qw, kw, v.to(work), landmarks, info, config, scale=scale)
    return zero_padded_queries(out, info.query_valid).to(dtype)
