"""Near field exact, far field expanded around query cluster centres (sparse + low-rank).

For logits l_ij = q_i.k_j + b_j (b_j a per-key bias, -inf for padded keys) the multipole
methods approximate, for every query,

    S_i = sum_j exp(l_ij) [v_j, 1]

(softmax attention is S_i[:Dv] / S_i[Dv]; Gaussian kernelized attention is
exp(-|q_i|^2/2) S_i[:Dv] with b_j = -|k_j|^2/2). Queries are clustered by k-means
(``sketch/kmeans.py``); query i belongs to cluster a with centre z_a, delta_i = q_i - z_a.

- **Near field (sparse, exact)**: the t keys with the largest centre logits
  z_a.k_j + b_j (the cluster's heavy keys), optionally plus per-query keys: a local
  window |i - j| <= ``window`` or the query's LSH bucket (``multipole_extra.py``). Every
  near key of every query is computed exactly.
- **Far field (low-rank)**: every other key. With the far distribution of the centre,
  p_aj = exp(z_a.k_j + b_j) / R_a over the far keys F_a, first-order expansion in
  delta_i (exponential tilting) gives

      sum_{j in F_a} exp(l_ij) [v_j, 1]
          ~ exp(log R_a + delta_i.kbar_a) [vbar_a + Cov_a(v, k) delta_i, 1]

  with kbar_a, vbar_a the p_a-means and Cov_a(v, k) the p_a-covariance of values and
  keys. The same expansion serves the numerator and the normaliser, so nothing is
  counted twice and the normaliser is always positive. The covariance is kept for the
  ``tilt_rank`` leading principal directions of the values (per head; the basis carries
  no gradient), and the tilted mean is clamped to the range of the values, so softmax
  outputs stay inside the values' per-coordinate range like exact attention.
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
Neither the near field's score blocks (``multipole_near.py``) nor the far field's c x N
weights (``gaussian_kernel_matmul``) are stored: the backward pass rebuilds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..inputs import AttentionInputs, check_positive_int
from ..linalg import gather_rows, gaussian_kernel_matmul
from ..sketch.angular_lsh import draw_hyperplanes
from ..sketch.kmeans import kmeans_clusters
from .multipole_extra import exact_blocks_part, lsh_blocks, window_blocks
from .multipole_near import near_field

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class MultipoleOptions:
    """Options of the multipole (near field + far-field expansion) methods.

    num_features: kernel evaluations per query: clusters + near keys + window keys.
    window: local window half-width w (keys |i - j| <= w, self-attention only; 0 = none,
        the default: with the first-order far field it bought little on MiniLM, see
        ``docs/accuracy-first.md``); shrunk to at most a quarter of ``num_features``.
    lsh_block: keys per angular-LSH bucket (KDEformer Appendix A, Hamming-ordered
        equal-sized buckets) computed exactly for each query (0 = none); at most a
        quarter of ``num_features``. Exclusive with ``window``.
    lsh_hyperplanes: hyperplanes r of the LSH (2^r buckets before equal-size cutting).
    clusters: number of query clusters c; ``None`` = half of what the window leaves.
        The remaining budget goes to the near keys of each cluster.
    tilt_rank: value directions kept in the far-field covariance term (0 = zeroth-order
        far field, ``None`` = every direction).
    tilt_sample: keys (a uniform sample, shared by the clusters) from which the
        covariance term is estimated (``None`` = every key); caps its cost at
        c * tilt_sample * D * tilt_rank whatever N.
    kmeans_iterations: Lloyd iterations on the k-means sub-sample.
    kmeans_sample: rows sub-sampled for the Lloyd iterations (``None`` = all).
    tolerance: target relative error; when set, each head takes the smallest budget of
        the ladder m/8 .. m (m = ``num_features``) whose error, measured on ``probe``
        exact query rows, is at most ``tolerance`` (``multipole_targeted.py``).
    probe: query rows computed exactly to estimate the error (with ``tolerance``).
    """

    num_features: int = 128
    window: int = 0
    lsh_block: int = 0
    lsh_hyperplanes: int = 7
    clusters: int | None = None
    tilt_rank: int | None = 8
    tilt_sample: int | None = 2048
    kmeans_iterations: int = 10
    kmeans_sample: int | None = 2048
    tolerance: float | None = None
    probe: int = 32

    def validate(self, method: str) -> None:
        check_positive_int(method, "num_features", self.num_features)
        for name in ("window", "lsh_block", "kmeans_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{method}: {name} must be an integer >= 0, got {value!r}.")
        check_positive_int(method, "probe", self.probe)
        check_positive_int(method, "lsh_hyperplanes", self.lsh_hyperplanes)
        if self.lsh_hyperplanes > 30:
            raise ValueError(
                f"{method}: lsh_hyperplanes must be at most 30 (2^r buckets), "
                f"got {self.lsh_hyperplanes}."
            )
        if self.window and self.lsh_block:
            raise ValueError(
                f"{method}: choose one of window={self.window} and lsh_block={self.lsh_block} "
                f"for the per-query exact keys (set the other to 0)."
            )
        if self.tolerance is not None:
            if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) \
                    or not self.tolerance > 0:
                raise ValueError(
                    f"{method}: tolerance must be a positive number or None, "
                    f"got {self.tolerance!r}."
                )
            if self.clusters is not None:
                raise ValueError(
                    f"{method}: clusters cannot be combined with tolerance (each budget of the "
                    f"ladder uses its own split); leave clusters=None."
                )
        for name in ("clusters", "kmeans_sample", "tilt_sample"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(method, name, value)
        if self.tilt_rank is not None and (
            isinstance(self.tilt_rank, bool) or not isinstance(self.tilt_rank, int)
            or self.tilt_rank < 0
        ):
            raise ValueError(
                f"{method}: tilt_rank must be an integer >= 0 or None, got {self.tilt_rank!r}."
            )
        window, lsh, _, _ = feature_split(self.num_features, self.window, None,
                                          self_attention=True, lsh_block=self.lsh_block)
        extra = (2 * window + 1 if window else 0) + lsh
        left = self.num_features - extra
        if self.clusters is not None and self.clusters > left:
            raise ValueError(
                f"{method}: clusters={self.clusters} leaves no budget: num_features="
                f"{self.num_features} with {extra} window/LSH keys allows at most {left} "
                f"clusters; raise num_features or lower clusters."
            )


def feature_split(
    num_features: int, window: int, clusters: int | None, *, self_attention: bool,
    lsh_block: int = 0,
) -> tuple[int, int, int, int]:
    """(window half-width, LSH block, clusters, near keys) for ``num_features`` per query.

    The window (2w + 1 keys, self-attention only) or the LSH bucket takes at most a
    quarter of the budget; of the rest, ``clusters`` (default: half, at least 1) are
    cluster centres and the remainder near keys.
    """
    quarter = num_features // 4
    w = 0
    if self_attention and window > 0:
        w = min(window, max(0, (quarter - 1) // 2))
    lsh = min(lsh_block, quarter) if lsh_block > 0 else 0
    left = num_features - (2 * w + 1 if w else 0) - lsh
    c = max(1, left // 2) if clusters is None else min(clusters, left)
    return w, lsh, c, left - c


def value_basis(v: Tensor, key_valid: Tensor | None, rank: int | None) -> Tensor | None:
    """Leading principal directions of the values, ``[B, H, Dv, r]`` (no gradient), or
    ``None`` when every direction is kept."""
    dv = v.shape[-1]
    if rank is None or rank >= dv:
        return None
    with torch.no_grad():
        vv = v.detach()
        if key_valid is not None:
            w = key_valid[:, None, :, None].to(v.dtype)
            count = w.sum(2, keepdim=True).clamp_min(1.0)
            centred = (vv - (vv * w).sum(2, keepdim=True) / count) * w
        else:
            centred = vv - vv.mean(2, keepdim=True)
        cov = centred.transpose(-1, -2) @ centred  # [B, H, Dv, Dv]
        basis = torch.linalg.eigh(cov.double()).eigenvectors[..., dv - rank:]
    return basis.to(v.dtype)


def _safe_max(x: Tensor, dim: int) -> Tensor:
    """Max over ``dim`` (kept), detached, 0 where every entry is -inf."""
    m = x.detach().amax(dim=dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


@dataclass(frozen=True)
class FarField:
    """Per-cluster far-field statistics."""

    log_mass: Tensor  # [B, H, c]  log R_a (-inf: empty far field)
    kbar: Tensor  # [B, H, c, D]
    vbar: Tensor  # [B, H, c, Dv]
    tilt: Tensor  # [B, H, c, r, D]  Cov_a(U^T v, k)
    live: Tensor  # [B, H, c] bool


def far_field(
    z: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, shift: Tensor, member: Tensor,
    key_valid: Tensor | None, basis: Tensor | None, rank: int, sample: Tensor | None = None,
    *, gaussian: bool = False,
) -> FarField:
    """Far-field moments of each cluster centre's distribution over its far keys.

    The sums sum_j exp(z_a.k_j + b_j - shift_a) [k_j, v_j, 1] over the far keys go through
    ``gaussian_kernel_matmul`` with the keys as rows and the near keys excluded: the
    c x Nk weights are built in cache-sized chunks and rebuilt in the backward pass,
    never stored (as Skyformer's [N, m] blocks).

    Args:
        z: ``[B, H, c, D]`` centres; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_bias: ``[B, H, Nk]`` b_j (-inf for padded keys): 0 on the valid keys, or
            -|k_j|^2/2 with ``gaussian=True``; used for the covariance sample.
        shift: ``[B, H, c, 1]`` finite, detached, at least the largest far logit up to
            float range (far keys more than ~80 below it underflow: share below 1e-30).
        member: ``[B, H, c, Nk]`` near keys; key_valid: ``[B, Nk]`` or ``None``.
        basis: ``[B, H, Dv, r]`` or ``None`` (identity).
        rank: r (0 = no covariance).
        sample: ``[B, S]`` keys from which the covariance is estimated (self-normalised
            over the sampled far keys), ``None`` = every key.
        gaussian: b_j = -|k_j|^2/2 (Gaussian target) rather than 0.
    """
    b, h, nk, d = k.shape
    c, dv = z.shape[2], v.shape[-1]
    rhs = torch.cat([k, v, k.new_ones(b, h, nk, 1)], -1)  # [B, H, Nk, D + Dv + 1]
    sums = gaussian_kernel_matmul(
        k, z, rhs, shift[..., 0], row_norm=gaussian, transpose=True,
        row_valid=None if key_valid is None else key_valid[:, None, :],
        # keys-by-centres and contiguous: masking chunks through a strided view is slow
        exclude=member.transpose(-1, -2).contiguous(),
    )  # [B, H, c, D + Dv + 1]
    mass = sums[..., -1:]
    live = mass[..., 0] > 0
    inv_mass = 1.0 / mass.clamp_min(torch.finfo(mass.dtype).tiny)
    kbar = sums[..., :d] * inv_mass  # [B, H, c, D]
    vbar = sums[..., d:d + dv] * inv_mass  # [B, H, c, Dv]
    log_mass = mass[..., 0].clamp_min(torch.finfo(mass.dtype).tiny).log() + shift[..., 0]
    log_mass = torch.where(live, log_mass, _NEG_INF)
    if rank == 0:
        tilt = k.new_zeros(b, h, c, 0, d)
    else:
        ks, vs, bias, near, inv = k, v, key_bias, member, inv_mass
        if sample is not None:
            idx = sample[:, None, :].expand(b, h, -1)
            ks = k.gather(2, idx[..., None].expand(-1, -1, -1, d))
            vs = v.gather(2, idx[..., None].expand(-1, -1, -1, dv))
            bias = key_bias.gather(2, idx)
            near = member.gather(3, idx[:, :, None, :].expand(-1, -1, c, -1))
        # The weights of the (sampled) keys only: [B, H, c, S].
        ws = torch.baddbmm(
            (bias[:, :, None, :] - shift).view(b * h, c, -1), z.reshape(b * h, c, d),
            ks.reshape(b * h, -1, d).transpose(1, 2),
        ).view(b, h, c, -1).masked_fill_(near, _NEG_INF).exp_()
        if sample is not None:
            inv = 1.0 / ws.sum(-1, keepdim=True).clamp_min(torch.finfo(ws.dtype).tiny)
        vr = vs if basis is None else vs @ basis  # [B, H, S, r]
        outer = (vr[..., :, None] * ks[..., None, :]).view(b, h, ks.shape[2], rank * d)
        second = ((ws @ outer) * inv).view(b, h, c, rank, d)
        mean_k, mean_vr = kbar, (vbar if basis is None else vbar @ basis)
        if sample is not None:
            mean_k, mean_vr = (ws @ ks) * inv, (ws @ vr) * inv
        tilt = second - mean_vr[..., :, None] * mean_k[..., None, :]
    return FarField(log_mass, kbar, vbar, tilt, live)


@dataclass(frozen=True)
class BlockLayout:
    """Queries sorted by cluster and cut into blocks of ``size`` rows."""

    size: int
    slot_query: Tensor  # [B, H, nb * size] query index per slot (Nq = empty slot)
    query_slot: Tensor  # [B, H, Nq] slot of each query
    block_cluster: Tensor  # [B, H, nb]


def block_layout(assignment: Tensor, num_clusters: int) -> BlockLayout:
    """Sort queries by cluster; cluster a fills ceil(|a| / size) blocks of
    size = ceil(N / 2c) rows, so at most N/size + c blocks, of which only as many as the
    fullest head needs are allocated (at most 1.5 N rows)."""
    b, h, n = assignment.shape
    size = max(1, -(-n // (2 * num_clusters)))
    with torch.no_grad():
        sorted_cluster, order = torch.sort(assignment, dim=-1, stable=True)
        counts = torch.zeros(b, h, num_clusters, dtype=torch.long, device=assignment.device)
        counts.scatter_add_(-1, assignment, torch.ones_like(assignment))
        blocks = -(-counts // size)
        nb = int(blocks.sum(-1).max())
        first_block = blocks.cumsum(-1) - blocks
        first_row = counts.cumsum(-1) - counts
        rank = torch.arange(n, device=assignment.device) - first_row.gather(-1, sorted_cluster)
        block = first_block.gather(-1, sorted_cluster) + rank // size
        flat = block * size + rank % size  # [B, H, N] slot of the sorted queries
        slot_query = torch.full((b, h, nb * size), n, dtype=torch.long, device=assignment.device)
        slot_query.scatter_(-1, flat, order)
        query_slot = torch.empty_like(flat).scatter_(-1, order, flat)
        block_cluster = torch.zeros(b, h, nb, dtype=torch.long, device=assignment.device)
        block_cluster.scatter_(-1, block, sorted_cluster)
    return BlockLayout(size, slot_query, query_slot, block_cluster)


class _PermuteRows(torch.autograd.Function):
    """``out[:, :, j] = x_pad[:, :, index[j]]`` for a bijection between the rows of x and
    the entries of ``index`` below the row count R (R = an empty slot, a zero row), with
    ``inverse`` its inverse (R = empty). Autograd's gather backward is a scatter-add into
    zeros; for a bijection it is a gather by the inverse, several times cheaper on CPU."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return _gather_padded(x, index)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return _gather_padded(grad, inverse), None, None


def _gather_padded(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x: [B, H, R, D]`` at ``index: [B, H, S]`` (R = a zero row) -> ``[B, H, S, D]``."""
    b, h, r, d = x.shape
    if index.shape[-1] > r:  # a bijection's index reaches R only if it has more entries
        x = torch.cat([x, x.new_zeros(b, h, 1, d)], dim=2)
    return gather_rows(x, index)


def _gather_last(x: Tensor, index: Tensor) -> Tensor:
    """``x: [B, H, M]`` entries at ``index: [B, H, ...]``."""
    b, h = x.shape[:2]
    return x.gather(2, index.reshape(b, h, -1)).view(index.shape)


@dataclass(frozen=True)
class Draws:
    """All the randomness of one call."""

    scores: Tensor  # [B, max(Nq, Nk), 2] uniform: queries (k-means), keys (covariance sample)
    hyperplanes: Tensor | None  # [B, H, D, r] LSH normals (None without LSH buckets)


def draw(
    q: Tensor, k: Tensor, options: MultipoleOptions, generator: torch.Generator | None
) -> Draws:
    """The fixed-shape hyperplanes first, then one ``[B, N, 2]`` uniform tensor, so that
    right padding of a batch of one draws what truncation draws."""
    b, h, nq, d = q.shape
    planes = None
    if options.lsh_block:
        planes = draw_hyperplanes((b, h), d, options.lsh_hyperplanes, device=q.device,
                                  dtype=q.dtype, generator=generator)
    scores = torch.rand((b, max(nq, k.shape[2]), 2), device=q.device, generator=generator)
    return Draws(scores, planes)


@dataclass(frozen=True)
class PartialSums:
    """sum_j exp(l_ij) [v_j, 1] ~ exp(log_scale) [numerator, denominator] per query."""

    log_scale: Tensor  # [B, H, Nq, 1] (detached)
    numerator: Tensor  # [B, H, Nq, Dv]
    denominator: Tensor  # [B, H, Nq, 1]


def multipole_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    info: AttentionInputs,
    options: MultipoleOptions,
    generator: torch.Generator | None,
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
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    self_attention = nq == nk
    w, lsh, c, t = feature_split(options.num_features, options.window, options.clusters,
                                 self_attention=self_attention, lsh_block=options.lsh_block)
    c = min(c, nq)
    t = min(t, nk)
    if draws is None:
        draws = draw(q, k, options, generator)
    scores = draws.scores
    clusters = kmeans_clusters(
        q, c, valid=info.query_valid, iterations=options.kmeans_iterations,
        sample=options.kmeans_sample, scores=scores[:, :nq, 0],
    )
    c = clusters.centres.shape[2]
    z, a = clusters.centres, clusters.assignment
    exact_blocks = bool((w and self_attention) or lsh)
    # The centre logits only select the near keys (no gradient): the far field rebuilds
    # them in chunks, so they are freed here unless the window/LSH correction needs them.
    with torch.no_grad():
        logits = torch.baddbmm(
            key_bias.reshape(b * h, 1, nk), z.detach().reshape(b * h, c, d),
            k.detach().reshape(b * h, nk, d).transpose(1, 2),
        ).view(b, h, c, nk)  # [B, H, c, Nk]
        if t:
            near_logits, near = logits.topk(t, dim=-1)  # [B, H, c, t]
            near_live = torch.isfinite(near_logits)
            shift = near_logits[..., :1]
            # stored keys-by-centres, the layout the far field's chunks read
            member = torch.zeros(b, h, nk, c, dtype=torch.bool, device=q.device).scatter_(
                2, near.transpose(-1, -2), near_live.transpose(-1, -2)
            ).transpose(-1, -2)  # [B, H, c, Nk] view
        else:
            shift = logits.amax(-1, keepdim=True)
            member = torch.zeros_like(logits, dtype=torch.bool)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        del logits
    dots = z @ k.transpose(-1, -2) if exact_blocks else None  # [B, H, c, Nk]

    rank = dv if options.tilt_rank is None else min(options.tilt_rank, dv)
    basis = value_basis(v, info.key_valid, rank) if rank else None
    sample = None
    if rank and options.tilt_sample is not None and options.tilt_sample < nk:
        key_scores = scores[:, :nk, 1]
        if info.key_valid is not None:
            key_scores = key_scores.masked_fill(~info.key_valid, 2.0)  # uniform scores < 1
        sample = key_scores.topk(options.tilt_sample, dim=1, largest=False, sorted=False).indices
    far = far_field(z, k, v, key_bias, shift, member, info.key_valid, basis, rank, sample,
                    gaussian=gaussian)

    # Near field and far-field expansion on blocks of queries that share a cluster.
    layout = block_layout(a, c)
    nb, size = layout.block_cluster.shape[-1], layout.size
    bc = layout.block_cluster  # [B, H, nb]
    qb = _PermuteRows.apply(q, layout.slot_query, layout.query_slot).view(b, h, nb, size, d)
    delta = qb - gather_rows(z, bc)[..., None, :]  # [B, H, nb, s, D]
    # delta.kbar and (for the tilt) Cov(U^T v, k) delta, with one product per block.
    kbar_tilt = far.kbar[..., None, :]
    if rank:
        kbar_tilt = torch.cat([kbar_tilt, far.tilt], 3)
    kbar_tilt = kbar_tilt.reshape(b, h, c, -1).gather(
        2, bc[..., None].expand(b, h, nb, (rank + 1) * d)
    ).view(b, h, nb, rank + 1, d)
    projected = delta @ kbar_tilt.transpose(-1, -2)  # [B, H, nb, s, 1 + r]

    blocked = [projected]
    if t:
        near_b = near.gather(2, bc[..., None].expand(b, h, nb, t))  # [B, H, nb, t]
        bias_b = _gather_last(key_bias, near_b).masked_fill(
            ~near_live.gather(2, bc[..., None].expand(b, h, nb, t)), _NEG_INF
        )
        # numerator and normaliser from one product (a ones column on the values)
        near_v = gather_rows(torch.cat([v, v.new_ones(b, h, nk, 1)], -1), near_b)
        near_max, near_sums = near_field(
            qb.view(b * h * nb, size, d), gather_rows(k, near_b).view(b * h * nb, t, d),
            bias_b.view(b * h * nb, 1, t), near_v.view(b * h * nb, t, dv + 1),
        )  # [G, s, 1], [G, s, Dv + 1] for G = B H nb blocks
        blocked += [near_max.view(b, h, nb, size, 1), near_sums.view(b, h, nb, size, dv + 1)]
    flat = torch.cat(blocked, -1).view(b, h, nb * size, -1)
    flat = _PermuteRows.apply(flat, layout.query_slot, layout.slot_query)  # query order
    # split (not sliced: the backward pass then concatenates instead of summing
    # zero-padded copies of the whole tensor)
    pieces = flat.split([1, rank] + ([1, dv, 1] if t else []), dim=-1)
    delta_kbar, shift_r = pieces[:2]
    parts = []
    if t:
        near_max, near_num, near_den = pieces[2:]
        parts.append((torch.where(near_den > 0, near_max, _NEG_INF), near_num, near_den))

    log_far = _gather_last(far.log_mass, a)[..., None] + delta_kbar  # [B, H, Nq, 1]
    v_far = gather_rows(far.vbar, a)  # [B, H, Nq, Dv]
    if rank:
        v_far = v_far + (shift_r if basis is None else shift_r @ basis.transpose(-1, -2))
        # Keep the tilted mean inside the values' range (the expansion is first order).
        low, high = _value_range(v, info.key_valid)
        # As torch.clamp (gradient 1 inside the range, 0 outside), whose CPU kernel with
        # tensor bounds is ~10x slower than a comparison and a where.
        inside = (v_far >= low) & (v_far <= high)
        v_far = torch.where(inside, v_far, torch.minimum(torch.maximum(v_far.detach(), low), high))
    far_live = _gather_last(far.live, a)[..., None]  # [B, H, Nq, 1]
    far_num, far_den = v_far, torch.ones_like(log_far)
    blocks = None
    if w and self_attention:
        blocks = window_blocks(b, h, nq, w, q.device)
    elif lsh:
        blocks = lsh_blocks(q, k, draws.hyperplanes, lsh, info.query_valid, info.key_valid)
    if blocks is not None:
        assert dots is not None
        exact_part, removed_num, removed_den = exact_blocks_part(
            q, k, v, key_bias, dots, member, a, far.log_mass, far_live, delta_kbar, blocks
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
    """Per-coordinate min and max of the valid values, ``[B, H, 1, Dv]`` each."""
    vv = v.detach()
    if key_valid is None:
        low, high = vv.amin(2, keepdim=True), vv.amax(2, keepdim=True)
    else:
        real = key_valid[:, None, :, None]
        low = vv.masked_fill(~real, float("inf")).amin(2, keepdim=True)
        high = vv.masked_fill(~real, float("-inf")).amax(2, keepdim=True)
        low = torch.where(torch.isfinite(low), low, torch.zeros_like(low))
        high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
    return low, high


def _merge(parts: list[tuple[Tensor, Tensor, Tensor]]) -> PartialSums:
    """Combine (log scale, numerator, denominator) triples in log space; a part with
    scale -inf is empty. The common scale is 0 for rows where every part is empty."""
    top = _safe_max(torch.stack([p[0] for p in parts], -1), -1)[..., 0]
    weights = [(p[0] - top).exp() for p in parts]
    # summed from the first term (Python's sum would add it to 0, a full extra pass)
    num, den = weights[0] * parts[0][1], weights[0] * parts[0][2]
    for weight, part in zip(weights[1:], parts[1:]):
        num = num + weight * part[1]
        den = den + weight * part[2]
    return PartialSums(top, num, den)
