"""Causal modified Nystrom softmax: out_i ~ sum_{j<=i} exp(s q_i.k_j) v_j / (same, v = 1).

The causal Skyformer construction (``ops/skyformer/README.md``, "Causal") applied to
the lifted softmax matrix E_Q C E_K (module docstring of ``nystrom_softmax.py``): with
q^ = sqrt(s) q, k^ = sqrt(s) k and phi = L^-1 C(X_S, .) masked to the available slots,

    a_ij = phi(q^_i) . L^-1 C(X_S, k^_j) exp(|k^_j|^2/2)   (far keys, earlier chunks)
    a_ij = C(q^_i, k^_j) exp(|k^_j|^2/2)                   (keys of i's chunk, exact)

(E_Q is a factor of row i and cancels). Stabilisation must itself be causal: the
non-causal path divides E_K by its maximum over *all* keys. Here r_i = max_{j<=i}
|k^_j|^2/2 (a running maximum over the real keys) takes that role: row i is divided
by exp(r_i), which cancels in its ratio. A key j enters its chunk's state with
exp(|k^_j|^2/2 - R_c) <= 1, R_c = r at the end of chunk c; state S_c = sum_{c'<c}
exp(R_c' - R_{c-1}) T_c' (weights <= 1: in eager calls the exclusive prefix of the
chunk sums, each rescaled to the running maximum, ``shared/rescaled_prefix.py``, O(C);
traced calls a [C, C] matrix of the weights, ``_earlier_chunks``); row i multiplies it
by exp(R_{c-1} - r_i) <= 1. Nothing can overflow and no shift depends on a later key.

Range: every term of row i carries exp(-|q^_i|^2/2), divided out only in the ratio, so
past |q^_i|^2/2 ~ 354 (float64; ~44 in float32) the row's normaliser is lost and the row
takes the fallback below (docs/reliability.md, "nystrom_softmax in float32").

Unreliable rows: as in the non-causal path, a row whose normaliser D~_i is at most
``normalizer_threshold`` times its bound sum_s |phi_s(q_i)| |z_s| + sum_{near j} |a_ij|
(z the normaliser column of the state) returns the mean of the values j <= i.

A shard after others (sequence parallel, ``distributed/causal_nystrom_softmax.py``)
starts from the earlier keys' state at their shift (``EarlierKeys``): the shift starts
the running maximum, the state joins every chunk's at R_{c-1}, and the values' sums the
fallback's means.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...linalg import half_sq_norm, with_ones_column
from ...linalg.flush import flush_exponent_on_cpu_, flush_on_cpu
from ...linalg.tracing import may_read_values
from ..shared.causal_nystrom import (
    CausalCore,
    CausalLandmarks,
    causal_core,
    gaussian_features,
    uses_failed,
)
from ..shared.causal_prefix import (
    CAUSAL_CHUNK,
    by_blocks,
    chunk_rows,
    lower_triangle,
    per_row,
    prefix_mean_values,
    row_blocks,
    unchunk_rows,
)
from ..shared.inputs import AttentionInputs
from ..shared.normalised import normalised_or
from ..shared.rescaled_prefix import factor, rescaled_prefix_sums


def _chunks(x: Tensor, chunk: int, fill: float) -> Tensor:
    """``[B, H, N] -> [B, H, C, L]`` padded with ``fill``."""
    return chunk_rows(x[..., None], chunk, fill)[..., 0]


def _earlier_chunks(t: Tensor, end: Tensor, before: Tensor) -> Tensor:
    """S_c = sum_{c' < c} exp(R_c' - R_{c-1}) T_c', the chunks before c at R_{c-1}, for
    ``t: [B, H, C, m, Dv + 1]`` at ``end`` R_c (a running maximum, ``[B, H, C]``) and
    ``before`` R_{c-1}. In eager calls the rescaled prefix sums, O(C)
    (``shared/rescaled_prefix.py``); traced calls (``torch.compile``, ``torch.export``,
    ``torch.func``) keep the [C, C] matrix of the weights, O(C^2), which holds any span
    of R in one graph whatever C (the prefix sums' scan has a step count that follows C,
    and their cumulative sum, which export takes, a span of ~700). A non-finite T_c'
    reaches the later chunks' sums only."""
    if may_read_values(t, end):
        upto, _ = rescaled_prefix_sums(t, end)  # chunks <= c at R_c (end is its own max)
        return torch.cat([torch.zeros_like(upto[:, :, :1]), upto[:, :, :-1]], 2)
    c = end.shape[-1]
    earlier = torch.ones(c, c, dtype=torch.bool, device=t.device).tril(-1)
    mix = end[..., None, :] - before[..., :, None]  # R_c' - R_{c-1}: [B, H, C, C]
    mix = torch.where(earlier & torch.isfinite(end)[..., None, :], mix, float("-inf")).exp()
    finite = torch.isfinite(t)  # 0 x NaN would reach the chunks before a non-finite one
    state = torch.einsum("bhcd,bhdmv->bhcmv", mix, torch.where(finite, t, 0.0))
    bad = (~finite).cummax(2).values  # a non-finite entry in chunk c or before
    bad_before = torch.cat([torch.zeros_like(bad[:, :, :1]), bad[:, :, :-1]], 2)
    return torch.where(bad_before, float("nan"), state)


class EarlierKeys(NamedTuple):
    """The real keys before these rows (the shards before this one, sequence parallel):
    ``sums [B, H, m, Dv + 1]`` = sum_j L^-1 C(X_S, k^_j) exp(|k^_j|^2/2 - shift) [v_j, 1]
    at ``shift [B, H]`` (a constant at least every such |k^_j|^2/2; -inf: no real key),
    ``values [B, H, 1, Dv + 1]`` = sum_j [v_j, 1] (the fallback's prefix means)."""

    sums: Tensor
    shift: Tensor
    values: Tensor


class ShiftedKeys(NamedTuple):
    """The keys' features where the caller has them: ``features [B, H, N, m]`` = L^-1
    C(X_S, k^_j) exp(|k^_j|^2/2 - offset_j), zero for padded keys, at ``offset [B, H, N]``
    (constants, at least |k^_j|^2/2 for real keys and at most the running maximum r_j)."""

    features: Tensor
    offset: Tensor


def causal_nystrom_softmax(q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs,
                           root: float, gamma: float, local: bool, threshold: float,
                           landmarks: CausalLandmarks, *, chunk: int = CAUSAL_CHUNK,
                           kernel: str = "auto") -> Tensor:
    """``q, k: [B, H, N, D]`` (unscaled, compute dtype), ``v: [B, H, N, Dv]`` ->
    ``[B, H, N, Dv]``; rows of padded queries are not zeroed here. ``kernel``: the query
    features' product (``causal_nystrom.gaussian_features``)."""
    q, k, core = causal_core(q, k, root, gamma, landmarks)
    return causal_nystrom_softmax_from_core(q * root, k * root, v, info.key_valid, core,
                                            landmarks, local, threshold, chunk=chunk,
                                            kernel=kernel)


def causal_nystrom_softmax_from_core(
    qs: Tensor, ks: Tensor, v: Tensor, key_valid: Tensor | None, core: CausalCore,
    landmarks: CausalLandmarks, local: bool, threshold: float, *, chunk: int = CAUSAL_CHUNK,
    kernel: str = "auto", start: EarlierKeys | None = None, keys: ShiftedKeys | None = None,
) -> Tensor:
    """The outputs given the core: ``qs, ks: [B, H, N, D]`` rows scaled by sqrt(s),
    ``v: [B, H, N, Dv]``, ``key_valid: [B, N]`` or None, ``landmarks`` at positions of
    these rows. ``start``: the keys before these rows (a shard after others; position 0
    must start a chunk of the sequence), their maximum joining the running maximum r;
    ``keys``: the keys' features where the caller has them. ``[B, H, N, Dv]``.

    An eager call that records no gradient (inference, a prompt's prefill) runs by
    blocks of rows (``causal_prefix.by_blocks``), each from the state of the keys before
    it, as causal Skyformer does: one block's features, exact chunks and chunk states
    at a time."""
    earlier = () if start is None else tuple(start)
    if keys is None and by_blocks(qs.shape[2], qs, ks, v, core.x, core.l_inv, *earlier):
        outs = []
        for rows in row_blocks(qs.shape[2], chunk):
            here = CausalLandmarks(landmarks.position - rows.start, landmarks.live,
                                   landmarks.from_query)
            out, start = _whole(qs[:, :, rows], ks[:, :, rows], v[:, :, rows],
                                None if key_valid is None else key_valid[:, rows], core,
                                here, local, threshold, chunk=chunk, kernel=kernel,
                                start=start)
            outs.append(out)
        return torch.cat(outs, dim=2)
    return _whole(qs, ks, v, key_valid, core, landmarks, local, threshold, chunk=chunk,
                  kernel=kernel, start=start, keys=keys)[0]


def _whole(qs: Tensor, ks: Tensor, v: Tensor, key_valid: Tensor | None, core: CausalCore,
           landmarks: CausalLandmarks, local: bool, threshold: float, *, chunk: int,
           kernel: str, start: EarlierKeys | None, keys: ShiftedKeys | None = None
           ) -> tuple[Tensor, EarlierKeys]:
    """``causal_nystrom_softmax_from_core`` on every row at once, and the state after
    these rows (their keys and the earlier ones, at the last chunk's running maximum)."""
    n, dv = qs.shape[2], v.shape[-1]
    real = (torch.ones_like(qs[..., 0], dtype=torch.bool) if key_valid is None
            else key_valid[:, None, :].expand_as(qs[..., 0]))  # [B, H, N]
    # the shifts are constants: each cancels in its row's ratio. Detached, not only
    # under no_grad, which leaves forward-mode tangents on (jvp): a shift's tangent in
    # the factors but not in the features' product gave wrong directional derivatives
    with torch.no_grad():
        log_e = half_sq_norm(ks.detach()).masked_fill(~real, float("-inf"))
        r = log_e.cummax(dim=-1).values  # [B, H, N], -inf before the first real key
        first = qs.new_full(qs.shape[:2], float("-inf")) if start is None \
            else start.shift.detach()
        r = torch.maximum(r, first[..., None])  # with the keys before these
        r_c = _chunks(r, chunk, float("-inf"))  # [B, H, C, L]
        # R_c: [B, H, C]; carried over the chunks of padding alone that export appends
        # (causal_prefix.py), whose -inf made their mix entries inf (NaN gradients)
        end = r_c.amax(-1).cummax(-1).values
        before = torch.cat([first[..., None], end[..., :-1]], -1)  # R_{c-1}, R_{-1}: start's
        r_safe = torch.where(torch.isfinite(r), r, 0.0)
        # rows past N get 0: exp(R_{c-1} - 0) overflowed at large keys, and its 0 x inf
        # in the backward pass made every gradient NaN
        row_factor = torch.where(torch.isfinite(before)[..., None],
                                 before[..., None] - _chunks(r_safe, chunk, float("inf")),
                                 float("-inf")).exp()  # exp(R_{c-1} - r_i): [B, H, C, L]
        own_end = per_row(end, chunk, n)  # R_c of each key's chunk
        offset = r_safe if keys is None else keys.offset.detach()
        key_factor = torch.where(real, offset - own_end, float("-inf")).exp()  # [B, H, N]
    # exp(k^.x_s - |x_s|^2/2 - r_j) <= 1: C(X_S, k_j) E_K / exp(r_j)
    # (one product each: no [N, m] block kept for the backward pass)
    psi_k = keys.features if keys is not None else gaussian_features(
        ks, core, row_valid=key_valid, row_offset=r_safe, row_norm=False, kernel=kernel)
    phi_q = gaussian_features(qs, core, kernel=kernel)
    available = landmarks.available(n)  # [B, 1, N, m]
    phi_q = torch.where(available, phi_q, 0.0)  # [B, H, N, m]
    v1 = with_ones_column(v)  # [B, H, N, Dv + 1]
    q_c, v_c = chunk_rows(phi_q, chunk), chunk_rows(v1, chunk)
    # CPU products of subnormal numbers are slow: flush each factor (linalg.flush)
    t = chunk_rows(flush_on_cpu(psi_k * key_factor[..., None]), chunk).transpose(-1, -2) @ v_c
    state = _earlier_chunks(t, end, before)  # S_c: [B, H, C, m, Dv + 1]
    if start is not None:  # the keys before these, at R_{c-1} >= their shift
        state = state + start.sums[:, :, None] * factor(first[..., None], before)[..., None, None]
    state = flush_on_cpu(state)
    far = (q_c @ state) * row_factor[..., None]  # [B, H, C, L, Dv + 1]
    bound = (q_c.abs() @ state[..., -1:].abs()) * row_factor[..., None]
    r_rows = _chunks(r_safe, chunk, 0.0)
    if local:  # exp(q^.k^ - |q^|^2/2 - r_i) <= 1 for real keys j <= i
        visible = lower_triangle(chunk_rows(real[..., None].to(qs.dtype), chunk)
                                 .transpose(-1, -2).expand(*r_rows.shape, chunk)) > 0
        logits = (chunk_rows(qs, chunk) @ chunk_rows(ks, chunk).transpose(-1, -2)
                  - chunk_rows(half_sq_norm(qs)[..., None], chunk) - r_rows[..., None])
        near = flush_exponent_on_cpu_(torch.where(visible, logits, float("-inf"))).exp()
    else:  # through the landmarks, key j shifted by its own offset <= r_j <= r_i
        shift = _chunks(offset, chunk, 0.0)[..., None, :] - r_rows[..., :, None]
        near = lower_triangle((q_c @ chunk_rows(psi_k, chunk).transpose(-1, -2))
                              * torch.where(shift <= 0, shift, 0.0).exp())
    o = unchunk_rows(far + near @ v_c, n)
    bound = unchunk_rows(bound + near.abs().sum(-1, keepdim=True), n)
    numerator, denominator = o.split([dv, o.shape[-1] - dv], dim=-1)  # one backward write
    fallback = prefix_mean_values(v, key_valid, None if start is None else start.values)
    out = normalised_or(numerator, denominator, fallback, denominator > threshold * bound)
    out = torch.where(uses_failed(available, core.failed)[..., None], float("nan"), out)
    # the state after the last chunk, at its R: its exclusive state and its own sums
    after = state[:, :, -1] * factor(before[..., -1], end[..., -1])[..., None, None] \
        + t[:, :, -1]
    values = torch.where(real[..., None], v1, 0.0).sum(2, keepdim=True)
    return out, EarlierKeys(after, end[..., -1],
                            values if start is None else start.values + values)
