"""Error-targeted budgets for the multipole methods: features per head from a tolerance.

Skyformer's Theorem 2 ties the number of features to the statistical dimension for a
target accuracy and leaves open how to pick it in practice (section 4.3). Here the
error is measured instead of bounded: for each head, ``probe`` queries drawn uniformly
from the real ones get their exact rows (``probe * Nk`` kernel entries), and the method
is evaluated on the budget ladder m/8, m/4, m/2, m (m = ``num_features``, each at
least 4). The estimate at a budget is the relative Frobenius error over the probe rows,

    e_h(m') = ||O~_P - O_P||_F / ||O_P||_F,

and each head takes the smallest budget with e_h <= ``tolerance``. The trivial answer
(every row = mean(V) for softmax, every row = the mean exact probe row for the Gaussian
target) is rung 0 with 0 features: a head where it already meets the tolerance spends
nothing, and a head where no rung meets it takes the rung with the smallest estimate,
so that, as far as the probes can tell, no head is worse than the trivial answer. Every
rung runs on the same random draw, so the chosen output is exactly what a call with
that ``num_features`` would return, and the probe rows are returned exact. Compute: the
ladder costs less than twice the top rung, plus the probe rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...sketch.landmarks import PADDED_KEY, smallest_keys
from ..shared.inputs import AttentionInputs
from .options import MultipoleOptions, rung_options
from .sums import PartialSums, draw, multipole_sums

Finish = Callable[[PartialSums, Tensor], Tensor]  # (sums, scaled query rows) -> output rows
Trivial = Callable[[Tensor, Tensor], Tensor]  # (exact probe rows, probe live) -> [B, H, 1, Dv]


@dataclass(frozen=True)
class FeatureChoice:
    """Per-head budgets chosen for a tolerance."""

    ladder: tuple[int, ...]  # the budgets tried, ascending; 0 = the trivial answer
    features: Tensor  # [B, H] long, chosen num_features per head (0 = trivial answer)
    estimate: Tensor  # [B, H] estimated relative error at the chosen budget
    estimates: Tensor  # [B, H, len(ladder)] estimate at every budget


def feature_ladder(num_features: int) -> tuple[int, ...]:
    """m/8, m/4, m/2, m (each at least 4, at most m), ascending and distinct."""
    return tuple(sorted({min(num_features, max(4, num_features >> i)) for i in range(4)}))


def exact_rows(q_rows: Tensor, k: Tensor, v: Tensor, key_bias: Tensor) -> PartialSums:
    """Exact sum_j exp(q_i.k_j + b_j) [v_j, 1] for a few query rows ``[B, H, P, D]``."""
    logits = q_rows @ k.transpose(-1, -2) + key_bias[:, :, None, :]  # [B, H, P, Nk]
    top = logits.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = (logits - top).exp()
    return PartialSums(top, e @ v, e.sum(-1, keepdim=True))


def targeted_multipole(
    q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, info: AttentionInputs,
    options: MultipoleOptions, generator: torch.Generator | Tensor | None, finish: Finish,
    trivial: Trivial, *, tolerance: float, probe: int, gaussian: bool = False,
) -> tuple[Tensor, FeatureChoice]:
    """Multipole attention with per-head budgets for ``tolerance``.

    Args:
        q, k: scaled ``[B, H, Nq, D]``, ``[B, H, Nk, D]``; v ``[B, H, Nk, Dv]``;
        key_bias ``[B, H, Nk]`` (-inf for padded keys).
        finish: turns partial sums of given query rows into output rows.
        trivial: the trivial answer's row from the exact probe rows.
        gaussian: ``key_bias`` is -|k_j|^2/2 on the valid keys (see ``multipole_sums``).
    Returns:
        (output ``[B, H, Nq, Dv]`` before zeroing padded queries, ``FeatureChoice``).
    """
    b, h, nq, d = q.shape
    draws = draw(q, k, options, generator, info, probes=True)
    assert draws.probe_keys is not None
    probe_index, picked = smallest_keys(draws.probe_keys, probe)  # [B, P]
    probe_live = (picked < PADDED_KEY)[:, None, :, None]  # [B, 1, P, 1]
    index = probe_index[:, None, :, None]
    q_probe = q.gather(2, index.expand(b, h, -1, d))
    exact = finish(exact_rows(q_probe, k, v, key_bias), q_probe) * probe_live  # [B, H, P, Dv]
    exact_norm = exact.detach().square().sum((-1, -2)).sqrt()

    ladder = (0, *feature_ladder(options.num_features))
    outputs, estimates = [], []
    for budget in ladder:
        if budget == 0:
            out = trivial(exact, probe_live).expand(b, h, nq, exact.shape[-1])
        else:
            rung = rung_options(options, budget)
            out = finish(multipole_sums(q, k, v, key_bias, info, rung, generator, draws=draws,
                                        gaussian=gaussian), q)
        rows = out.gather(2, index.expand(b, h, -1, out.shape[-1])) * probe_live
        error = (rows.detach() - exact.detach()).square().sum((-1, -2)).sqrt()
        estimates.append(error / exact_norm.clamp_min(torch.finfo(error.dtype).tiny))
        outputs.append(out)
    estimates_t = torch.stack(estimates, -1)  # [B, H, L]
    meets = estimates_t <= tolerance
    level = torch.where(meets.any(-1), meets.int().argmax(-1), estimates_t.argmin(-1))  # [B, H]
    stacked = torch.stack(outputs, 0)  # [L, B, H, Nq, Dv]
    out = stacked.gather(
        0, level[None, :, :, None, None].expand(1, b, h, nq, stacked.shape[-1])
    )[0]
    # The probe rows were computed exactly: return them exact.
    out = out.scatter(2, index.expand(b, h, -1, out.shape[-1]),
                      torch.where(probe_live, exact,
                                  out.gather(2, index.expand(b, h, -1, out.shape[-1]))))
    features = torch.tensor(ladder, device=q.device)[level]
    choice = FeatureChoice(
        ladder, features, estimates_t.gather(-1, level[..., None])[..., 0], estimates_t
    )
    return out, choice
