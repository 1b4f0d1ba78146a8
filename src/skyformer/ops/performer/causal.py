"""Causal Performer: prefix sums of the key features under a running maximum.

out_i = sum_{j<=i} phi(q_i).phi(k_j) v_j / sum_{j<=i} phi(q_i).phi(k_j) (eq. (6) on the
lower triangle), by chunks of L positions as ``shared/causal_prefix.py`` (Katharopoulos
et al. 2020, eqs. (8)-(10)). The keys' features phi(k_j) ~ exp(l_j), l_j = W k_j' -
|k_j'|^2/2, span more than float32 holds at common head dims (|k'|^2/2 alone is ~50 at
D = 128 with entries of std 3), and no shift fixed in advance fits every key: shifted by
a bound that holds for every key, ordinary keys' features underflowed and rows fell back
to the mean of the values. Row i's sums are therefore taken at R_i = max_{j<=i} b_j, the
running maximum of the keys' log-scales b_j = max_f l_jf (max_f w_f.k_j' with
``eps > 0``, as the non-causal keys' shift). The shift cancels in the quotient, every
term is at most 1 and the top key's is 1, and R_i depends on no later key: output i
does not either, not even through rounding.

Within chunk c: P = phi(Q_c) K^_c^T with K^_j = exp(l_j - b_j) (each key at its own
scale), times exp(b_j - R_i) on the lower triangle. The earlier chunks contribute
phi(q_i) . S_c exp(M_c - R_i), with M_c the running maximum of the chunks' maxima m_c
before c and

    S_c = sum_{c' < c} e^(m_c' - M_c) T_c',   T_c = sum_{j in c} exp(l_j - m_c) [v_j, 1],

on a CPU one float64 cumulative sum at a fixed reference shift where the running maxima
stay within 600 of it (``shared/rescaled_prefix.py``; float32 would hold 88), else (keys of large
norm first, ordinary ones later; on a GPU; under tracers, which cannot read the span)
scanned in ceil(log2(C + 1)) vectorised steps of rescale-and-add, each factor at most 1,
for any range. While exporting always the cumulative sum (a symbolic length leaves the
scan's step count unknown). ``eps > 0`` adds eps per feature after the shift
(performer-pytorch's stabiliser): eps sum_f phi(q_i)_f times the plain prefix sum of
[v_j, 1]. The shifts are constants for autograd.

Time O(N L m + N m Dv) (the scan: + N m Dv log(N / L) / L), memory O(N m Dv / L + N L).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..shared.causal_prefix import (
    CAUSAL_CHUNK,
    chunk_length,
    chunk_rows,
    lower_triangle,
    unchunk_rows,
)
from ..shared.reduction import KeyReduction
from ..shared.rescaled_prefix import factor, joined_at_largest, rescaled_prefix_sums


class RunningSums(NamedTuple):
    """The keys so far: ``sums [B, H, m, F]`` = sum_j exp(l_j - shift) [v_j, 1] at
    ``shift [B, H]`` (-inf before the first real key), ``plain [B, H, 1, F]`` = sum_j
    [v_j, 1] (for ``eps``)."""

    sums: Tensor
    shift: Tensor
    plain: Tensor


def _log_scales(scale_basis: Tensor, valid: Tensor) -> Tensor:
    """b_j = max_f of ``scale_basis [B, H, N, m]`` (detached), -inf where ``valid [B, H,
    N, 1]`` is False: ``[B, H, N]``."""
    return torch.where(valid[..., 0], scale_basis.detach().amax(-1), float("-inf"))


def _valid(key_valid: Tensor | None, log_k: Tensor) -> Tensor:
    """``key_valid [B, N]`` (None: all real) as ``[B, H, N, 1]``."""
    b, h, n, _ = log_k.shape
    if key_valid is None:
        return torch.ones(b, h, n, 1, dtype=torch.bool, device=log_k.device)
    return key_valid[:, None, :, None].expand(b, h, n, 1)


def running_sums(log_k: Tensor, scale_basis: Tensor, v1: Tensor, key_valid: Tensor | None
                 ) -> RunningSums:
    """The running sums after all these keys (``causal_performer_sums``' second result,
    without the rows): for a decoding state after its prompt."""
    valid = _valid(key_valid, log_k)
    log_scale = _log_scales(scale_basis, valid)
    top = log_scale.amax(-1)  # [B, H]
    exponent = torch.where(valid, log_k - top[..., None, None], float("-inf"))
    features = exponent.nan_to_num(float("-inf")).exp()  # -inf - -inf: no real key
    v1 = torch.where(valid, v1, 0.0)
    return RunningSums(features.transpose(-1, -2) @ v1, top, v1.sum(2, keepdim=True))


def earlier_running_sums(own: RunningSums, reduce: KeyReduction) -> RunningSums:
    """The running sums of the keys of the shards before this one (sequence parallel),
    from each shard's ``own`` sums at its own maximum (``KeyChunks.totals``); shards
    without a real key have shift -inf and add nothing."""
    sums, shift, plain = reduce.earlier_each(*own)  # one exchange
    # the shifts came back tied to the sums' exchange: constants again (their factors'
    # backward would give 0 x NaN where a shift and the top are -inf)
    return _joined(RunningSums(sums, shift.detach(), plain))


def joined_running_sums(parts: Sequence[RunningSums]) -> RunningSums:
    """The running sums of several runs of keys (the blocks of a shard), each at its own
    maximum, as those of all their keys."""
    return _joined(RunningSums(*(torch.stack(part) for part in zip(*parts, strict=True))))


def _joined(stacked: RunningSums) -> RunningSums:
    """Running sums stacked along a first dim R (``sums [R, B, H, m, F]`` at ``shift
    [R, B, H]``, constants) joined at the largest shift, every factor at most 1."""
    sums, top = joined_at_largest(stacked.sums, stacked.shift)
    return RunningSums(sums, top, stacked.plain.sum(0))


class KeyChunks(NamedTuple):
    """The keys by chunks of L (``key_chunks``): ``k_hat [B, H, C, L, m]`` = exp(l_j -
    b_j) (each key at its own scale), ``values [B, H, C, L, F]``, ``scale [B, H, C, L]``
    b_j (-inf for padded keys), ``top [B, H, C]`` m_c, ``own [B, H, C, m, F]`` T_c, and
    ``real_values [B, H, N, F]`` ([v_j, 1], zero for padded keys)."""

    k_hat: Tensor
    values: Tensor
    scale: Tensor
    top: Tensor
    own: Tensor
    real_values: Tensor

    def totals(self) -> RunningSums:
        """The running sums of these keys alone, at their largest chunk maximum."""
        sums, top = joined_at_largest(self.own.movedim(2, 0), self.top.movedim(-1, 0))
        return RunningSums(sums, top, self.real_values.sum(2, keepdim=True))


def key_chunks(log_k: Tensor, scale_basis: Tensor, v1: Tensor, key_valid: Tensor | None,
               chunk: int) -> KeyChunks:
    """The keys' side of ``causal_performer_sums`` (its arguments), by chunks of
    ``chunk``: each chunk's sums T_c at its maximum."""
    valid = _valid(key_valid, log_k)
    log_scale = _log_scales(scale_basis, valid)
    k_hat = torch.where(valid, log_k - log_scale[..., None], float("-inf")).exp()
    k_c, v_c = chunk_rows(k_hat, chunk), chunk_rows(v1, chunk)  # [B, H, C, L, .]
    scale_c = chunk_rows(log_scale[..., None], chunk)[..., 0].masked_fill(
        ~chunk_rows(valid, chunk)[..., 0], float("-inf"))  # [B, H, C, L]
    chunk_top = scale_c.amax(-1)  # m_c [B, H, C]
    weight = factor(scale_c, chunk_top[..., None])[..., None]  # [B, H, C, L, 1]
    own = (k_c * weight).transpose(-1, -2) @ v_c  # T_c [B, H, C, m, F]
    return KeyChunks(k_c, v_c, scale_c, chunk_top, own, torch.where(valid, v1, 0.0))


def causal_performer_sums(phi_q: Tensor, log_k: Tensor, scale_basis: Tensor, v1: Tensor,
                          key_valid: Tensor | None, eps: float, *,
                          start: RunningSums | None = None, chunk: int = CAUSAL_CHUNK
                          ) -> tuple[Tensor, RunningSums]:
    """sum_{j <= i} phi(q_i).phi(k_j) [v_j, 1] at row i's running maximum R_i, and the
    running sums after the last key (module docstring).

    Args:
        phi_q: ``[B, H, N, m]`` query features (each row at its own shift).
        log_k: ``[B, H, N, m]`` the keys' log-features l_j = W k_j' - |k_j'|^2/2.
        scale_basis: ``[B, H, N, m]`` whose row maxima are the keys' log-scales b_j
            (``log_k``, or W k_j' with ``eps > 0``); read detached.
        v1: ``[B, H, N, F]`` the values with a ones column.
        key_valid: ``[B, N]`` bool, False for padded keys (contributing nothing).
        start: the keys before these (decoding); None = none.
    Returns:
        ``([B, H, N, F], RunningSums)``; rows before the first real key are zero.
    """
    keys = key_chunks(log_k, scale_basis, v1, key_valid, chunk_length(log_k.shape[2], chunk))
    return causal_rows(phi_q, keys, eps, start)


def causal_rows(phi_q: Tensor, keys: KeyChunks, eps: float, start: RunningSums | None
                ) -> tuple[Tensor, RunningSums]:
    """``causal_performer_sums`` given its keys by chunks (``key_chunks``)."""
    b, h, n, m = phi_q.shape
    f = keys.values.shape[-1]
    k_c, v_c, scale_c = keys.k_hat, keys.values, keys.scale
    q_c = chunk_rows(phi_q, k_c.shape[3])
    if start is None:
        start = RunningSums(phi_q.new_zeros(b, h, m, f), phi_q.new_full((b, h), float("-inf")),
                            phi_q.new_zeros(b, h, 1, f))
    sums, shift = rescaled_prefix_sums(torch.cat([start.sums[:, :, None], keys.own], 2),
                               torch.cat([start.shift[:, :, None], keys.top], 2))
    before, before_shift = sums[:, :, :-1], shift[:, :, :-1]  # the chunks before c
    row_shift = torch.maximum(before_shift[..., None], scale_c.cummax(-1).values)  # R_i
    # b_j - R_i <= 0 for real keys j <= i (-inf for padded ones; R_i finite then, as 0
    # where no real key came yet); capped at 0 above the diagonal, which is masked
    finite_shift = torch.where(torch.isfinite(row_shift), row_shift, 0.0)
    exponent = (scale_c[..., None, :] - finite_shift[..., None]).clamp_max(0.0)
    # exact zeros above the diagonal, whatever a later key holds (0 x NaN is NaN)
    local = lower_triangle((q_c @ k_c.transpose(-1, -2)) * exponent.exp())
    out = ((q_c @ before) * factor(before_shift[..., None], row_shift)[..., None]
           + local @ v_c)  # [B, H, C, L, F]
    out = unchunk_rows(out, n)
    if eps:
        plain = start.plain + keys.real_values.cumsum(2)  # [B, H, N, F]
        out = out + eps * phi_q.sum(-1, keepdim=True) * plain
        plain = plain[:, :, -1:]
    else:
        plain = start.plain + keys.real_values.sum(2, keepdim=True)
    return out, RunningSums(sums[:, :, -1], shift[:, :, -1], plain)
