"""KDEformer: sparse LSH blocks plus importance-sampled residual columns.

Zandieh, Han, Daliri, Karbasi, "KDEformer: Accelerating Transformers via Kernel
Density Estimation" (ICML 2023), arXiv:2302.02451. With A = exp(s Q K^T)
and D = diag(A 1), Algorithm 3 (the practical version of Algorithm 1) computes

    Att~ = D~^-1 A_spar V + D~^-1 A_res Pi_res^T Pi_res V            (eq. (11))

where A_spar keeps the entries of query/key pairs in the same bucket of the
equal-sized angular LSH (Definition A.3, ``sketch.lsh_blocks``), A_res = A - A_spar,
and Pi_res samples m = ``num_features`` columns, row r of Pi_res being
e_{l_r}^T / sqrt(m p_{l_r}) (Algorithm 1 lines 6-7), so that Pi_res^T Pi_res is an
unbiased estimate of the identity on the columns where p > 0 (every real column unless
``mix=1``, see below). The output is self-normalised, as in
the authors' released code: D~ = A_spar 1 + A_res Pi^T Pi 1 (``normalizer="sampled"``).

The paper samples columns by their norms in D^-1 A_res (Algorithm 1 line 5, Algorithm 3
line 3), estimated with a Gaussian-KDE data structure (WExpKDE, Algorithm 2, super-linear
time). Two estimators of those norms (``estimator``):

- ``"rows"`` (default), O(N r d) time, O(N r) memory: r = ``kde_rows`` query rows,
  one uniformly inside each of r equal strata of the real queries, are computed in
  full; their exact softmax rows (entries of the row's own block dropped) give the
  unbiased estimate beta_j = (n / r) sum_rows P_ij^2 of ||D^-1 A_res e_j||^2. The
  distribution is the mixture
      p = mix * sqrt(beta) / sum sqrt(beta) + (1 - mix) * p_v,
      p_v_j  ∝  ||[v_j 1]|| / ||[V 1]||_op^2 + 1/n,
  where sqrt(beta) (column norms, not squared) is the attention's factor of the
  Frobenius-optimal AMM weights ||D^-1 A_res e_j|| ||v_j|| for (D^-1 A_res) V, and
  p_v, the value-norm-plus-uniform distribution of the authors' released code, keeps
  every weight 1/(m p) below n (1 + sqrt(Dv + 1)) / ((1 - mix) m) (defensive mixture,
  README.md; ``mix=0`` is exactly the released code's distribution).
- ``"uniform"``: the earlier estimator of this library, Algorithm 3 line 3 literally,
  p ∝ ||D~^-1 A_res e_j||^2 + gamma ||v_j||^2 (gamma = ||V||_op^-2) with D~ and the
  column norms from ``kde_samples`` uniformly drawn keys and queries. Needed by
  ``normalizer="kde"`` (D~ = alpha, literally Algorithm 3; unbounded on peaked rows).

Columns are drawn (``sampler``) either systematically (default: one uniform u, the m
points (t + u)/m on the CDF of p taken over the keys in their LSH (Gray-rank) order,
so heavy columns are always taken and the rest spread over angular strata; each
column's expected count is still m p_j) or i.i.d. by inverse CDF (Algorithm 1).

Budget (``num_features`` = m, as in the paper's comparison code for its Figure 4):
blocks of ``block_size`` = m/2 keys and m sampled residual columns per query, plus
(``"rows"``) r = m/4 full rows, r N logits, i.e. r per query on average: the paper's
feature dimension (memory at most N k) is k = m/2 + m + m/4 = 1.75 m, against the
released code's 1.5 m (``"uniform"``: m/2 + m + 2 ``kde_samples`` = 3.5 m).
``block_size=0`` drops the sparse part. Every sample is drawn with a shape independent
of N, and rows are taken by rank among the real rows, so for one sequence right padding
draws the same samples as truncation.

Gradients: p is detached on purpose. The importance-weighted sums are unbiased for any
fixed p, so with p fixed their gradient is an unbiased estimate of the expected output's
gradient; the derivative of one draw through p is not, so ``gradcheck`` does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gather_rows, with_ones_column
from ...linalg.functional_ops import no_derivatives
from ...linalg.kernels import finite_matrices
from ...linalg.scores import logit_scale
from ...linalg.top_eigenvalue import top_eigenvalue_psd
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
from ..shared.normalised import normalised_or
from ..shared.options import (
    check_budget,
    check_choice,
    check_nonnegative_float,
    check_optional_positive_int,
    check_scale,
)
from ..shared.real_first import real_positions_first

NORMALIZERS = ("kde", "sampled")
ESTIMATORS = ("rows", "uniform")
SAMPLERS = ("systematic", "iid")


@dataclass(frozen=True)
class KDEformerConfig(LshBlockOptions):
    """Options of KDEformer (Algorithm 3); defaults follow the paper's comparison code.

    num_features: m, importance-sampled residual columns (128).
    estimator: how the residual column norms behind p are estimated: ``"rows"``
        (``kde_rows`` full query rows) or ``"uniform"`` (the earlier estimator, see
        module doc).
    kde_rows: r, the query rows of the ``"rows"`` estimator; None = max(1, m // 4).
    mix: weight of the estimated column norms in p (``"rows"``); the rest is the
        value-norm + uniform distribution of the authors' code (None = 0.5; 0 = that
        code's p; 1 = the estimated norms alone (Algorithm 1 line 5 draws by squared norms plus
        a value term), where a column whose
        estimate is 0, because every sampled row shares its LSH block, is never drawn:
        a bias, small but measurable, that any mix < 1 avoids).
    sampler: ``"systematic"`` (along the LSH order of the keys) or ``"iid"``.
    kde_samples: uniformly sampled keys (for alpha) and queries (for the column
        norms) of the ``"uniform"`` estimator; None = num_features.
    An option of the other estimator (``kde_samples`` with ``"rows"``; ``kde_rows`` or
    ``mix`` with ``"uniform"``) would have no effect and is refused.
    normalizer: ``"sampled"`` (D~ from the importance samples, as the authors' code) or
        ``"kde"`` (D~ = diag(alpha), literally Algorithm 3; needs
        ``estimator="uniform"``; unstable, see module doc).
    scale: logit scale s, None = 1/sqrt(head dim).
    """

    estimator: str = "rows"
    kde_rows: int | None = None
    mix: float | None = None
    sampler: str = "systematic"
    kde_samples: int | None = None
    normalizer: str = "sampled"
    scale: float | None = None

    @property
    def inexact_gradient_because(self) -> str:
        """Why the backward is not the derivative of the output (``skyformer check``)."""
        return ("its sampling probabilities are constants for autograd (module "
                "docstring): the gradient is that of a fixed sampling distribution, not the "
                "derivative of one draw")

    def __post_init__(self) -> None:
        self.validate("kdeformer")
        check_choice("kdeformer", "estimator", self.estimator, ESTIMATORS)
        check_optional_positive_int("kdeformer", "kde_rows", self.kde_rows)
        if self.kde_rows is not None:  # a draw per row, whatever the sequence's length
            check_budget("kdeformer", "kde_rows", self.kde_rows)
        if self.mix is not None:
            check_nonnegative_float("kdeformer", "mix", self.mix)
            if self.mix > 1:
                raise ValueError(f"kdeformer: mix must be a number in [0, 1], got {self.mix!r}.")
        check_choice("kdeformer", "sampler", self.sampler, SAMPLERS)
        check_optional_positive_int("kdeformer", "kde_samples", self.kde_samples)
        if self.kde_samples is not None:
            check_budget("kdeformer", "kde_samples", self.kde_samples)
        self._refuse_options_of_the_other_estimator()
        self.refuse_unused_hyperplanes(
            "kdeformer", "block_size=0 leaves no sparse part" if self.blocks == 0 else None)
        check_choice("kdeformer", "normalizer", self.normalizer, NORMALIZERS)
        if self.normalizer == "kde" and self.estimator != "uniform":
            raise ValueError(
                "kdeformer: normalizer='kde' divides by the KDE row sums alpha, which only "
                "estimator='uniform' computes; pass estimator='uniform' with it."
            )
        check_scale("kdeformer", self.scale)

    def _refuse_options_of_the_other_estimator(self) -> None:
        """``kde_samples`` only acts with ``"uniform"``, ``kde_rows`` and ``mix`` only with
        ``"rows"``: given with the other estimator they ran without effect."""
        other = "uniform" if self.estimator == "rows" else "rows"
        unused = ("kde_samples",) if self.estimator == "rows" else ("kde_rows", "mix")
        given = [name for name in unused if getattr(self, name) is not None]
        if given:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in given)
            raise ValueError(
                f"kdeformer: {values} has no effect with estimator={self.estimator!r} (only "
                f"estimator={other!r} uses it); pass estimator={other!r} or leave "
                f"{' and '.join(given)} out."
            )

    @property
    def mix_weight(self) -> float:
        """mix, 0.5 when not given."""
        return 0.5 if self.mix is None else self.mix

    @property
    def samples(self) -> int:
        return self.num_features if self.kde_samples is None else self.kde_samples

    @property
    def rows(self) -> int:
        return max(1, self.num_features // 4) if self.kde_rows is None else self.kde_rows


@dataclass(frozen=True)
class KDEformerDraws:
    """All randomness of one call, drawn before any data-dependent step."""

    hyperplanes: Tensor | None  # [B, H, D, r] (None without a sparse part)
    key_uniform: Tensor | None  # [B, H, kde_samples] in [0, 1): keys for alpha ("uniform")
    query_uniform: Tensor | None  # [B, H, kde_samples]: queries for the norms ("uniform")
    row_uniform: Tensor | None  # [B, H, kde_rows]: one query per stratum ("rows")
    column_uniform: Tensor  # [B, H, num_features]: draws of Pi_res ("systematic": the first)


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
    legacy = cfg.estimator == "uniform"
    return KDEformerDraws(
        planes,
        uniform(stream(key, "kdeformer/keys"), (*shape, cfg.samples)) if legacy else None,
        uniform(stream(key, "kdeformer/queries"), (*shape, cfg.samples)) if legacy else None,
        None if legacy else uniform(stream(key, "kdeformer/rows"), (*shape, cfg.rows)),
        uniform(stream(key, "kdeformer/columns"), (*shape, cfg.num_features)),
    )


def uniform_rows(u: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Map uniforms ``u [B, H, s]`` to real rows: the floor(u n)-th real row (in sequence
    order) of each batch element; ``valid [B, N]``. Returns ``(index [B, H, s], live)``,
    live = False where the element has no real row."""
    b, n = valid.shape
    count = valid.sum(-1)  # [B]
    real_first = real_positions_first(valid)  # [B, N]
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
    vd = vv.double()  # float32 values of 1e19 square to inf
    gram = finite_matrices(vd.transpose(-1, -2) @ vd)  # [B, H, Dv, Dv]
    top = torch.linalg.eigvalsh(gram)[..., -1].to(v.dtype)  # ||V||_op^2
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


@no_derivatives
def _uniform_estimate_probabilities(
    qs: Tensor, k: Tensor, v: Tensor, sparse: _SparsePart, alpha: Tensor, shift: Tensor,
    query_ok: Tensor, key_ok: Tensor, cfg: KDEformerConfig, draws: KDEformerDraws,
) -> Tensor:
    """p of the ``"uniform"`` estimator ``[B, H, Nk]``: Algorithm 3 line 3 with the
    residual column norms ||D~^-1 A_res e_j||^2 estimated from ``kde_samples`` uniformly
    drawn queries (in log space against overflow). No gradient: p only shapes Pi_res."""
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
    return sampling_log_probabilities(log_norms, v, key_ok).exp()


def value_norm_probabilities(v: Tensor, key_ok: Tensor) -> Tensor:
    """The distribution of the authors' released code, over the real keys ``[B, H, Nk]``:
    p_j ∝ ||[v_j 1]|| / ||[V 1]||_op^2 + 1/n (the top eigenvalue of [V 1]^T [V 1] to
    1e-11 where that code runs a power method; ``top_eigenvalue_psd``, no host wait)."""
    real = key_ok[:, None, :].to(v.dtype)  # [B, 1, Nk]
    y = with_ones_column(v) * real[..., None]
    yd = y.double()
    top = top_eigenvalue_psd(finite_matrices(yd.transpose(-1, -2) @ yd)).to(v.dtype)
    n = real.sum(-1, keepdim=True).clamp_min(1.0)
    p = (y.norm(dim=-1) / top.clamp_min(1e-300)[..., None] + 1.0 / n) * real
    total = p.sum(-1, keepdim=True)
    return p / torch.where(total > 0, total, 1.0)


def stratified_rows(u: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """One real row uniformly inside each of the r equal strata (by rank among the real
    rows) for ``u [B, H, r]``: row floor((t + u_t) n / r) of stratum t. Every real row is
    taken r/n times in expectation. Returns ``(index, live)`` as ``uniform_rows``."""
    r = u.shape[-1]
    t = torch.arange(r, device=u.device, dtype=torch.float64)
    return uniform_rows((t + u.double()) / r, valid)


@no_derivatives
def row_estimate_probabilities(
    qs: Tensor, k: Tensor, v: Tensor, q_block: Tensor, k_block: Tensor,
    query_ok: Tensor, key_ok: Tensor, cfg: KDEformerConfig, row_uniform: Tensor,
) -> Tensor:
    """p of the ``"rows"`` estimator ``[B, H, Nk]`` (module doc): the exact softmax rows
    of ``kde_rows`` stratified queries give beta_j ≈ ||D^-1 A_res e_j||^2, and
    p = mix sqrt(beta)/sum sqrt(beta) + (1 - mix) p_v. O(N r d); no gradient."""
    neg_inf = float("-inf")
    idx_q, live_q = stratified_rows(row_uniform, query_ok)
    logits = (_rows(qs, idx_q) @ k.transpose(-1, -2)).masked_fill(
        ~key_ok[:, None, None, :], neg_inf)  # [B, H, r, Nk]
    row_max = _finite_or(logits.amax(-1, keepdim=True), 0.0)
    e = torch.exp(logits - row_max)
    total = e.sum(-1, keepdim=True)
    probs = e / torch.where(total > 0, total, 1.0)  # exact softmax rows
    off = (q_block.gather(-1, idx_q)[..., :, None] != k_block[..., None, :]) \
        & live_q[..., :, None]
    probs = torch.where(off, probs, 0.0)
    n_queries = query_ok.sum(-1).to(qs.dtype)[:, None, None]
    norms = ((probs * probs).sum(-2) * (n_queries / cfg.rows)).sqrt()  # ||D^-1 A_res e_j||
    norm_sum = norms.sum(-1, keepdim=True)
    p_v = value_norm_probabilities(v, key_ok)
    p_norms = torch.where(norm_sum > 0, norms / torch.where(norm_sum > 0, norm_sum, 1.0), p_v)
    return cfg.mix_weight * p_norms + (1.0 - cfg.mix_weight) * p_v


def draw_columns(p: Tensor, order: Tensor, key_ok: Tensor, cfg: KDEformerConfig,
                 column_uniform: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Pi_res (Algorithm 1 lines 6-7) from ``p [B, H, Nk]``: ``num_features`` columns,
    systematic along ``order [B, H, Nk]`` or i.i.d. by inverse CDF. Returns
    ``(index, live, weight)``, each ``[B, H, m]``, weight = 1/(m p_l)."""
    b, h, nk = p.shape
    m = cfg.num_features
    if cfg.sampler == "iid":
        order = torch.arange(nk, device=p.device).expand(b, h, nk)
        points = column_uniform.to(p.dtype)
    else:
        t = torch.arange(m, device=p.device, dtype=p.dtype)
        points = (t + column_uniform[..., :1].to(p.dtype)) / m
    cdf = p.gather(-1, order).cumsum(-1)
    pos = torch.searchsorted(cdf, points * cdf[..., -1:], right=True).clamp_max(nk - 1)
    index = order.gather(-1, pos)
    p_c = p.gather(-1, index)
    live = (p_c > 0) & key_ok[:, None, :].expand(b, h, nk).gather(-1, index)
    weight = torch.where(live, 1.0 / (m * p_c.clamp_min(1e-300)), 0.0)
    return index, live, weight


def kdeformer_core(
    q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs, cfg: KDEformerConfig,
    draws: KDEformerDraws,
) -> Tensor:
    """Algorithm 3 for given draws. Inputs in the working dtype; ``[B, H, Nq, Dv]``."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    s = logit_scale(info.head_dim, cfg.scale)
    qs = q * s
    neg_inf = float("-inf")
    key_ok = info.key_valid if info.key_valid is not None else torch.ones(
        b, nk, dtype=torch.bool, device=q.device)
    query_ok = info.query_valid if info.query_valid is not None else torch.ones(
        b, nq, dtype=torch.bool, device=q.device)
    sparse = _sparse_part(qs, k, info, cfg, draws)

    if cfg.estimator == "uniform":
        # alpha (Algorithm 1 line 3): exact block row sums + uniform-sample estimate.
        n_keys = key_ok.sum(-1).to(q.dtype)[:, None, None]  # [B, 1, 1]
        idx_k, live_k = uniform_rows(draws.key_uniform, key_ok)
        off_k = _off_block(sparse.q_block, sparse.k_block.gather(-1, idx_k), live_k)
        logits_k = (qs @ _rows(k, idx_k).transpose(-1, -2)).masked_fill(~off_k, neg_inf)
        reached = torch.maximum(sparse.row_max, logits_k.detach().amax(-1))
        shift = _finite_or(reached, 0.0)
        residual_sum = torch.exp(logits_k - shift[..., None]).sum(-1) * (n_keys / cfg.samples)
        spar_num, spar_den = _sparse_sums(sparse, v, shift)
        alpha = spar_den + residual_sum  # [B, H, Nq], in units of exp(shift)
        p = _uniform_estimate_probabilities(qs, k, v, sparse, alpha, shift, query_ok, key_ok,
                                            cfg, draws)
    else:
        reached = sparse.row_max
        shift = _finite_or(reached, 0.0)
        spar_num, spar_den = _sparse_sums(sparse, v, shift)
        alpha = spar_den
        p = row_estimate_probabilities(qs, k, v, sparse.q_block, sparse.k_block, query_ok,
                                       key_ok, cfg, draws.row_uniform)
    order = sparse.blocks.k_order if sparse.blocks is not None else \
        torch.arange(nk, device=q.device).expand(b, h, nk)
    idx_c, live_c, weight = draw_columns(p, order, key_ok, cfg, draws.column_uniform)
    off_c = _off_block(sparse.q_block, sparse.k_block.gather(-1, idx_c), live_c)
    logits_c = (qs @ _rows(k, idx_c).transpose(-1, -2)).masked_fill(~off_c, neg_inf)
    # The largest logit of each row, from the raw maxima: `shift`'s fallback 0 for a row
    # with no sparse entry (every row without blocks) would put its sampled terms in
    # units of exp(0), which underflow where every logit is far below 0, and the row
    # fell back to mean(V) with no gradient, where softmax ignores a common shift.
    shift2 = _finite_or(torch.maximum(reached, logits_c.detach().amax(-1)), 0.0)
    a_c = torch.exp(logits_c - shift2[..., None]) * weight[..., None, :]  # [B, H, Nq, m]
    # rescales the terms computed with `shift` (none where `reached` is -inf: all 0)
    factor = torch.where(torch.isfinite(reached), torch.exp(shift - shift2), 0.0)[..., None]
    numerator = spar_num * factor + a_c @ _rows(v, idx_c)
    if cfg.normalizer == "sampled":
        denominator = spar_den[..., None] * factor + a_c.sum(-1, keepdim=True)
    else:
        denominator = alpha[..., None] * factor
    return normalised_or(numerator, denominator, mean_values(v, info.key_valid))


@register(
    "kdeformer",
    KDEformerConfig,
    Capabilities(target="softmax", randomized=True,
                 fixed_shapes_because="its count of LSH blocks follows N"),
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
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """KDEformer attention (Zandieh et al. 2023, Algorithm 3 with Algorithm 1's estimates).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token; padded keys are never
            in a block with real queries, never sampled, and get zero weight.
        generator: draws the hyperplanes and all samples.
        num_features, block_size, num_hyperplanes, estimator, kde_rows, mix, sampler,
            kde_samples, normalizer, scale: see ``KDEformerConfig``.
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
