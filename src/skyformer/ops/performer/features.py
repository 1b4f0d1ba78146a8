"""FAVOR+ positive random features of queries and keys, stabilised per row / per head.

Performer Lemma 1: phi(x) = m^-1/2 exp(W x - |x|^2/2). The log-features are shifted by
maxima that cancel in the row normalisation (module docstring of ``performer.py``).
Shared with ``scatterbrain``, whose low-rank part is Performer's estimate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...sketch import gaussian_projection, softmax_log_features
from ..shared.reduction import WHOLE, KeyReduction

# The causal keys' features are at most e^40: sums of N m of them stay finite in float32
# (e^88) for |v| up to e^20 / (N m). Shifting by the bound itself (~51 at D = 64, m =
# 128) put the features of ordinary keys near e^-51, and the normalisers below float32's
# threshold for them (sqrt(tiny), ~1e-19): every row fell back to the prefix mean of V.
CAUSAL_KEY_HEADROOM = 40.0


def _projections(x: Tensor, projection: Tensor) -> Tensor:
    """w_f . x for every feature: ``[..., N, m]``."""
    return x @ projection.to(x.dtype).transpose(-1, -2)


def query_features(q_scaled: Tensor, projection: Tensor, eps: float = 0.0
                   ) -> tuple[Tensor, Tensor]:
    """Positive features of the queries, each row shifted by its own maximum.

    Returns ``(phi~ [B, H, N, m], log_scale [B, H, N, 1])`` with
    phi(q) = exp(log_scale) phi~ / sqrt(m). With ``eps > 0`` (performer-pytorch's
    stabiliser): phi~ = exp(w.q - |q|^2/2 - c) + eps with c = max_f w_f.q, and
    log_scale = c.
    """
    log_f = softmax_log_features(q_scaled, projection)
    if eps == 0:
        shift = log_f.detach().amax(dim=-1, keepdim=True)
        return (log_f - shift).exp(), shift
    shift = _projections(q_scaled, projection).detach().amax(dim=-1, keepdim=True)
    return (log_f - shift).exp() + eps, shift


def key_features(
    k_scaled: Tensor, projection: Tensor, key_valid: Tensor | None, eps: float = 0.0,
    reduce: KeyReduction = WHOLE,
) -> tuple[Tensor, Tensor]:
    """Positive features of the keys, shifted by the maximum over the real keys and
    features of each batch element and head; padded keys get exact zeros. With
    ``eps > 0``: phi~ = exp(w.k - |k|^2/2 - c) + eps, c = the maximum of w_f.k over the
    real keys and features of the element and head.

    Returns ``(phi~ [B, H, N, m], log_scale [B, H, 1, 1])``. ``reduce`` completes the
    maximum when the keys are a shard of the sequence (``shared/reduction.py``).
    """
    log_f = softmax_log_features(k_scaled, projection)
    if key_valid is not None:
        log_f = log_f.masked_fill(~key_valid[:, None, :, None], float("-inf"))
    basis = log_f if eps == 0 else _projections(k_scaled, projection).masked_fill(
        torch.isinf(log_f), float("-inf"))
    shift = reduce.max(basis.detach().amax(dim=(-1, -2), keepdim=True))
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    phi = (log_f - shift).exp()
    if eps == 0:
        return phi, shift
    real = torch.isfinite(log_f) if key_valid is None else key_valid[:, None, :, None]
    return torch.where(real, phi + eps, 0.0), shift


def causal_key_features(k_scaled: Tensor, projection: Tensor, key_valid: Tensor | None,
                        eps: float = 0.0) -> Tensor:
    """Positive key features for causal attention, ``[B, H, N, m]``: exp(w.k - |k|^2/2 - c)
    (+ eps) with c = max(0, max_f |w_f|^2/2 - ``CAUSAL_KEY_HEADROOM``). max_f |w_f|^2/2
    bounds w_f.k - |k|^2/2 over every k, so every feature is at most e^40 and the shift
    depends on no key (a shift by a maximum over the keys would let a later key change
    earlier outputs). Padded keys get exact zeros."""
    log_f = softmax_log_features(k_scaled, projection)
    bound = 0.5 * (projection * projection).sum(-1).amax().to(log_f.dtype)
    shift = (bound - CAUSAL_KEY_HEADROOM).clamp_min(0.0)
    phi = (log_f - shift).exp() + eps
    if key_valid is None:
        return phi
    return torch.where(key_valid[:, None, :, None], phi, 0.0)


def resolve_projection(
    method: str, projection: Tensor | None, num_features: int, dim: int, orthogonal: bool,
    device: torch.device, generator: torch.Generator | Tensor | None,
) -> Tensor:
    """The caller's ``projection [m, D]`` (checked) or a fresh draw from ``generator``."""
    if projection is None:
        return gaussian_projection(
            num_features, dim, orthogonal=orthogonal, device=device, generator=generator
        )
    if not isinstance(projection, Tensor) or not projection.is_floating_point():
        raise TypeError(f"{method}: projection must be a floating point tensor [num_features, D].")
    if tuple(projection.shape) != (num_features, dim):
        raise ValueError(
            f"{method}: projection must have shape [num_features, D] = [{num_features}, {dim}], "
            f"got {tuple(projection.shape)}."
        )
    if projection.device != device:
        raise ValueError(f"{method}: projection is on {projection.device} but q is on {device}.")
    return projection
