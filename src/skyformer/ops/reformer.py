"""Reformer: multi-round LSH attention (Kitaev, Kaiser, Levskaya, ICLR 2020, Section 2).

Per hash round r (``num_hashes`` = 2 rounds, each with its own random rotations,
``sketch.rotation_lsh``): hash queries and keys into b buckets, sort each by (bucket,
position), cut the sorted sequences into chunks of m = ``num_features // 2`` and let
query chunk c attend to key chunks c and c - 1 (eqs. (3)-(5): the window P~_i), keeping
only keys in the query's own bucket (the mask m(j, P_i)). The number of buckets is
b = 2 l / m rounded up to an even number (l = the sequence's real length; the paper's
choice m = 2 l / b), unless ``num_buckets`` is given. ``num_features`` is thus the
number of keys a query can see per round (own chunk + previous chunk = 2 m = 128 with
the published chunk length 64).

No attention to self (Section 2, "Causal masking for shared-QK attention"): position i
never attends to position i unless nothing else is available in any round, in which
case it attends to itself alone (the paper's m_ii = 10^5 penalty, applied exactly:
a large finite penalty loses the logits' precision in float32).

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

from ..inputs import (
    check_attention_inputs,
    check_generator,
    check_positive_int,
    compute_dtype,
    zero_padded_queries,
)
from ..linalg import gather_rows
from ..registry import Capabilities, register
from ..sketch import draw_rotations, rotation_hash
from .performer import check_scale

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
    exclude_self: forbid attention to self unless alone (the paper's rule).
    scale: logit scale s, None = 1/sqrt(head dim).
    """

    num_features: int = 128
    num_hashes: int = 2
    num_buckets: int | None = None
    shared_qk: bool = False
    exclude_self: bool = True
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
        if self.num_buckets is not None:
            check_positive_int("reformer", "num_buckets", self.num_buckets)
            if self.num_buckets > 1 and self.num_buckets % 2:
                raise ValueError(
                    f"reformer: num_buckets must be 1 or even (argmax over [xR, -xR]), got "
                    f"{self.num_buckets}."
                )
        for name in ("shared_qk", "exclude_self"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"reformer: {name} must be True or False, got {getattr(self, name)!r}.")
        check_scale("reformer", self.scale)

    @property
    def chunk(self) -> int:
        return self.num_features // 2


def buckets_per_sequence(cfg: ReformerConfig, real_lengths: Tensor) -> Tensor:
    """Buckets of each batch element ``[B]``: ``num_buckets`` or 2 ceil(l / chunk), >= 1."""
    if cfg.num_buckets is not None:
        return torch.full_like(real_lengths, cfg.num_buckets)
    return (2 * torch.div(real_lengths + cfg.chunk - 1, cfg.chunk, rounding_mode="floor")).clamp_min(1)


def _at(values: Tensor, positions: Tensor) -> Tensor:
    """``values [B, H, N + 1]`` at ``positions [B, R, H, *rest]`` -> ``[B, R, H, *rest]``."""
    b, r, h = positions.shape[:3]
    flat = positions.reshape(b, r, h, -1)
    return values[:, None].expand(b, r, h, values.shape[-1]).gather(-1, flat).view(positions.shape)


def _rows_at(x: Tensor, positions: Tensor) -> Tensor:
    """``x [B, H, N + 1, C]`` at ``positions [B, R, H, *rest]`` -> ``[B, R, H, *rest, C]``."""
    return gather_rows(x[:, None], positions)  # every round reads the same rows


def _sorted_order(buckets: Tensor, valid: Tensor | None) -> Tensor:
    """Positions sorted by (bucket, position), padded positions last: ``[B, R, H, N]``."""
    n = buckets.shape[-1]
    key = buckets.clone()
    if valid is not None:
        key = key.masked_fill(~valid[:, None, None, :], int(buckets.max()) + 1)
    pos = torch.arange(n, device=buckets.device)
    return torch.argsort(key * n + pos, dim=-1)


@register(
    "reformer",
    ReformerConfig,
    Capabilities(target="softmax", randomized=True, cross_attention=False),
    summary="multi-round LSH attention with chunked buckets (Reformer)",
)
def reformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    num_features: int = ReformerConfig.num_features,
    num_hashes: int = ReformerConfig.num_hashes,
    num_buckets: int | None = ReformerConfig.num_buckets,
    shared_qk: bool = ReformerConfig.shared_qk,
    exclude_self: bool = ReformerConfig.exclude_self,
    scale: float | None = ReformerConfig.scale,
) -> Tensor:
    """Reformer LSH attention (Kitaev et al. 2020, Section 2 and Appendix A).

    Args:
        q: ``[B, H, N, D]``; k: ``[B, H, N, D]`` (ignored with ``shared_qk``);
            v: ``[B, H, N, Dv]``.
        key_padding_mask: ``[B, N]`` bool, True = real token; padded tokens sort after
            every real token, get zero weight and zero output rows.
        generator: draws the random rotations (one column at a time, see
            ``sketch.rotation_lsh``).
        num_features, num_hashes, num_buckets, shared_qk, exclude_self, scale: see
            ``ReformerConfig``.
    Returns:
        ``[B, H, N, Dv]`` in the dtype of ``q`` (half types computed in float32).
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="reformer")
    if info.query_len != info.key_len:
        raise ValueError(
            "reformer cannot attend with a different number of queries and keys (got "
            f"Nq={info.query_len}, Nk={info.key_len}): LSH attention pairs query and key "
            "chunks of one sequence."
        )
    check_generator("reformer", generator, q.device)
    cfg = ReformerConfig(num_features, num_hashes, num_buckets, shared_qk, exclude_self, scale)
    b, h, n, d = q.shape
    rounds, m = cfg.num_hashes, cfg.chunk
    valid = info.key_valid
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(d)

    lengths = valid.sum(-1) if valid is not None else torch.full((b,), n, device=q.device)
    n_buckets = buckets_per_sequence(cfg, lengths)
    rotations = draw_rotations(
        h, rounds, d, int(n_buckets.max()) // 2, device=q.device, dtype=work, generator=generator
    )
    qw, vw = q.to(work), v.to(work)
    kw = qw / qw.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(work).tiny) if cfg.shared_qk \
        else k.to(work)

    q_buckets = rotation_hash(qw, rotations, n_buckets)  # [B, R, H, N]
    k_buckets = q_buckets if cfg.shared_qk else rotation_hash(kw, rotations, n_buckets)
    q_order = _sorted_order(q_buckets, valid)
    k_order = q_order if cfg.shared_qk else _sorted_order(k_buckets, valid)
    q_rank = torch.argsort(q_order, dim=-1)  # sorted position of each token
    k_rank = q_rank if cfg.shared_qk else torch.argsort(k_order, dim=-1)

    # Per-token data with one sentinel row at index n (empty slots of the last chunk).
    def ext(x: Tensor, fill: float | int) -> Tensor:
        return torch.cat([x, x.new_full((*x.shape[:-1], 1), fill)], dim=-1)

    chunks = math.ceil(n / m)
    slots = chunks * m

    def chunked(order: Tensor) -> Tensor:  # [B, R, H, chunks, m]
        pad = order.new_full((*order.shape[:-1], slots - n), n)
        return torch.cat([order, pad], dim=-1).view(b, rounds, h, chunks, m)

    pos_q = chunked(q_order)
    own = chunked(k_order)
    prev = torch.cat([torch.full_like(own[..., :1, :], n), own[..., :-1, :]], dim=-2)
    pos_k = torch.cat([prev, own], dim=-1)  # [B, R, H, chunks, 2m]: window P~_i

    qs = _rows_at(torch.cat([qw, qw.new_zeros(b, h, 1, d)], 2), pos_q)  # [B, R, H, C, m, D]
    k_ext = torch.cat([kw, kw.new_zeros(b, h, 1, d)], 2)
    v_ext = torch.cat([vw, vw.new_zeros(b, h, 1, vw.shape[-1])], 2)
    logits = (qs @ _rows_at(k_ext, pos_k).transpose(-1, -2)) * s  # [B, R, H, C, m, 2m]

    # attended[r'](i, j): j is in i's same-bucket window in round r'. N_ij sums them.
    key_ok = valid[:, None, :] if valid is not None else torch.ones(b, 1, n, dtype=torch.bool,
                                                                    device=q.device)
    key_ok = ext(key_ok, False).expand(b, h, n + 1)
    qi, kj = pos_q[..., :, None], pos_k[..., None, :]
    base = _at(key_ok, pos_k)[..., None, :]
    if cfg.exclude_self:
        base = base & (qi != kj)
    counts = torch.zeros(logits.shape, dtype=torch.uint8, device=q.device)
    attended = []
    for r in range(rounds):
        same_bucket = _at(ext(q_buckets[:, r], -1), pos_q)[..., :, None] == \
            _at(ext(k_buckets[:, r], -2), pos_k)[..., None, :]
        q_chunk = _at(ext(q_rank[:, r] // m, -1), pos_q)[..., :, None]
        k_chunk = _at(ext(k_rank[:, r] // m, -3), pos_k)[..., None, :]
        window = (q_chunk == k_chunk) | (q_chunk == k_chunk + 1)  # own or previous chunk
        in_round = base & same_bucket & window  # round r's sets, on every round's windows
        counts += in_round.to(torch.uint8)
        attended.append(in_round[:, r])
    attended = torch.stack(attended, dim=1)
    neg_inf = torch.tensor(float("-inf"), dtype=work, device=q.device)
    logits = torch.where(attended, logits - torch.log(counts.clamp_min(1).to(work)), neg_inf)

    v_win = _rows_at(v_ext, pos_k)  # [B, R, H, C, 2m, Dv]
    lse = torch.logsumexp(logits, dim=-1)  # [B, R, H, C, m], -inf where no key is attended
    has = torch.isfinite(lse)
    o = torch.exp(logits - torch.where(has, lse, torch.zeros_like(lse))[..., None]) @ v_win
    if cfg.exclude_self:
        # Alone in this round: attend to self (weight 1), with log-normaliser s q_i.k_i.
        self_logit = (qs * _rows_at(k_ext, pos_q)).sum(-1) * s
        o = torch.where(has[..., None], o, _rows_at(v_ext, pos_q))
        lse = torch.where(has, lse, self_logit)

    # Back to sequence order; combine rounds by their log-normalisers (Appendix A).
    def unsort(x: Tensor) -> Tensor:
        x = x.reshape(b, rounds, h, slots, -1)
        return gather_rows(x, q_rank)

    o = unsort(o)  # [B, R, H, N, Dv]
    lse, has = unsort(lse)[..., 0], unsort(has)[..., 0]  # [B, R, H, N]
    if cfg.exclude_self:
        # Self counts only where no round attends to anything else (the m_ii = 10^5 rule,
        # applied exactly rather than through a large finite penalty).
        lse = torch.where(~has & has.any(dim=1, keepdim=True), float("-inf"), lse)
    total = torch.logsumexp(lse, dim=1, keepdim=True)
    total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    out = (torch.exp(lse - total)[..., None] * o).sum(1)  # [B, H, N, Dv]
    return zero_padded_queries(out, info.query_valid).to(dtype)
