"""Informer's ProbSparse self-attention (Zhou et al., AAAI 2021), Section 3.1.

Only the u "active" queries attend; the others ("lazy") output the mean of the values:

1. For each query, sample U = c * ceil(ln n_k) keys uniformly with replacement
   (c = ``factor`` = 5 as in Informer) and evaluate the max-mean sparsity measurement
   of eq. (4) on them, "filling other pairs with zero" (Section 3.1, as the reference
   code): M(q_i) = max_j (s q_i.k_j) - (1/n_k) sum_j (s q_i.k_j) over the sampled j,
   s = 1/sqrt(D).
2. Keep the top u queries by M, u = c * ceil(ln n_q) (``num_features=None``), or
   u = ``num_features`` when given (the number of queries that attend: with 128, as in
   the Skyformer comparisons, 128 N entries of the attention matrix are visited).
3. Active queries get exact softmax attention over all keys (eq. (3), fused masked
   SDPA); lazy queries get mean(V) over the real keys (self-attention without a causal
   mask).

n_q and n_k are the numbers of *real* queries and keys; u and U are capped by them
and are at least 1. With u >= n_q every query is active and the output is exact softmax
attention. Costs: O(N U D) for the measurement (computed without gradient, in chunks of
queries, since only the ranking is used), O(u N) for the active rows.

Differences from the reference code, on purpose: key samples are drawn per
sequence from the caller's generator (``sketch/rng.py``), among real keys only, so
that padding never changes the samples; Informer shares one sample across the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...linalg.functional_ops import no_derivatives
from ...linalg.kernel_matmul import chunk_starts
from ...linalg.scores import logit_scale
from ...linalg.top_k import top_k
from ...registry import Capabilities, register
from ...sketch.rng import fold_in, random_key, uniform_at
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    compute_dtype,
    mean_values,
    resolve_key,
    zero_padded_queries,
)
from ..shared.masked import masked_attention
from ..shared.options import check_finite_scale, check_optional_positive_int, check_positive_int
from ..shared.real_first import real_positions_first

_CHUNK_ELEMENTS = 1 << 22  # bound on the [B, H, chunk, U, D] gather of sampled keys


@dataclass(frozen=True)
class InformerConfig:
    """Options of ProbSparse attention; defaults are Informer's.

    num_features: number u of active queries; ``None`` = factor * ceil(ln n_q).
    factor: sampling factor c (keys sampled per query: c * ceil(ln n_k)).
    scale: softmax logit scale s, ``None`` = 1/sqrt(head dim).
    """

    # no float32 step whose derivative a compiled backward would cast (amp.py)
    FLOAT32_STEPS: ClassVar[bool] = False

    num_features: int | None = None
    factor: int = 5
    scale: float | None = None

    def __post_init__(self) -> None:
        check_optional_positive_int("informer", "num_features", self.num_features)
        check_positive_int("informer", "factor", self.factor)
        check_finite_scale("informer", self.scale)


# floor(e^k) for k = 0, 1, ...: ceil(ln n) is the number of them below n (e^k is
# irrational for k >= 1), up to beyond 2^63.
_EXP_FLOORS = tuple(math.floor(math.exp(k)) for k in range(45))


def ceil_log(n: int) -> int:
    """ceil(ln n) for an integer n >= 1, by comparisons: under ``torch.compile`` a
    symbolic length is then guarded to the range of its ceil(ln n), where ``math.log``
    would fix the length itself (every length compiled again)."""
    k = 0
    while n > _EXP_FLOORS[k]:
        k += 1
    return k


def log_budget(factor: int, n: int) -> int:
    """Informer's c * ceil(ln n), capped at n and at least 1 (0 for n = 0)."""
    if n <= 0:
        return 0
    return max(1, min(n, factor * ceil_log(n)))


def log_budgets(factor: int, n: Tensor) -> Tensor:
    """``log_budget`` of every entry of the long tensor ``n`` (float64 logarithms, so
    ceil(ln n) matches Python's for every n below 2^52; capped at n before the cast back
    to integers, and the factor at 2^52 before it becomes a float, which changes no
    budget of such an n, so that any factor stays in range)."""
    budget = float(min(factor, 2**52)) * torch.log(n.clamp_min(1).double()).ceil()
    budget = torch.minimum(budget, n.double()).long()
    return torch.where(n > 0, torch.minimum(budget.clamp_min(1), n), 0)


@dataclass(frozen=True)
class KeySamples:
    """Sampled key positions for every query."""

    index: Tensor  # [B, Nq, U] long (0 where not live)
    live: Tensor  # [B, Nq, U] bool: real query and within its sequence's sample size
    key_count: Tensor  # [B] long: n_k, the real keys the samples are drawn among


def _ranks(valid: Tensor | None, batch: int, n: int, device: torch.device
           ) -> tuple[Tensor, Tensor, Tensor]:
    """``(rank of each row among the real rows [B, n], positions of the real rows first
    [B, n], number of real rows [B])``."""
    if valid is None:
        rank = torch.arange(n, device=device).expand(batch, n)
        return rank, rank, torch.full((batch,), n, device=device)
    return valid.long().cumsum(1) - 1, real_positions_first(valid), valid.sum(1)


def sample_keys(
    info: AttentionInputs, factor: int, device: torch.device,
    generator: torch.Generator | Tensor | None,
) -> KeySamples:
    """Draw c * ceil(ln n_k) real keys per real query, uniformly with replacement.

    Draw u of the query of rank r among the real queries of sequence b is the
    counter-based uniform x at index u of the stream (b, r) (``sketch/rng.py``), and
    picks the real key of rank floor(x n_k): a padded sequence draws what its
    truncation draws, whatever the other sequences. ``U`` is the budget of the longest
    possible sequence (the padded width), so shapes do not depend on the data.
    """
    key = random_key(generator, device)
    q_rank, _, _ = _ranks(info.query_valid, info.batch, info.query_len, device)
    _, k_first, n_k = _ranks(info.key_valid, info.batch, info.key_len, device)
    width = max(log_budget(factor, info.key_len), 1)
    sizes = log_budgets(factor, n_k)  # [B]
    u = torch.arange(width, device=device)
    keys = fold_in(key, torch.arange(info.batch, device=device))  # [B, 2]
    query_keys = fold_in(keys[:, None, :], q_rank)  # [B, Nq, 2]: one stream per query rank
    draws = uniform_at(query_keys[:, :, None, :], u, torch.float64)  # [B, Nq, U]
    rank = (draws * n_k[:, None, None]).long()
    rank = torch.minimum(rank, (n_k - 1).clamp_min(0)[:, None, None])
    index = k_first.gather(1, rank.reshape(info.batch, -1)).view_as(rank)
    live = (u < sizes[:, None, None]).expand_as(rank)
    if info.query_valid is not None:
        live = live & info.query_valid[..., None]
    return KeySamples(index.masked_fill(~live, 0), live, n_k)


@no_derivatives
def sparsity_measurement(
    q: Tensor, k: Tensor, samples: KeySamples, scale: float, query_valid: Tensor | None
) -> Tensor:
    """M(q_i) = max - (1/n_k) sum of s q_i.k_j over the sampled keys (eq. (4), the pairs
    not sampled counted as 0): ``[B, H, Nq]``.

    ``-inf`` for padded queries (never selected). Chunked over queries so that the
    gathered keys take at most ``_CHUNK_ELEMENTS`` entries.
    """
    b, h, nq, d = q.shape
    width = samples.index.shape[-1]
    chunk = max(1, _CHUNK_ELEMENTS // max(1, b * h * width * d))
    parts = []
    rows = k.reshape(-1, d)  # [B*H*Nk, D]: whole-row copies are faster than gather
    offset = (torch.arange(b * h, device=q.device) * k.shape[2]).view(b, h, 1)
    for start in chunk_starts(nq, chunk):  # one chunk keeps a compiled N symbolic
        stop = min(nq, start + chunk)
        idx = samples.index[:, start:stop]  # [B, C, U]
        live = samples.live[:, None, start:stop]  # [B, 1, C, U]
        keys = rows.index_select(0, (offset + idx.reshape(b, 1, -1)).flatten()).view(
            b, h, stop - start, width, d
        )  # [B, H, C, U, D]
        scores = (q[:, :, start:stop, None, :] @ keys.transpose(-1, -2))[
            ..., 0, :
        ] * scale  # [B, H, C, U]
        top = scores.masked_fill(~live, float("-inf")).amax(dim=-1)
        n_k = samples.key_count.clamp_min(1).to(scores.dtype)[:, None, None]  # [B, 1, 1]
        mean = (scores * live).sum(-1) / n_k
        parts.append(top - mean)
    out = torch.cat(parts, dim=2)
    if query_valid is not None:
        out = out.masked_fill(~query_valid[:, None, :], float("-inf"))
    return out


def active_counts(info: AttentionInputs, num_features: int | None, factor: int,
                  device: torch.device) -> tuple[Tensor, int]:
    """u per sequence ``[B]`` (num_features or c * ceil(ln n_q), capped by n_q) and its
    bound for the padded width (a shape that does not depend on the data)."""
    n_q = (torch.full((info.batch,), info.query_len, device=device)
           if info.query_valid is None else info.query_valid.sum(dim=1))
    if num_features is None:
        return log_budgets(factor, n_q), max(log_budget(factor, info.query_len), 1)
    bound = min(num_features, info.query_len)  # in range for any num_features
    return n_q.clamp_max(bound), max(bound, 1)


@register(
    "informer",
    InformerConfig,
    Capabilities(target="softmax", randomized=True, weights=True, fixed_shapes_because=(
        "it samples c ceil(ln N) keys per query")),
    summary="Informer ProbSparse attention: top-u queries by sampled max-mean measurement",
)
def informer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: InformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """ProbSparse self-attention (module docstring), O(N log N) time and memory.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the sampled keys (the only randomness).
        config: the options (``InformerConfig``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="informer",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("informer", generator, q.device)
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = logit_scale(info.head_dim, config.scale)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    samples = sample_keys(info, config.factor, q.device, key)
    measure = sparsity_measurement(qw, kw, samples, s, info.query_valid)  # [B, H, Nq]
    counts, u = active_counts(info, config.num_features, config.factor, q.device)
    top = top_k(measure, u)[1]  # [B, H, u]; ties by position, whatever the padding
    active = torch.arange(u, device=q.device) < counts[:, None]

    b, h, _, d = qw.shape
    q_top = qw.gather(2, top[..., None].expand(b, h, u, d))  # [B, H, u, D]
    visible = None if info.key_valid is None else info.key_valid[:, None, None, :]
    attended = masked_attention(q_top * s, kw, vw, visible)  # [B, H, u, Dv]
    lazy = mean_values(vw, info.key_valid)  # [B, H, 1, Dv]
    rows = torch.where(active[:, None, :, None], attended, lazy)  # [B, H, u, Dv]
    dv = vw.shape[-1]
    out = lazy.expand(b, h, info.query_len, dv).scatter(
        2, top[..., None].expand(b, h, u, dv), rows
    )
    return zero_padded_queries(out, info.query_valid).to(dtype)
