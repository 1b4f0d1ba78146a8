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


def causal_key_logs(k_scaled: Tensor, projection: Tensor, eps: float = 0.0
                    ) -> tuple[Tensor, Tensor]:
    """The keys' log-features l = w.k - |k|^2/2 ``[B, H, N, m]`` and the basis of their
    log-scales for causal attention (``causal.py``): l itself, or w.k with ``eps > 0``
    (as ``key_features`` shifts)."""
    log_f = softmax_log_features(k_scaled, projection)
    return log_f, (log_f if eps == 0 else _projections(k_scaled, projection))


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
        fix = (f"pass num_features={projection.shape[0]} with it"
               if projection.dim() == 2 and projection.shape[1] == dim
               else f"its columns are the head dim, D = {dim}")
        raise ValueError(
            f"{method}: projection must have shape [num_features, D] = [{num_features}, {dim}], "
            f"got {tuple(projection.shape)}; {fix}."
        )
    if projection.device != device:
        raise ValueError(f"{method}: projection is on {projection.device} but q is on {device}.")
    return projection
