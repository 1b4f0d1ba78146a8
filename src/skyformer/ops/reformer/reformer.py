"""Reformer: multi-round LSH attention (Kitaev, Kaiser, Levskaya, ICLR 2020, Section 2).

Per hash round r (``num_hashes`` = 2 rounds, each with its own random rotations,
``sketch.rotation_lsh``): hash queries and keys into b buckets, sort each by (bucket,
position), cut the sorted sequences into chunks of m = ``num_features // 2`` and let
query chunk c attend to key chunks c and c - 1 (eqs. (3)-(5): the window P~_i); with
``attend_across_buckets=False`` only keys in the query's own bucket (the mask
m(j, P_i)), by default every key of the window, as reformer-pytorch and trax do. The
number of buckets is b = 2 l / m rounded up to an even number (l = the sequence's real
length; the paper's choice m = 2 l / b), unless ``num_buckets`` is given.
``num_features`` is thus the number of keys a query can see per round (own chunk +
previous chunk = 2 m = 128 with the published chunk length 64).

No attention to self with shared QK (Section 2, "Causal masking for shared-QK
attention"; ``exclude_self`` defaults to ``shared_qk``): position i never attends to
position i unless nothing else is available in any round, in which case it attends to
itself alone (the paper's m_ii = 10^5 penalty, applied exactly: a large finite penalty
loses the logits' precision in float32). A query with no key in any round attends to
itself in every configuration, never to nothing.

Rounds are combined as in Appendix A: each round's softmax is taken with the logits
lowered by log N_ij, N_ij = number of rounds in which i attends to j, and the rounds
are summed with weights exp(z_r(i) - logsumexp_r z_r(i)), z_r the round's
log-normaliser. The result is exactly softmax attention over the union P_i of the
rounds' attention sets, each key counted once; that is the target the naive
reference (``reformer_ref``) computes.

Queries and keys. In the paper the keys are the normalised queries (shared-QK
Transformer, k_j = q_j / |q_j|), so one hash and one sort serve both. With
``shared_qk=True`` this function does exactly that: it hashes q, uses q / |q| as keys
and ignores ``k``. With ``shared_qk=False`` (default, so that a caller's separate k is
used and gets gradients) queries are hashed with q and keys with k, by the same
rotations, and each side is sorted by its own buckets; with k = q / |q| this is
the same computation, since the bucket of a vector does not depend on its length.
The target is then softmax(s q_i . k_j) over the union of the rounds' sets. Only
self-attention (Nq == Nk) is defined: chunks pair queries with keys by position in
the two sorted orders.

Memory per round: O(N m) logits, never N x N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...linalg.scores import logit_scale
from ...linalg.tracing import values_to_check
from ...registry import Capabilities, register
from ...sketch import draw_rotations, rotation_hash
from ..shared.inputs import (
    check_attention_inputs,
    compute_dtype,
    resolve_key,
    zero_padded_queries,
)
from ..shared.options import (
    check_bool,
    check_budget,
    check_optional_positive_int,
    check_positive_int,
    check_scale,
)


@dataclass(frozen=True)
class ReformerConfig:
    """Options of Reformer LSH attention; defaults are the published comparison settings.

    num_features: keys visible to a query per round, 2 chunks of ``num_features // 2``
        (128 -> chunk length 64, as in the Reformer comparisons).
    num_hashes: hash rounds (2).
    num_buckets: buckets per round; None = 2 * ceil(l / chunk) for a sequence of l
        real tokens (Section 2). 1 (no hashing) or an even number.
    shared_qk: use normalised queries as keys (the paper's shared-QK attention; ``k``
        is then ignored). False hashes and uses the given keys.
    exclude_self: forbid attention to self unless alone (the paper's rule for shared
        QK, where a query is its own most similar key); None = ``shared_qk`` (trax's
        rule).
    attend_across_buckets: a query sees every key of its own and the previous chunk
        (True, the default of reformer-pytorch and trax), or only those in its bucket
        (False, the paper's mask m(j, P_i)).
    scale: logit scale s, None = 1/sqrt(head dim).
    """

    num_features: int = 128
    num_hashes: int = 2
    num_buckets: int | None = None
    shared_qk: bool = False
    exclude_self: bool | None = None
    attend_across_buckets: bool = True
    scale: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_features, bool) or not isinstance(self.num_features, int) \
                or self.num_features < 2:
            raise ValueError(
                "reformer: num_features must be an integer >= 2 (a query sees two chunks of "
                f"num_features // 2 keys), got {self.num_features!r}."
            )
        check_positive_int("reformer", "num_hashes", self.num_hashes)
        if self.num_hashes > 255:
            raise ValueError(f"reformer: num_hashes must be at most 255, got {self.num_hashes}.")
        check_optional_positive_int("reformer", "num_buckets", self.num_buckets)
        if self.num_buckets is not None:  # random rotations of num_buckets / 2 columns
            check_budget("reformer", "num_buckets", self.num_buckets)
        if self.num_buckets is not None and self.num_buckets > 1 and self.num_buckets % 2:
            raise ValueError(
                f"reformer: num_buckets must be 1 or even (argmax over [xR, -xR]), got "
                f"{self.num_buckets}."
            )
        check_bool("reformer", "shared_qk", self.shared_qk)
        if self.exclude_self is not None:
            check_bool("reformer", "exclude_self", self.exclude_self)
        check_bool("reformer", "attend_across_buckets", self.attend_across_buckets)
        check_scale("reformer", self.scale)

    def budget_caps(self, nq: int, nk: int) -> dict[str, int]:
        """Options to change for Nq, Nk tokens: chunks of at most the sequence
        (``num_features`` <= 2 N)."""
        cap = max(2, 2 * max(nq, nk))
        return {"num_features": cap} if self.num_features > cap else {}

    @property
    def chunk(self) -> int:
        return self.num_features // 2

    @property
    def draws_nothing_because(self) -> str | None:
        """Why these options draw nothing (``skyformer check``): one bucket, no hashing."""
        return "num_buckets=1 puts every position in one bucket: no hashing" \
            if self.num_buckets == 1 else None

    @property
    def ignored_inputs_because(self) -> dict[str, str]:
        """Inputs these options ignore, and why (``skyformer check``)."""
        return {"k": "shared_qk=True uses the normalised queries as keys"} \
            if self.shared_qk else {}

    @property
    def self_excluded(self) -> bool:
        return self.shared_qk if self.exclude_self is None else self.exclude_self


def buckets_per_sequence(cfg: ReformerConfig, real_lengths: Tensor) -> Tensor:
    """Buckets of each batch element ``[B]``: ``num_buckets`` or 2 ceil(l / chunk), >= 1."""
    if cfg.num_buckets is not None:
        return torch.full_like(real_lengths, cfg.num_buckets)
    chunks = torch.div(real_lengths + cfg.chunk - 1, cfg.chunk, rounding_mode="floor")
    return (2 * chunks).clamp_min(1)


def _extend(x: Tensor, fill: float | int) -> Tensor:
    """``x [..., N]`` with one sentinel entry ``fill`` at index N (empty chunk slots)."""
    return torch.cat([x, x.new_full((*x.shape[:-1], 1), fill)], dim=-1)


def _extend_rows(x: Tensor) -> Tensor:
    """``x [B, H, N, C]`` with one zero row at index N."""
    return torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[-1])], dim=2)


def _at(values: Tensor, positions: Tensor) -> Tensor:
    """``values [B, H, N + 1]`` at ``positions [B, R, H, *rest]`` -> ``[B, R, H, *rest]``."""
    b, r, h = positions.shape[:3]
    flat = positions.reshape(b, r, h, -1)
    return values[:, None].expand(b, r, h, values.shape[-1]).gather(-1, flat).view(positions.shape)


def _rows_at(x: Tensor, positions: Tensor) -> Tensor:
    """``x [B, H, N + 1, C]`` at ``positions [B, R, H, *rest]`` -> ``[B, R, H, *rest, C]``."""
    return gather_rows(x[:, None], positions)  # every round reads the same rows


def _sorted_order(buckets: Tensor, valid: Tensor | None, num_buckets: int) -> Tensor:
    """Positions sorted by (bucket, position), padded positions last: ``[B, R, H, N]``
    (``num_buckets`` bounds the buckets)."""
    n = buckets.shape[-1]
    key = buckets.clone()
    if valid is not None:
        key = key.masked_fill(~valid[:, None, None, :], num_buckets)
    pos = torch.arange(n, device=buckets.device)
    return torch.argsort(key * n + pos, dim=-1)


@dataclass(frozen=True)
class _Rounds:
    """The hashing of one call: buckets, sorted orders and ranks per round."""

    q_buckets: Tensor  # [B, R, H, N]
    k_buckets: Tensor
    q_order: Tensor  # positions sorted by (bucket, position), padded last
    k_order: Tensor
    q_rank: Tensor  # sorted position of each token
    k_rank: Tensor


def _hash_rounds(
    qw: Tensor,
    kw: Tensor,
    valid: Tensor | None,
    config: ReformerConfig,
    generator: torch.Generator | Tensor | None,
) -> _Rounds:
    """Random-rotation hashes of queries and keys (Section 2), and their sorted orders."""
    b, h, n, d = qw.shape
    lengths = valid.sum(-1) if valid is not None else torch.full((b,), n, device=qw.device)
    n_buckets = buckets_per_sequence(config, lengths)
    # As many columns as the padded width could need: a data-independent shape (column c
    # does not depend on how many are drawn, see sketch/rotation_lsh.py).
    widest = config.num_buckets or max(1, 2 * -(-n // config.chunk))
    rotations = draw_rotations(h, config.num_hashes, d, widest // 2, device=qw.device,
                               dtype=qw.dtype, generator=generator)
    q_buckets = rotation_hash(qw, rotations, n_buckets)  # [B, R, H, N]
    q_order = _sorted_order(q_buckets, valid, widest)
    q_rank = torch.argsort(q_order, dim=-1)
    if config.shared_qk:
        return _Rounds(q_buckets, q_buckets, q_order, q_order, q_rank, q_rank)
    k_buckets = rotation_hash(kw, rotations, n_buckets)
    k_order = _sorted_order(k_buckets, valid, widest)
    return _Rounds(q_buckets, k_buckets, q_order, k_order, q_rank, torch.argsort(k_order, dim=-1))


def _windows(rounds: _Rounds, chunk: int) -> tuple[Tensor, Tensor]:
    """Sorted positions per chunk: queries ``[B, R, H, C, m]`` and their key windows
    ``[B, R, H, C, 2m]`` (the previous chunk, then their own); empty slots hold N."""
    b, r, h, n = rounds.q_order.shape
    chunks = math.ceil(n / chunk)

    def chunked(order: Tensor) -> Tensor:  # [B, R, H, chunks, m]
        pad = order.new_full((b, r, h, chunks * chunk - n), n)
        return torch.cat([order, pad], dim=-1).view(b, r, h, chunks, chunk)

    pos_q = chunked(rounds.q_order)
    own = chunked(rounds.k_order)
    prev = torch.cat([torch.full_like(own[..., :1, :], n), own[..., :-1, :]], dim=-2)
    return pos_q, torch.cat([prev, own], dim=-1)


def _attended(
    rounds: _Rounds, pos_q: Tensor, pos_k: Tensor, valid: Tensor | None, config: ReformerConfig
) -> tuple[Tensor, Tensor]:
    """``(attended, counts)``, both ``[B, R, H, C, m, 2m]``: whether key j of a window is
    in query i's set in that window's round, and N_ij, the number of rounds whose set
    holds j (Appendix A's duplicate count)."""
    b, _, h, n = rounds.q_order.shape
    m = config.chunk
    key_ok = (
        valid[:, None, :]
        if valid is not None
        else torch.ones(b, 1, n, dtype=torch.bool, device=pos_q.device)
    )
    key_ok = _extend(key_ok, False).expand(b, h, n + 1)
    base = _at(key_ok, pos_k)[..., None, :]
    if config.self_excluded:
        base = base & (pos_q[..., :, None] != pos_k[..., None, :])
    counts = torch.zeros((*base.shape[:-2], m, 2 * m), dtype=torch.uint8, device=pos_q.device)
    attended = []
    for r in range(config.num_hashes):
        same_bucket = base if config.attend_across_buckets else (
            _at(_extend(rounds.q_buckets[:, r], -1), pos_q)[..., :, None]
            == _at(_extend(rounds.k_buckets[:, r], -2), pos_k)[..., None, :]
        )
        q_chunk = _at(_extend(rounds.q_rank[:, r] // m, -1), pos_q)[..., :, None]
        k_chunk = _at(_extend(rounds.k_rank[:, r] // m, -3), pos_k)[..., None, :]
        window = (q_chunk == k_chunk) | (q_chunk == k_chunk + 1)  # own or previous chunk
        in_round = base & same_bucket & window  # round r's sets, on every round's windows
        counts = counts + in_round.to(torch.uint8)
        attended.append(in_round[:, r])
    return torch.stack(attended, dim=1), counts


def _combine_rounds(o: Tensor, lse: Tensor, has: Tensor, q_rank: Tensor) -> Tensor:
    """Per-round outputs ``[B, R, H, C, m, Dv]`` (chunked, sorted) back in sequence order,
    combined by their log-normalisers (Appendix A): ``[B, H, N, Dv]``."""
    b, r, h, _ = q_rank.shape

    def unsort(x: Tensor) -> Tensor:
        return gather_rows(x.reshape(b, r, h, -1, x.shape[-1]), q_rank)

    o = unsort(o)  # [B, R, H, N, Dv]
    lse, has = unsort(lse[..., None])[..., 0], unsort(has[..., None])[..., 0]  # [B, R, H, N]
    # Self counts only where no round attends to anything else (the m_ii = 10^5 rule,
    # applied exactly rather than through a large finite penalty).
    lse = torch.where(~has & has.any(dim=1, keepdim=True), float("-inf"), lse)
    # Normalised by their sum, not by exp(logsumexp): at large logits (1e6 in float32)
    # logsumexp rounds away the log R that separates it from every round's lse, and
    # the weights, each exp(0), summed to R.
    top = lse.amax(dim=1, keepdim=True)
    weights = torch.exp(lse - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(1.0)  # >= 1 unless none
    return (weights[..., None] * o).sum(1)


_REAL_QUERY_AT_PADDING = (
    "reformer: a query is real where its position's key is padding (key_padding_mask "
    "without query_padding_mask, or one that marks more positions real): LSH attention "
    "sorts one sequence's queries and keys and pairs them by rank, so a real query there "
    "would attend to padding; mark the same positions real on both sides "
    "(query_padding_mask='auto'), or use a method that takes cross-attention (skyformer "
    "list)")


def _refuse_real_queries_at_padding(query_valid: Tensor | None, key_valid: Tensor | None
                                    ) -> None:
    """A sentence where a real query sits at a padded key's position: it would be sorted
    with the padding and, with no real key in its windows, attend to its padded self.
    The default (``query_padding_mask="auto"``: the key mask itself) reads nothing; a
    query mask of its own is read once on the host."""
    if key_valid is None or query_valid is key_valid:
        return
    real_at_padding = ~key_valid if query_valid is None else query_valid & ~key_valid
    if torch.compiler.is_compiling():  # no host read in a graph: checked on the device
        torch._assert_async(~real_at_padding.any(), f"skyformer: {_REAL_QUERY_AT_PADDING} "
                            "(checked at run time in a compiled model)")
        return
    values = values_to_check(real_at_padding)
    if values is not None and bool(values.any()):
        raise ValueError(_REAL_QUERY_AT_PADDING + ".")


@register(
    "reformer",
    ReformerConfig,
    Capabilities(target="softmax", randomized=True, cross_attention=False, weights=True,
                 fixed_shapes_because="its counts of buckets and chunks follow N"),
    summary="multi-round LSH attention with chunked buckets (Reformer)",
)
def reformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: ReformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Reformer LSH attention (Kitaev et al. 2020, Section 2 and Appendix A).

    Args:
        q: ``[B, H, N, D]``; k: ``[B, H, N, D]`` (ignored with ``shared_qk``);
            v: ``[B, H, N, Dv]``.
        config: the options (``ReformerConfig``).
        key_padding_mask: ``[B, N]`` bool, True = real token; padded tokens sort after
            every real token, get zero weight and zero output rows.
        query_padding_mask: ``[B, N]`` bool (True = real query) or ``"auto"`` (the key
            mask); a query real where its key is padding is refused in a sentence.
        generator: draws the random rotations (one column at a time, see
            ``sketch.rotation_lsh``).
    Returns:
        ``[B, H, N, Dv]`` in the dtype of ``q`` (half types computed in float32).
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="reformer",
                                  query_padding_mask=query_padding_mask)
    if info.query_len != info.key_len:
        raise ValueError(
            "reformer cannot attend with a different number of queries and keys (got "
            f"Nq={info.query_len}, Nk={info.key_len}): LSH attention pairs query and key "
            "chunks of one sequence."
        )
    _refuse_real_queries_at_padding(info.query_valid, info.key_valid)
    key = resolve_key("reformer", generator, q.device)
    work = compute_dtype(q.dtype)
    s = logit_scale(info.head_dim, config.scale)
    qw, vw = q.to(work), v.to(work)
    kw = (
        qw / qw.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(work).tiny)
        if config.shared_qk
        else k.to(work)
    )
    rounds = _hash_rounds(qw, kw, info.key_valid, config, key)
    pos_q, pos_k = _windows(rounds, config.chunk)
    qs = _rows_at(_extend_rows(qw), pos_q)  # [B, R, H, C, m, D]
    k_ext, v_ext = _extend_rows(kw), _extend_rows(vw)
    logits = (qs @ _rows_at(k_ext, pos_k).transpose(-1, -2)) * s  # [B, R, H, C, m, 2m]
    attended, counts = _attended(rounds, pos_q, pos_k, info.key_valid, config)
    neg_inf = torch.full((), float("-inf"), dtype=work, device=q.device)  # no copy
    logits = torch.where(attended, logits - torch.log(counts.clamp_min(1).to(work)), neg_inf)

    has = (logits > float("-inf")).any(-1)  # [B, R, H, C, m]: some key is attended
    # Rows without a key take zeros: logsumexp's backward of an all -inf row is NaN
    # (exp(-inf - -inf)), which the `where`s below drop but anomaly detection reports
    lse = torch.logsumexp(logits.masked_fill(~has[..., None], 0.0), dim=-1)
    weights = torch.exp(logits - lse[..., None])
    o = weights @ _rows_at(v_ext, pos_k)  # [B, R, H, C, m, Dv]
    # Alone in this round (self excluded, or no key in the bucket's window): attend to
    # self (weight 1), with log-normaliser s q_i.k_i; used only if every round is empty.
    self_logit = (qs * _rows_at(k_ext, pos_q)).sum(-1) * s
    o = torch.where(has[..., None], o, _rows_at(v_ext, pos_q))
    lse = torch.where(has, lse, self_logit)
    out = _combine_rounds(o, lse, has, rounds.q_rank)
    if config.shared_qk:
        out = out + _zero_of(k).to(work)
    return zero_padded_queries(out, info.query_valid).to(q.dtype)


def _zero_of(k: Tensor) -> Tensor:
    """A zero in the graph of ``k``, which ``shared_qk`` leaves unused: a model's key
    projection then gets a zero gradient, where it got none and
    DistributedDataParallel (without ``find_unused_parameters``) stopped at the next
    step. ``where`` keeps it zero where ``k`` holds inf or NaN; one entry suffices."""
    corner = k[..., :1, :1]
    return torch.where(torch.zeros_like(corner, dtype=torch.bool), corner, 0).sum()
