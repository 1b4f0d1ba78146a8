"""Near field exact, far field expanded around query cluster centres (sparse + low-rank).

``multipole_sums`` puts the parts together: options and budget split (``options.py``),
far-field moments (``far_field.py``), queries blocked by cluster (``layout.py``), the
near field (``near_field.py``) and the window / LSH keys (``exact_blocks.py``).

For logits l_ij = q_i.k_j + b_j (b_j a per-key bias, -inf for padded keys) the multipole
methods approximate, for every query,

    S_i = sum_j exp(l_ij) [v_j, 1]

(softmax attention is S_i[:Dv] / S_i[Dv]; Gaussian kernelized attention is
exp(-|q_i|^2/2) S_i[:Dv] with b_j = -|k_j|^2/2). Queries are clustered by k-means
(``sketch/kmeans.py``); query i belongs to cluster a with centre z_a, delta_i = q_i - z_a.

- **Near field (sparse, exact)**: the t keys with the largest centre logits
  z_a.k_j + b_j (the cluster's heavy keys), optionally plus per-query keys: a local
  window |i - j| <= ``window`` or the query's LSH bucket (``exact_blocks.py``). Every
  near key of every query is computed exactly.
- **Far field (low-rank)**: every other key. With the far distribution of the centre,
  p_aj = exp(z_a.k_j + b_j) / R_a over the far keys F_a, first-order expansion in
  delta_i (exponential tilting) gives

      sum_{j in F_a} exp(l_ij) [v_j, 1]
          ~ exp(log R_a + delta_i.kbar_a) [vbar_a + Cov_a(v, k) delta_i, 1]

  with kbar_a, vbar_a the p_a-means and Cov_a(v, k) the p_a-covariance of values and
  keys. The same expansion serves the numerator and the normaliser, so nothing is
  counted twice and the normaliser is always positive. The covariance is kept for the
  ``tilt_rank`` leading principal directions of the values (per head; differentiable
  in the values through the subspace it spans, ``far_field.value_basis``), and the
  tilted mean is clamped to the range of the values, so softmax outputs stay inside
  the values' per-coordinate range like exact attention.
  The covariance is estimated from a uniform sample of ``tilt_sample`` keys, so its
  cost does not grow with N.
- **Window / LSH keys in the far field** are removed from it with their first-order
  model weight exp(z_a.k_j + b_j + delta_i.kbar_a) (1 + delta_i.(k_j - kbar_a)), so no
  key is counted twice (``docs/accuracy-first.md``).

Every row of the expansion is a rank-(1 + D) function of the query, so the far field is
a low-rank matrix with c (1 + D) columns; with c clusters and t near keys a query
evaluates c + t kernel entries (its feature count; plus the window or bucket), and the
cost is O(N (c + t) D + c min(N, tilt_sample) D r) for a tilt of rank r, plus k-means.

Computation: queries are sorted by cluster and cut into blocks of at most ceil(N / 2c)
rows, so the near field and the far-field expansion run as batched products per block.
Neither the near field's score blocks (``near_field.py``) nor the far field's c x N
weights (``gaussian_kernel_matmul``) are stored: the backward pass rebuilds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...linalg.rows import permute_rows
from ...linalg.top_k import top_k
from ...sketch.angular_lsh import draw_hyperplanes
from ...sketch.kmeans import kmeans_clusters
from ...sketch.landmarks import selection_keys, smallest_keys
from ...sketch.rng import random_key, stream
from ..shared.inputs import AttentionInputs
from .exact_blocks import exact_blocks_part, lsh_blocks, window_blocks
from .far_field import FarField, far_field, value_basis
from .layout import BlockLayout, block_layout, gather_last
from .near_field import near_field
from .options import MultipoleOptions, feature_split

_NEG_INF = float("-inf")
# Rounding units of the values' scale within which a tilted far-field value counts as
# inside their range (_tilted_values): a weighted mean of Nk values is off by a few.
_ROUNDING_MARGIN = 16


@dataclass(frozen=True)
class Draws:
    """All the randomness of one call."""

    # selection keys (``landmarks.selection_keys``: distinct, by rank among real rows,
    # padded rows above every real one); a sample is the rows of smallest keys
    query_keys: Tensor  # [B, Nq] int64: k-means
    key_keys: Tensor  # [B, Nk] int64: covariance sample
    hyperplanes: Tensor | None  # [B, H, D, r] LSH normals (None without LSH buckets)
    # [B, Nq] int64, a stream of its own: the rows that ``tolerance`` checks exactly
    # (k-means starts from the smallest query_keys, where the approximation is better
    # than on a typical row; None unless asked for)
    probe_keys: Tensor | None = None


def draw(
    q: Tensor, k: Tensor, options: MultipoleOptions, generator: torch.Generator | Tensor | None,
    info: AttentionInputs, *, probes: bool = False,
) -> Draws:
    """Counter-based draws (``sketch/rng.py``) indexed by each row's rank among the real
    rows of its sequence, so that padding anywhere draws what truncation draws and no
    sequence depends on the others."""
    b, h, nq, d = q.shape
    key = random_key(generator, q.device)
    planes = None
    if options.lsh_block:
        planes = draw_hyperplanes((b, h), d, options.lsh_hyperplanes, device=q.device,
                                  dtype=q.dtype, generator=key)
    return Draws(
        selection_keys(stream(key, "multipole/queries"), info.query_valid, b, nq),
        selection_keys(stream(key, "multipole/keys"), info.key_valid, b, k.shape[2]),
        planes,
        selection_keys(stream(key, "multipole/probes"), info.query_valid, b, nq) if probes
        else None,
    )


@dataclass(frozen=True)
class PartialSums:
    """sum_j exp(l_ij) [v_j, 1] ~ exp(log_scale) [numerator, denominator] per query."""

    log_scale: Tensor  # [B, H, Nq, 1] (detached)
    numerator: Tensor  # [B, H, Nq, Dv]
    denominator: Tensor  # [B, H, Nq, 1]


@dataclass(frozen=True)
class _NearKeys:
    """Each cluster's t heavy keys, by the centre logits z_a.k_j + b_j (no gradient)."""

    index: Tensor  # [B, H, c, t]
    live: Tensor  # [B, H, c, t] bool (finite logit)
    member: Tensor  # [B, H, c, Nk] bool: the near keys of each cluster
    shift: Tensor  # [B, H, c, 1] finite: the largest far centre logit (far-field reference)


@torch.no_grad()
def _near_keys(z: Tensor, k: Tensor, key_bias: Tensor, t: int) -> _NearKeys:
    """The centre logits only select the near keys: the far field rebuilds them in
    chunks, so they are freed here."""
    b, h, c, d = z.shape
    nk = k.shape[2]
    logits = torch.baddbmm(
        key_bias.reshape(b * h, 1, nk), z.detach().reshape(b * h, c, d),
        k.detach().reshape(b * h, nk, d).transpose(1, 2),
    ).view(b, h, c, nk)  # [B, H, c, Nk]
    if t:
        top_logits, top = top_k(logits, min(t + 1, nk))  # [B, H, c, t (+ 1)], ties by position
        near_logits, near = top_logits[..., :t], top[..., :t]
        near_live = torch.isfinite(near_logits)
        # the largest far logit (t < Nk), so that the largest far key weighs 1 in the far
        # field's sums: relative to the largest near logit a far mass fell below
        # float32's sqrt(tiny) and counted as empty, where the queries' tilts made it a
        # row's largest term
        shift = top_logits[..., t:] if t < nk else near_logits[..., :1]
        # stored keys-by-centres, the layout the far field's chunks read
        member = torch.zeros(b, h, nk, c, dtype=torch.bool, device=z.device).scatter(
            2, near.transpose(-1, -2), near_live.transpose(-1, -2)
        ).transpose(-1, -2)  # [B, H, c, Nk] view
    else:
        near = near_live = torch.zeros(b, h, c, 0, dtype=torch.long, device=z.device)
        shift = logits.amax(-1, keepdim=True)
        member = torch.zeros_like(logits, dtype=torch.bool)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return _NearKeys(near, near_live.bool(), member, shift)


def _tilt_sample(draws: Draws, info: AttentionInputs, options: MultipoleOptions,
                 rank: int) -> Tensor | None:
    """``[B, S]`` keys from which the far-field covariance is estimated (None = all)."""
    nk = info.key_len
    if not rank or options.tilt_sample is None or options.tilt_sample >= nk:
        return None
    return smallest_keys(draws.key_keys, options.tilt_sample)[0]


def _blocked_terms(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, z: Tensor,
                   far: FarField, layout: BlockLayout, near: _NearKeys, rank: int
                   ) -> list[Tensor]:
    """Per query, in query order: delta.kbar ``[.., 1]``, Cov(U^T v, k) delta ``[.., r]``
    and, with near keys, the near field's log scale, numerator and normaliser
    (``[.., 1]``, ``[.., Dv]``, ``[.., 1]``); computed on blocks of queries that share
    a cluster, one product per block."""
    b, h, _, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    c, t = z.shape[2], near.index.shape[-1]
    nb, size = layout.block_cluster.shape[-1], layout.size
    bc = layout.block_cluster  # [B, H, nb]
    qb = permute_rows(q, layout.slot_query, layout.query_slot).view(b, h, nb, size, d)
    delta = qb - gather_rows(z, bc)[..., None, :]  # [B, H, nb, s, D]
    kbar_tilt = far.kbar[..., None, :]
    if rank:
        kbar_tilt = torch.cat([kbar_tilt, far.tilt], 3)
    kbar_tilt = kbar_tilt.reshape(b, h, c, -1).gather(
        2, bc[..., None].expand(b, h, nb, (rank + 1) * d)
    ).view(b, h, nb, rank + 1, d)
    blocked = [delta @ kbar_tilt.transpose(-1, -2)]  # [B, H, nb, s, 1 + r]
    if t:
        near_b = near.index.gather(2, bc[..., None].expand(b, h, nb, t))  # [B, H, nb, t]
        bias_b = gather_last(key_bias, near_b).masked_fill(
            ~near.live.gather(2, bc[..., None].expand(b, h, nb, t)), _NEG_INF
        )
        # numerator and normaliser from one product (a ones column on the values)
        near_v = gather_rows(torch.cat([v, v.new_ones(b, h, nk, 1)], -1), near_b)
        near_max, near_sums = near_field(
            qb.view(b * h * nb, size, d), gather_rows(k, near_b).view(b * h * nb, t, d),
            bias_b.view(b * h * nb, 1, t), near_v.view(b * h * nb, t, dv + 1),
        )  # [G, s, 1], [G, s, Dv + 1] for G = B H nb blocks
        blocked += [near_max.view(b, h, nb, size, 1), near_sums.view(b, h, nb, size, dv + 1)]
    flat = torch.cat(blocked, -1).view(b, h, nb * size, -1)
    flat = permute_rows(flat, layout.query_slot, layout.slot_query)  # query order
    # split (not sliced: the backward pass then concatenates instead of summing
    # zero-padded copies of the whole tensor)
    return list(flat.split([1, rank] + ([1, dv, 1] if t else []), dim=-1))


def _tilted_values(far: FarField, a: Tensor, shift_r: Tensor, basis: Tensor | None,
                   v: Tensor, key_valid: Tensor | None, rank: int) -> Tensor:
    """vbar_a + Cov_a(v, k) delta_i per query ``[B, H, Nq, Dv]``, kept inside the values'
    range (the expansion is first order)."""
    v_far = gather_rows(far.vbar, a)  # [B, H, Nq, Dv]
    if not rank:
        return v_far
    v_far = v_far + (shift_r if basis is None else shift_r @ basis.transpose(-1, -2))
    low, high = _value_range(v, key_valid)
    # As torch.clamp with tensor bounds (the gradient goes to v_far inside the range, to
    # the bound outside it, hence to the values at the extreme), whose CPU kernel is ~10x
    # slower than a comparison and a where. "Inside" has a margin of rounding: a mean
    # is never outside its values' range, and where the tilt is 0 (a coordinate
    # constant over the keys, a far field of one key) rounding alone put it on a bound
    # and chose which gradient the coordinate got.
    margin = _ROUNDING_MARGIN * torch.finfo(v_far.dtype).eps * torch.maximum(
        low.detach().abs(), high.detach().abs())
    inside = (v_far >= low - margin) & (v_far <= high + margin)
    return torch.where(inside, v_far, torch.minimum(torch.maximum(v_far.detach(), low), high))


def multipole_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    info: AttentionInputs,
    options: MultipoleOptions,
    generator: torch.Generator | Tensor | None,
    *,
    draws: Draws | None = None,
    gaussian: bool = False,
) -> PartialSums:
    """Near field + far-field expansion of sum_j exp(q_i.k_j + b_j) [v_j, 1].

    Args:
        q: ``[B, H, Nq, D]``, k: ``[B, H, Nk, D]`` (already scaled), v: ``[B, H, Nk, Dv]``.
        key_bias: ``[B, H, Nk]`` b_j, ``-inf`` for padded keys.
        draws: the random draws to use instead of drawing from ``generator`` (callers
            that run several budgets on one draw).
        gaussian: ``key_bias`` is -|k_j|^2/2 on the valid keys (Gaussian target); else
            it is 0 there (softmax target). The far field evaluates it itself.
    Returns:
        ``PartialSums``; rows of padded queries are finite and meaningless.
    """
    b, h, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    # one mask object (or none) for self-attention: a query mask of its own is cross-attention
    self_attention = nq == nk and info.query_valid is info.key_valid
    w, lsh, c, t = feature_split(options.num_features, options.window, options.clusters,
                                 self_attention=self_attention, lsh_block=options.lsh_block)
    t = min(t, nk)
    if draws is None:
        draws = draw(q, k, options, generator, info)
    clusters = kmeans_clusters(
        q, min(c, nq), valid=info.query_valid, iterations=options.kmeans_iterations,
        sample=options.kmeans_sample, keys=draws.query_keys,
    )
    z, a = clusters.centres, clusters.assignment
    near = _near_keys(z, k, key_bias, t)
    exact_blocks = bool((w and self_attention) or lsh)
    dots = z @ k.transpose(-1, -2) if exact_blocks else None  # [B, H, c, Nk]

    rank = dv if options.tilt_rank is None else min(options.tilt_rank, dv)
    basis = value_basis(v, info.key_valid, rank) if rank else None
    far = far_field(z, k, v, key_bias, near.shift, near.member, info.key_valid, basis, rank,
                    _tilt_sample(draws, info, options, rank), gaussian=gaussian,
                    kernel=options.kernel)
    pieces = _blocked_terms(q, k, v, key_bias, z, far, block_layout(a, z.shape[2]), near, rank)
    delta_kbar, shift_r = pieces[:2]
    parts = []
    if t:
        near_max, near_num, near_den = pieces[2:]
        parts.append((torch.where(near_den > 0, near_max, _NEG_INF), near_num, near_den))

    log_far = gather_last(far.log_mass, a)[..., None] + delta_kbar  # [B, H, Nq, 1]
    far_num = _tilted_values(far, a, shift_r, basis, v, info.key_valid, rank)
    far_den = torch.ones_like(log_far)
    far_live = gather_last(far.live, a)[..., None]  # [B, H, Nq, 1]
    blocks = None
    if w and self_attention:
        blocks = window_blocks(b, h, nq, w, q.device, info.query_valid, info.key_valid)
    elif lsh:
        blocks = lsh_blocks(q, k, draws.hyperplanes, lsh, info.query_valid, info.key_valid)
    if blocks is not None:
        assert dots is not None
        exact_part, removed_num, removed_den = exact_blocks_part(
            q, k, v, key_bias, dots, near.member, a, far.log_mass, far_live, delta_kbar, blocks
        )
        parts.append(exact_part)
        far_num = far_num - removed_num
        far_den = far_den - removed_den
        far_live = far_live & (far_den > 0)  # the window took the whole far field
    # exp(log_far - sg(log_far)) is 1 with the gradient of log_far.
    safe_log_far = torch.where(far_live, log_far, 0.0)
    far_weight = torch.where(far_live, (safe_log_far - safe_log_far.detach()).exp(), 0.0)
    far_scale = torch.where(far_live, safe_log_far.detach(), _NEG_INF)
    parts.append((far_scale, far_num * far_weight, far_den * far_weight))
    return _merge(parts)


def _value_range(v: Tensor, key_valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-coordinate min and max of the valid values, ``[B, H, 1, Dv]`` each
    (differentiable: a gradient goes to the values at the extreme)."""
    vv = v
    if key_valid is None:
        low, high = vv.amin(2, keepdim=True), vv.amax(2, keepdim=True)
    else:
        real = key_valid[:, None, :, None]
        low = vv.masked_fill(~real, float("inf")).amin(2, keepdim=True)
        high = vv.masked_fill(~real, float("-inf")).amax(2, keepdim=True)
        low = torch.where(torch.isfinite(low), low, torch.zeros_like(low))
        high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
    return low, high


def _safe_max(x: Tensor, dim: int) -> Tensor:
    """Max over ``dim`` (kept), detached, 0 where every entry is -inf."""
    m = x.detach().amax(dim=dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _merge(parts: list[tuple[Tensor, Tensor, Tensor]]) -> PartialSums:
    """Combine (log scale, numerator, denominator) triples in log space; a part with
    scale -inf is empty. The common scale is 0 for rows where every part is empty."""
    top = _safe_max(torch.stack([p[0] for p in parts], -1), -1)[..., 0]
    weights = [(p[0] - top).exp() for p in parts]
    # summed from the first term (Python's sum would add it to 0, a full extra pass)
    num, den = weights[0] * parts[0][1], weights[0] * parts[0][2]
    for weight, part in zip(weights[1:], parts[1:], strict=True):
        num = num + weight * part[1]
        den = den + weight * part[2]
    return PartialSums(top, num, den)
