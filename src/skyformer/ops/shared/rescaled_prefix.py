"""Prefix sums of chunk states each held at its own shift: sum_{c' <= c} S_c'
e^(shift_c' - M_c), at M_c the running maximum of the shifts.

Causal methods whose terms are exponentials keep every chunk's sums at that chunk's
largest exponent, so that nothing overflows and no shift depends on a later key:
causal Performer (each chunk at its keys' largest log-scale, ``performer/causal.py``)
and causal ``nystrom_softmax`` (at the running maximum of |k^|^2/2,
``nystrom_softmax/causal.py``). Their states are then joined at the running maximum,
every factor at most 1: on a CPU by one float64 cumulative sum at a fixed reference
where the shifts stay within ``CUMSUM_SPAN`` of it, else (and on a GPU) by a log-depth
scan; a chunk's sums reach no earlier prefix, a non-finite one included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.functional_ops import exporting
from ...linalg.tracing import may_read_values


def factor(shift: Tensor, top: Tensor) -> Tensor:
    """exp(shift - top), 0 where shift is -inf (no key yet)."""
    return torch.where(torch.isfinite(shift), (shift - top).exp(), 0.0)


def joined_at_largest(sums: Tensor, shifts: Tensor) -> tuple[Tensor, Tensor]:
    """States ``sums [R, B, H, ...]`` held at ``shifts [R, B, H]`` (-inf: no key) joined
    at the largest shift, every factor at most 1 (the states of several shards or
    blocks): ``([B, H, ...], top [B, H])``, top -inf where none has a key."""
    none = shifts.new_full((1, *shifts.shape[1:]), float("-inf"))
    top = torch.cat([none, shifts]).amax(0)
    factors = factor(shifts, top).reshape(*shifts.shape, *[1] * (sums.dim() - shifts.dim()))
    return (sums * factors).sum(0), top


# A range of the keys' log-scales up to which one float64 cumulative sum at a fixed
# reference holds the chunk sums (e^600 times the sums of 10^4 chunks stays far below
# float64's e^709); beyond it the scan, whose factors are all at most 1.
CUMSUM_SPAN = 600.0


def rescaled_prefix_sums(sums: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """Inclusive prefixes along dim 2 of ``sums [B, H, C, m, F]``, each taken at its
    ``shift [B, H, C]``: (sum_{c' <= c} sums_c' e^(shift_c' - M_c), M_c) with M_c the
    running maximum of the shifts. On a CPU, one float64 cumulative sum at a fixed
    reference where the running maxima stay within ``CUMSUM_SPAN`` of it (a read that
    costs nothing there; in eager mode), else the log-depth scan; on a GPU always the
    scan, since the read would make the host wait for the queue there. While exporting
    always the cumulative sum: the scan's step count follows the number of chunks,
    which a symbolic length leaves unknown (an exported program holds a span of ~700)."""
    if not exporting() and not (shift.device.type == "cpu" and may_read_values(shift)):
        return prefix_sums_by_scan(sums, shift)
    top = shift.cummax(2).values  # [B, H, C]
    reference = torch.where(torch.isfinite(top), top, float("inf")).amin(2, keepdim=True)
    reference = torch.where(torch.isfinite(reference), reference, 0.0)
    if not exporting():
        span = torch.where(torch.isfinite(top), top - reference, 0.0).amax()
        if not bool(span <= CUMSUM_SPAN):
            return prefix_sums_by_scan(sums, shift)
    return prefix_sums_at_reference(sums, shift, top, reference), top


def prefix_sums_at_reference(sums: Tensor, shift: Tensor, top: Tensor,
                              reference: Tensor) -> Tensor:
    """``rescaled_prefix_sums`` as one cumulative sum in float64 at ``reference [B, H, 1]``,
    the first finite shift (known from the first real key on, so no later key enters
    an earlier prefix): its factors e^(shift - reference) are at most e^CUMSUM_SPAN,
    and a chunk far below its prefix's maximum underflows where its weight would be
    below e^-700 of that maximum's own. One pass over the chunk states, where the scan
    takes ceil(log2 C) of them."""
    up = factor(shift.double(), reference.double())[..., None, None]
    prefix = (sums.double() * up).cumsum(2)
    top64 = top.double()  # -inf before the first real key, whose prefix is zero
    down = torch.where(torch.isfinite(top64), (reference.double() - top64).exp(), 0.0)
    return (prefix * down[..., None, None]).to(sums.dtype)


def prefix_sums_by_scan(sums: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """``rescaled_prefix_sums`` by a scan of ceil(log2 C) steps (Hillis and Steele 1986), each
    joining a prefix (P, M) with the one ``step`` chunks before it (P', M') as
    P' e^(M' - max) + P e^(M - max): every factor is at most 1 whatever the range of
    the keys' log-scales (keys of large norm first, ordinary ones later span more than
    float64's 709), and no chunk after c enters prefix c."""
    prefix, top = sums, shift
    step = 1
    while step < sums.shape[2]:
        earlier, earlier_top = prefix[:, :, :-step], top[:, :, :-step]
        later, later_top = prefix[:, :, step:], top[:, :, step:]
        joint = torch.maximum(earlier_top, later_top)
        joined = (earlier * factor(earlier_top, joint)[..., None, None]
                  + later * factor(later_top, joint)[..., None, None])
        prefix = torch.cat([prefix[:, :, :step], joined], 2)
        top = torch.cat([top[:, :, :step], joint], 2)
        step *= 2
    return prefix, top
