"""Scatterbrain: sparse (local window or LSH) + low-rank (Performer), overlap corrected.

Chen, Dao, Winsor, Song, Rudra, Ré, "Scatterbrain: Unifying Sparse and Low-rank
Attention Approximation" (NeurIPS 2021), Section 4 / Algorithm 1. The softmax matrix
A = exp(s Q K^T) is estimated by

    A~ = phi(Q) phi(K)^T + S,   S_ij = A_ij - phi(q_i).phi(k_j) on the LSH support, 0 off it,

so on the support the estimate is exact and elsewhere it is the unbiased Performer
estimate: subtracting the low-rank estimate on the sparse support keeps it from
being counted twice. The normaliser uses the same matrix, D~ = diag(A~ 1), and

    out = D~^-1 (S V + phi(Q) (phi(K)^T V)),

in O(N (b + m) D) with b the bucket size and m the random features.

Components here (``support="local"``, the default, is the published SBLocal window of
``block_size`` keys around each query, over ranks among the real tokens so that holes
equal truncation; the text below describes ``support="lsh"``):
low-rank = Performer's positive orthogonal random features
(``performer.query_features``/``key_features``, same stabilisation); sparse support =
equal-sized angular LSH buckets (KDEformer's Definition A.3, ``sketch.lsh_blocks``),
one hash, queries and keys hashed with the same hyperplanes and paired block by
block: the balanced-bucket LSH attention Scatterbrain's LSH component uses (as
SMYRF's balanced clusters do). Off the support the estimate is positive, so D~_i >=
the exact support row sum > 0 and every output row is a combination of values whose
weights sum to one.

Budget (``num_features`` = k): m = k random features and buckets of
``block_size`` = k/2 keys, the setting of the KDEformer paper's comparison code (it
reports 1.5 k). ``block_size=0`` drops the sparse part and gives Performer with the
same features; a block covering the whole sequence gives exact softmax attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import with_ones_column
from ...linalg.scores import logit_scale
from ...registry import Capabilities, register
from ...sketch import (
    draw_hyperplanes,
    gather_block_rows,
    gather_block_values,
    gaussian_projection,
    scatter_block_rows,
)
from ...sketch.rng import random_key
from ..performer.features import key_features, query_features
from ..performer.performer import rows_rescaled
from ..shared.inputs import (
    check_attention_inputs,
    compute_dtype,
    mean_values,
    resolve_key,
    zero_padded_queries,
)
from ..shared.local_window import local_windows, query_chunks, unchunk, window_rows
from ..shared.lsh_blocks import LshBlockOptions, lsh_block_logits
from ..shared.normalised import normalised_or, numerator_and_denominator
from ..shared.options import check_bool, check_choice, check_random_features, check_scale
from ..shared.real_first import from_real_first, real_first_mask, real_first_pair, to_real_first

SUPPORTS = ("lsh", "local")


@dataclass(frozen=True)
class ScatterbrainConfig(LshBlockOptions):
    """Options of Scatterbrain; defaults follow the published comparison settings.

    num_features: random features m of the low-rank part (128); ``block_size`` 0 = no
        sparse part (Performer).
    support: the sparse support where the estimate is exact. "lsh": balanced angular-LSH
        buckets of ``block_size`` keys (one hash, ``num_hyperplanes``); "local": each query
        sees the window of ``block_size`` neighbouring keys, ranks -(w // 2) ... w - 1 -
        w // 2 around its own among the real tokens (the published SBLocal code, whose
        positions are these ranks without holes or left padding).
    antithetic: features in pairs exp(+w.x), exp(-w.x) (the hyperbolic features of
        Performer's paper, the published code's default): ceil(m / 2) directions, each
        with its negation, 2 ceil(m / 2) columns. False: m independent directions
        (Performer's own features).
    orthogonal: orthogonal random features (as Performer).
    scale: logit scale s, None = 1/sqrt(head dim).
    """

    support: str = "local"
    antithetic: bool = True
    orthogonal: bool = True
    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate("scatterbrain")
        check_choice("scatterbrain", "support", self.support, SUPPORTS)
        self.refuse_unused_hyperplanes("scatterbrain", (
            "block_size=0 leaves no sparse part" if self.blocks == 0 else
            f"support={self.support!r} takes a window of neighbouring keys (pass "
            f"support='lsh' for LSH buckets)" if self.support != "lsh" else None))
        check_random_features("scatterbrain", self.num_features)
        check_bool("scatterbrain", "antithetic", self.antithetic)
        check_bool("scatterbrain", "orthogonal", self.orthogonal)
        check_scale("scatterbrain", self.scale)

    def budget_caps(self, nq: int, nk: int) -> dict[str, int]:
        """Blocks of at most the sequence; windows of at most 2 N - 1 keys (which cover
        every key of every query)."""
        if self.support == "lsh":
            return super().budget_caps(nq, nk)
        n = 2 * max(nq, nk, 1) - 1
        return {"block_size": n} if self.blocks > n else {}


def draw_scatterbrain(
    batch: int, heads: int, dim: int, config: ScatterbrainConfig, *,
    device: torch.device | str = "cpu", generator: torch.Generator | Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Random features ``[m, D]`` (drawn first, as Performer draws them; antithetic:
    ``[W; -W]`` with ceil(m / 2) rows in W) and LSH hyperplanes ``[B, H, D, r]`` (None
    without an LSH part), from one key."""
    key = random_key(generator, device)
    rows = -(-config.num_features // 2) if config.antithetic else config.num_features
    projection = gaussian_projection(
        rows, dim, orthogonal=config.orthogonal, device=device, generator=key,
    )
    if config.antithetic:
        projection = torch.cat([projection, -projection])
    planes = None
    if config.blocks > 0 and config.support == "lsh":
        planes = draw_hyperplanes((batch, heads), dim, config.num_hyperplanes, device=device,
                                  generator=key)
    return projection, planes


@register(
    "scatterbrain",
    ScatterbrainConfig,
    Capabilities(target="softmax", randomized=True, weights=True,
                 fixed_shapes_because="its count of sparse blocks follows N"),
    summary="local-window (or LSH) sparse + Performer low-rank, overlap subtracted (Scatterbrain)",
)
def scatterbrain_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: ScatterbrainConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Scatterbrain attention (Chen et al. 2021, Algorithm 1): D~^-1 (S + phi(Q) phi(K)^T) V.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token; padded keys have zero
            features and are never in a bucket with real queries.
        generator: draws the random features, then the hyperplanes.
        config: the options (``ScatterbrainConfig``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="scatterbrain",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("scatterbrain", generator, q.device)
    projection, planes = draw_scatterbrain(
        info.batch, info.heads, info.head_dim, config, device=q.device, generator=key
    )
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = logit_scale(info.head_dim, config.scale)
    root = math.sqrt(s)
    qh, kh, vw = q.to(work) * root, k.to(work) * root, v.to(work)
    w = projection.to(work)

    # Low-rank part: phi(q).phi(k) = exp(log_lr) phi~_q.phi~_k with shifted features.
    phi_q, q_shift = query_features(qh, w)  # [B, H, Nq, m], [B, H, Nq, 1]
    phi_k, k_shift = key_features(kh, w, info.key_valid)  # [B, H, Nk, m], [B, H, 1, 1]
    log_lr = (q_shift + k_shift)[..., 0] - math.log(w.shape[0])  # [B, H, Nq]
    v_and_one = with_ones_column(vw)  # [B, H, Nk, Dv + 1]
    low_rank = phi_q @ (phi_k.transpose(-1, -2) @ v_and_one)  # [B, H, Nq, Dv + 1]

    if config.blocks > 0 and config.support == "local":
        o = _local_part(qh, kh, phi_q, phi_k, v_and_one, log_lr, low_rank, config.blocks,
                        info.query_valid, info.key_valid)
    elif config.blocks > 0:
        exact = lsh_block_logits(qh, kh, planes, config.blocks, info.query_valid, info.key_valid)
        blocks, logits = exact.blocks, exact.logits  # [B, H, nb, sq, sk]
        ref = torch.maximum(exact.row_max, log_lr.detach())  # per-row scale, cancels in D~^-1
        ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
        ref_b = gather_block_values(ref, blocks.q_index, 0.0)[..., None]
        lr_b = gather_block_values(log_lr, blocks.q_index, 0.0)[..., None]
        lr_entries = gather_block_rows(phi_q, blocks.q_index) @ gather_block_rows(
            phi_k, blocks.k_index).transpose(-1, -2)
        correction = torch.exp(logits - ref_b) - torch.exp(lr_b - ref_b) * lr_entries  # S
        sparse = scatter_block_rows(correction @ gather_block_rows(v_and_one, blocks.k_index),
                                    blocks)
        o = sparse + torch.exp(log_lr - ref)[..., None] * low_rank
    else:
        o = low_rank
    # a row whose low-rank sums fall below the normaliser's threshold (no sparse part)
    # still holds every digit: a power of two brings its normaliser near 1, exactly
    numerator, denominator = numerator_and_denominator(rows_rescaled(o))
    out = normalised_or(numerator, denominator, mean_values(vw, info.key_valid))
    return zero_padded_queries(out, info.query_valid).to(dtype)


def _local_part(qh: Tensor, kh: Tensor, phi_q: Tensor, phi_k: Tensor, v_and_one: Tensor,
                log_lr: Tensor, low_rank: Tensor, window: int, query_valid: Tensor | None,
                key_valid: Tensor | None) -> Tensor:
    """S [V, 1] + phi(Q) phi(K)^T [V, 1] on local windows, rows scaled by exp(-ref).

    The windows are over ranks among the real queries and keys (``shared/real_first.py``):
    holes and left padding give the windows of the truncated sequence.
    """
    q_order, k_order = real_first_pair(query_valid, key_valid)
    sparse, ref = _local_sparse(
        to_real_first(qh, q_order), to_real_first(kh, k_order), to_real_first(phi_q, q_order),
        to_real_first(phi_k, k_order), to_real_first(v_and_one, k_order),
        to_real_first(log_lr[..., None], q_order)[..., 0], window,
        real_first_mask(key_valid, k_order),
    )
    sparse = from_real_first(sparse, q_order)
    ref = from_real_first(ref[..., None], q_order)[..., 0]
    return sparse + torch.exp(log_lr - ref)[..., None] * low_rank


def _local_sparse(qh: Tensor, kh: Tensor, phi_q: Tensor, phi_k: Tensor, v_and_one: Tensor,
                  log_lr: Tensor, window: int, key_valid: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
    """S [V, 1] on the windows of positions ``[B, H, Nq, Dv + 1]`` and the per-row scale
    ref ``[B, H, Nq]`` it is relative to."""
    layout = local_windows(qh.shape[-2], kh.shape[-2], window, qh.device)
    allowed = layout.band  # [nc, c, span]
    if key_valid is not None:
        kv = window_rows(key_valid[:, None, :, None].to(qh.dtype), layout)[..., 0] > 0
        allowed = allowed & kv[..., None, :]  # [B, 1, nc, c, span]
    logits = (query_chunks(qh, layout) @ window_rows(kh, layout).transpose(-1, -2)
              ).masked_fill(~allowed, float("-inf"))  # [B, H, nc, c, span]
    row_max = unchunk(logits.detach().amax(-1, keepdim=True), layout)[..., 0]  # [B, H, Nq]
    ref = torch.maximum(row_max, log_lr.detach())  # per-row scale, cancels in D~^-1
    ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    ref_c = query_chunks(ref[..., None], layout)  # [B, H, nc, c, 1]
    lr_c = query_chunks(log_lr[..., None], layout)
    lr_entries = (query_chunks(phi_q, layout) @ window_rows(phi_k, layout).transpose(-1, -2)
                  ).masked_fill(~allowed, 0.0)
    correction = torch.exp(logits - ref_c) - torch.exp(lr_c - ref_c) * lr_entries  # S
    return unchunk(correction @ window_rows(v_and_one, layout), layout), ref
