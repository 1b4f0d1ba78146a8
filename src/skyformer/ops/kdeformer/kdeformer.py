"""KDEformer: sparse LSH blocks plus importance-sampled residual columns.

Zandieh, Han, Daliri, Karbasi, "KDEformer: Accelerating Transformers via Kernel
Density Estimation" (ICML 2023), ``shared/papers/004_*.txt``. With A = exp(s Q K^T)
and D = diag(A 1), Algorithm 3 (the practical version of Algorithm 1) computes

    Att~ = D~^-1 A_spar V + D~^-1 A_res Pi_res^T Pi_res V            (eq. (11))

where A_spar keeps the entries of query/key pairs in the same bucket of the
equal-sized angular LSH (Definition A.3, ``sketch.lsh_blocks``), A_res = A - A_spar,
and Pi_res samples m columns i.i.d. with probabilities (Algorithm 3 line 3)

    p_j  ∝  ||D~^-1 A_res e_j||^2 + gamma ||v_j||^2,    gamma = ||V||_op^-2,

row r of Pi_res being e_{l_r}^T / sqrt(m p_{l_r}) (Algorithm 1 lines 6-7).

What is exact and what is estimated:

- exact: A_spar (all entries of the diagonal blocks, block size ``block_size``), the
  value norms ||v_j|| and gamma (from the eigenvalues of V^T V, where the paper uses a
  power method), the sampled columns of A_res.
- estimated, alpha ~ diag(D) (Algorithm 1 line 3, WExpKDE): alpha_i = the exact row
  sum of A_spar + the row sum of A_res estimated from ``kde_samples`` keys drawn
  uniformly among the real keys ((n / s) sum over the samples outside i's block) - a
  random-sampling KDE in place of the paper's Gaussian-KDE data structure. It weighs
  the column norms below and, with ``normalizer="kde"``, is D~.
- estimated, the residual column norms ||D~^-1 A_res e_j||^2 (Algorithm 1 line 4,
  Algorithm 3 line 3): from ``kde_samples`` queries drawn uniformly.
- estimated, A_res V (and with ``normalizer="sampled"`` also A_res 1): the AMM of
  Lemma 3.2 with the m importance-sampled columns.

``normalizer="sampled"`` (default) divides by A_spar 1 + A_res Pi^T Pi 1: the same
importance-sampled estimate applied to a column of ones, as the authors' released code
does; every output row is then a convex combination of values. ``"kde"`` divides by
alpha, as Algorithm 3 returns it. The paper's alpha comes from a KDE oracle with a
(1 +- eps) guarantee; the uniform-sampling stand-in has none, and on peaked rows it
misses the keys that dominate while the importance samples find them: numerator and
denominator then disagree without bound (on MiniLM-L6 layer 0, N = 512, a relative
spectral error of 6.5e5 against 0.36 with ``"sampled"``).

Budget (``num_features`` = k, as in the paper's comparison code for its Figure 4):
m = k sampled residual columns and blocks of ``block_size`` = k/2 keys, so a query
row touches k/2 + k keys (the paper reports 1.5 k), plus the ``kde_samples``
estimates; memory O(N (block_size + m + 2 kde_samples)) per head, never N x N.
``block_size=0`` drops the sparse part: Algorithm 1 with sampled KDE estimates.
Every sample is drawn with a shape independent of N, and uniform indices are taken
among the real rows in sequence order, so for one sequence right padding draws the
same samples as truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...registry import Capabilities, register
from ...sketch import (
    LshBlocks,
    draw_hyperplanes,
    gather_block_rows,
    gather_block_values,
    scatter_block_rows,
)
from ...sketch.rng import random_key, stream, uniform
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    compute_dtype,
    mean_values,
    resolve_key,
    zero_padded_queries,
)
from ..shared.lsh_blocks import LshBlockOptions, lsh_block_logits
from ..shared.options import check_choice, check_optional_positive_int, check_scale

NORMALIZERS = ("kde", "sampled")


@dataclass(frozen=True)
class KDEformerConfig(LshBlockOptions):
    """Options of KDEformer (Algorithm 3); defaults follow the paper's comparison code.

    num_features: m, importance-sampled residual columns (128).
    kde_samples: uniformly sampled keys (for alpha) and queries (for the column
        norms) of the KDE estimates; None = num_features.
    normalizer: ``"sampled"`` (D~ from the importance samples, as the authors' code) or
        ``"kde"`` (D~ = diag(alpha), literally Algorithm 3; unstable, see module doc).
    scale: logit scale s, None = 1/sqrt(head dim).
    """

    kde_samples: int | None = None
    normalizer: str = "sampled"
    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate("kdeformer")
        check_optional_positive_int("kdeformer", "kde_samples", self.kde_samples)
        check_choice("kdeformer", "normalizer", self.normalizer, NORMALIZERS)
        check_scale("kdeformer", self.scale)

    @property
    def samples(self) -> int:
        return self.num_features if self.kde_samples is None else self.kde_samples


@dataclass(frozen=True)
class KDEformerDraws:
    """All randomness of one call, drawn before any data-dependent step."""

    hyperplanes: Tensor | None  # [B, H, D, r] (None without a sparse part)
    key_uniform: Tensor  # [B, H, kde_samples] in [0, 1): keys for alpha
    query_uniform: Tensor  # [B, H, kde_samples]: queries for the column norms
    column_uniform: Tensor  # [B, H, num_features]: inverse-CDF draws of Pi_res


def draw_kdeformer(
    batch: int, heads: int, dim: int, cfg: KDEformerConfig, *, device: torch.device | str = "cpu",
    generator: torch.Generator | Tensor | None = None,
) -> KDEformerDraws:
    """Draw the hyperplanes and uniforms of one call (shapes independent of N), each
    batch element and head from its own counter-based stream (``sketch/rng.py``)."""
    key = random_key(generator, device)
    planes = None
    if cfg.blocks > 0:
        planes = draw_hyperplanes((batch, heads), dim, cfg.num_hyperplanes, device=device,
                                  generator=key)
    shape = (batch, heads)
    return KDEformerDraws(
        planes,
        uniform(stream(key, "kdeformer/keys"), (*shape, cfg.samples)),
        uniform(stream(key, "kdeformer/queries"), (*shape, cfg.samples)),
        uniform(stream(key, "kdeformer/columns"), (*shape, cfg.num_features)),
    )


def uniform_rows(u: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Map uniforms ``u [B, H, s]`` to real rows: the floor(u n)-th real row (in sequence
    order) of each batch element; ``valid [B, N]``. Returns ``(index [B, H, s], live)``,
    live = False where the element has no real row."""
    b, n = valid.shape
    count = valid.sum(-1)  # [B]
    real_first = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices  # [B, N]
    t = (u.double() * count[:, None, None]).floor().long()  # exact: 24-bit u times n < 2^29
    t = torch.minimum(t, (count - 1).clamp_min(0)[:, None, None])
    index = real_first[:, None, :].expand(b, u.shape[1], n).gather(-1, t)
    return index, (count > 0)[:, None, None].expand_as(index)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """``x [B, H, N, C]`` at ``index [B, H, s]`` -> ``[B, H, s, C]``."""
    return gather_rows(x, index)


def _finite_or(x: Tensor, fallback: Tensor | float) -> Tensor:
    return torch.where(torch.isfinite(x), x, fallback)


def sampling_log_probabilities(
    log_column_norms: Tensor, v: Tensor, key_valid: Tensor
) -> Tensor:
    """log p_j of Algorithm 3 line 3: p_j ∝ ||D~^-1 A_res e_j||^2 + gamma ||v_j||^2,
    normalised over the real keys (-inf for padded ones).

    ``log_column_norms [B, H, Nk]`` (log of the squared residual column norms),
    ``v [B, H, Nk, Dv]``, ``key_valid [B, Nk]``. Rows where every term vanishes fall
    back to uniform over the real keys.
    """
    real = key_valid[:, None, :]
    vv = v * real[..., None].to(v.dtype)
    gram = vv.transpose(-1, -2) @ vv  # [B, H, Dv, Dv]
    top = torch.linalg.eigvalsh(gram.double())[..., -1].to(v.dtype)  # ||V||_op^2
    sq = (vv * vv).sum(-1)  # [B, H, Nk]
    log_gv = torch.where(
        (top[..., None] > 0) & (sq > 0), sq.log() - top.clamp_min(1e-300).log()[..., None],
        float("-inf"),
    )
    log_p = torch.logaddexp(log_column_norms, log_gv).masked_fill(~real, float("-inf"))
    empty = ~torch.isfinite(log_p).any(-1, keepdim=True)
    no_real = ~real.any(-1, keepdim=True)  # then every draw is discarded by the caller
    log_p = torch.where(empty & (real | no_real), 0.0, log_p)
    return torch.log_softmax(log_p, dim=-1)


@dataclass(frozen=True)
class _SparsePart:
    """A_spar of one call: each token's LSH block (-1/-2 without blocks, so that no
    query and key share one) and the exact block logits."""

    q_block: Tensor  # [B, H, Nq]
    k_block: Tensor  # [B, H, Nk]
    blocks: LshBlocks | None
    logits: Tensor | None  # [B, H, nb, sq, sk], padded keys -inf
    row_max: Tensor  # [B, H, Nq] largest block logit of each query (-inf without)


def _sparse_part(qs: Tensor, k: Tensor, info: AttentionInputs,
                 cfg: KDEformerConfig, draws: KDEformerDraws) -> _SparsePart:
    """Exact entries of the Hamming-ordered LSH blocks (Definition A.3, Figure 6)."""
    b, h, nq, _ = qs.shape
    if cfg.blocks == 0:
        return _SparsePart(
            torch.full((b, h, nq), -1, dtype=torch.long, device=qs.device),
            torch.full((b, h, k.shape[2]), -2, dtype=torch.long, device=qs.device),
            None, None, torch.full((b, h, nq), float("-inf"), dtype=qs.dtype, device=qs.device),
        )
    exact = lsh_block_logits(qs, k, draws.hyperplanes, cfg.blocks, info.query_valid,
                             info.key_valid)
    blocks = exact.blocks
    return _SparsePart(blocks.q_block, blocks.k_block, blocks, exact.logits, exact.row_max)


def _sparse_sums(sparse: _SparsePart, v: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """A_spar V and A_spar 1 in units of exp(shift): ``[B, H, Nq, Dv]``, ``[B, H, Nq]``."""
    b, h, nq = shift.shape
    if sparse.blocks is None:
        return (torch.zeros(b, h, nq, v.shape[-1], dtype=v.dtype, device=v.device),
                torch.zeros(b, h, nq, dtype=v.dtype, device=v.device))
    blocks = sparse.blocks
    e = torch.exp(sparse.logits - gather_block_values(shift, blocks.q_index, 0.0)[..., None])
    numerator = scatter_block_rows(e @ gather_block_rows(v, blocks.k_index), blocks)
    return numerator, scatter_block_rows(e.sum(-1, keepdim=True), blocks)[..., 0]


def _off_block(q_block: Tensor, k_block: Tensor, live: Tensor) -> Tensor:
    """``[..., Nq, s]``: entries outside every query's LSH block, for live samples."""
    return (q_block[..., :, None] != k_block[..., None, :]) & live[..., None, :]


@torch.no_grad()
def _residual_columns(
    qs: Tensor, k: Tensor, v: Tensor, sparse: _SparsePart, alpha: Tensor, shift: Tensor,
    query_ok: Tensor, key_ok: Tensor, cfg: KDEformerConfig, draws: KDEformerDraws,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pi_res (Algorithm 1 lines 6-7): ``num_features`` i.i.d. residual columns drawn by
    inverse CDF from the estimated residual column norms ||D~^-1 A_res e_j||^2 (from
    uniformly sampled queries, in log space against overflow). No gradient: they only
    shape the sampling distribution. Returns ``(index, live, weight)``, each ``[B, H, m]``.
    """
    b, h, nk = k.shape[0], k.shape[1], k.shape[2]
    neg_inf = float("-inf")
    n_queries = query_ok.sum(-1).to(qs.dtype)[:, None, None]
    idx_q, live_q = uniform_rows(draws.query_uniform, query_ok)
    off_q = (sparse.q_block.gather(-1, idx_q)[..., :, None] != sparse.k_block[..., None, :]) \
        & live_q[..., :, None] & key_ok[:, None, None, :]
    log_alpha = _finite_or(alpha.gather(-1, idx_q).log(), neg_inf)
    log_entry = (_rows(qs, idx_q) @ k.transpose(-1, -2)) \
        - (shift.gather(-1, idx_q) + log_alpha)[..., None]  # log (D~^-1 A)_{i_r, j}
    log_entry = log_entry.masked_fill(~off_q | ~torch.isfinite(log_alpha)[..., None], neg_inf)
    log_norms = torch.logsumexp(2 * log_entry, dim=-2) + (n_queries / cfg.samples).log()
    p = sampling_log_probabilities(log_norms, v, key_ok).exp()  # [B, H, Nk]
    cdf = p.cumsum(-1)
    index = torch.searchsorted(cdf, draws.column_uniform.to(cdf.dtype) * cdf[..., -1:],
                               right=True).clamp_max(nk - 1)
    p_c = p.gather(-1, index)
    live = (p_c > 0) & key_ok[:, None, :].expand(b, h, nk).gather(-1, index)
    weight = torch.where(live, 1.0 / (cfg.num_features * p_c.clamp_min(1e-300)), 0.0)
    return index, live, weight


def kdeformer_core(
    q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs, cfg: KDEformerConfig,
    draws: KDEformerDraws,
) -> Tensor:
    """Algorithm 3 for given draws. Inputs in the working dtype; ``[B, H, Nq, Dv]``."""
    b, _, nq, _ = q.shape
    nk = k.shape[2]
    s = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(info.head_dim)
    qs = q * s
    neg_inf = float("-inf")
    key_ok = info.key_valid if info.key_valid is not None else torch.ones(
        b, nk, dtype=torch.bool, device=q.device)
    query_ok = info.query_valid if info.query_valid is not None else torch.ones(
        b, nq, dtype=torch.bool, device=q.device)
    sparse = _sparse_part(qs, k, info, cfg, draws)

    # alpha (Algorithm 1 line 3): exact block row sums + uniform-sample estimate of the rest.
    n_keys = key_ok.sum(-1).to(q.dtype)[:, None, None]  # [B, 1, 1]
    idx_k, live_k = uniform_rows(draws.key_uniform, key_ok)
    off_k = _off_block(sparse.q_block, sparse.k_block.gather(-1, idx_k), live_k)
    logits_k = (qs @ _rows(k, idx_k).transpose(-1, -2)).masked_fill(~off_k, neg_inf)
    shift = _finite_or(torch.maximum(sparse.row_max, logits_k.detach().amax(-1)), 0.0)
    residual_sum = torch.exp(logits_k - shift[..., None]).sum(-1) * (n_keys / cfg.samples)
    spar_num, spar_den = _sparse_sums(sparse, v, shift)
    alpha = spar_den + residual_sum  # [B, H, Nq], in units of exp(shift)

    idx_c, live_c, weight = _residual_columns(
        qs, k, v, sparse, alpha, shift, query_ok, key_ok, cfg, draws)
    off_c = _off_block(sparse.q_block, sparse.k_block.gather(-1, idx_c), live_c)
    logits_c = (qs @ _rows(k, idx_c).transpose(-1, -2)).masked_fill(~off_c, neg_inf)
    shift2 = torch.maximum(shift, _finite_or(logits_c.detach().amax(-1), neg_inf))
    a_c = torch.exp(logits_c - shift2[..., None]) * weight[..., None, :]  # [B, H, Nq, m]
    factor = torch.exp(shift - shift2)[..., None]  # rescales terms computed with `shift`
    numerator = spar_num * factor + a_c @ _rows(v, idx_c)
    if cfg.normalizer == "sampled":
        denominator = spar_den[..., None] * factor + a_c.sum(-1, keepdim=True)
    else:
        denominator = alpha[..., None] * factor
    ok = denominator > 0
    return torch.where(ok, numerator / torch.where(ok, denominator, 1.0),
                       mean_values(v, info.key_valid))


@register(
    "kdeformer",
    KDEformerConfig,
    Capabilities(target="softmax", randomized=True),
    summary="angular-LSH sparse blocks + importance-sampled residual columns (KDEformer)",
)
def kdeformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: KDEformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """KDEformer attention (Zandieh et al. 2023, Algorithm 3 with Algorithm 1's estimates).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token; padded keys are never
            in a block with real queries, never sampled, and get zero weight.
        generator: draws the hyperplanes and all samples.
        num_features, block_size, num_hyperplanes, kde_samples, normalizer, scale: see
            ``KDEformerConfig``.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="kdeformer",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("kdeformer", generator, q.device)
    draws = draw_kdeformer(info.batch, info.heads, info.head_dim, config, device=q.device,
                           generator=key)
    dtype = q.dtype
    work = compute_dtype(dtype)
    out = kdeformer_core(q.to(work), k.to(work), v.to(work), info, config, draws)
    return zero_padded_queries(out, info.query_valid).to(dtype)
