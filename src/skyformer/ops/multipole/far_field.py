"""Far-field moments of each query cluster's centre over its far keys (first-order
expansion by exponential tilting; see ``sums.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_matmul
from ...linalg.kernels import finite_matrices, overwrite_allowed

_NEG_INF = float("-inf")


# Eigenvalues of the values' covariance at most this many rounding units of float64
# (times Dv) of the largest are zero: no direction of variance.
_ZERO_VARIANCE_ULPS = 64


def value_basis(v: Tensor, key_valid: Tensor | None, rank: int | None) -> Tensor | None:
    """Leading principal directions of the values, ``[B, H, Dv, r]`` (no gradient), or
    ``None`` when every direction is kept.

    Only directions the real values vary along: where they span fewer than r (fewer than
    r + 1 real keys), the other columns are zero instead of eigenvectors of a zero
    eigenvalue, which eigh picks at will and the values' gradient would follow.
    """
    dv = v.shape[-1]
    if rank is None or rank >= dv:
        return None
    with torch.no_grad():
        vv = v.detach().double()
        if key_valid is not None:
            w = key_valid[:, None, :, None].double()
            count = w.sum(2, keepdim=True).clamp_min(1.0)
            centred = (vv - (vv * w).sum(2, keepdim=True) / count) * w
        else:
            centred = vv - vv.mean(2, keepdim=True)
        cov = finite_matrices(centred.transpose(-1, -2) @ centred)  # [B, H, Dv, Dv]
        eigenvalues, eigenvectors = torch.linalg.eigh(cov)  # ascending
        floor = eigenvalues[..., -1:] * (_ZERO_VARIANCE_ULPS * dv
                                         * torch.finfo(torch.float64).eps)  # [B, H, 1]
        varies = eigenvalues[..., dv - rank:] > floor  # [B, H, r]
        basis = eigenvectors[..., dv - rank:] * varies[..., None, :]
    return basis.to(v.dtype)


@dataclass(frozen=True)
class FarField:
    """Per-cluster far-field statistics."""

    log_mass: Tensor  # [B, H, c]  log R_a (-inf: empty far field)
    kbar: Tensor  # [B, H, c, D]
    vbar: Tensor  # [B, H, c, Dv]
    tilt: Tensor  # [B, H, c, r, D]  Cov_a(U^T v, k)
    live: Tensor  # [B, H, c] bool


def safe_reciprocal(x: Tensor, ok: Tensor) -> Tensor:
    """1 / x where ``ok``, else 0, with a zero gradient there: the inner ``where`` keeps
    the reciprocal's derivative -1/x^2 away from x = 0 (or a clamp at the smallest
    float), where it overflows to inf and turns a zero upstream gradient into NaN."""
    return torch.where(ok, 1.0 / torch.where(ok, x, 1.0), 0.0)


def far_field(
    z: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, shift: Tensor, member: Tensor,
    key_valid: Tensor | None, basis: Tensor | None, rank: int, sample: Tensor | None = None,
    *, gaussian: bool = False, kernel: str = "auto",
) -> FarField:
    """Far-field moments of each cluster centre's distribution over its far keys.

    The sums sum_j exp(z_a.k_j + b_j - shift_a) [k_j, v_j, 1] over the far keys go through
    ``gaussian_kernel_matmul`` with the keys as rows and the near keys excluded: the
    c x Nk weights are built in cache-sized chunks and rebuilt in the backward pass,
    never stored (as Skyformer's [N, m] blocks).

    Args:
        z: ``[B, H, c, D]`` centres; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_bias: ``[B, H, Nk]`` b_j (-inf for padded keys): 0 on the valid keys, or
            -|k_j|^2/2 with ``gaussian=True``; used for the covariance sample.
        shift: ``[B, H, c, 1]`` finite, detached, at least the largest far logit up to
            float range (far keys more than ~80 below it underflow: share below 1e-30).
        member: ``[B, H, c, Nk]`` near keys; key_valid: ``[B, Nk]`` or ``None``.
        basis: ``[B, H, Dv, r]`` or ``None`` (identity).
        rank: r (0 = no covariance).
        sample: ``[B, S]`` keys from which the covariance is estimated (self-normalised
            over the sampled far keys), ``None`` = every key.
        gaussian: b_j = -|k_j|^2/2 (Gaussian target) rather than 0.
        kernel: ``gaussian_kernel_matmul``'s implementation choice.
    """
    b, h, nk, d = k.shape
    c, dv = z.shape[2], v.shape[-1]
    rhs = torch.cat([k, v, k.new_ones(b, h, nk, 1)], -1)  # [B, H, Nk, D + Dv + 1]
    sums = gaussian_kernel_matmul(
        k, z, rhs, shift[..., 0], row_norm=gaussian, transpose=True,
        row_valid=None if key_valid is None else key_valid[:, None, :],
        # keys-by-centres and contiguous: masking chunks through a strided view is slow
        exclude=member.transpose(-1, -2).contiguous(), kernel=kernel,
    )  # [B, H, c, D + Dv + 1]
    mass = sums[..., -1:]
    # The shift is the largest far logit (``sums._near_keys``), whose key weighs 1 here, so
    # a mass below sqrt(tiny) (1e-19 in float32) is a far field without a real key (or
    # one some 44 below a shift the caller chose higher): 1/mass^2 in the backward pass
    # would overflow. Such centres count as empty.
    live = mass[..., 0] > torch.finfo(mass.dtype).tiny ** 0.5
    inv_mass = safe_reciprocal(mass, live[..., None])
    kbar = sums[..., :d] * inv_mass  # [B, H, c, D]
    vbar = sums[..., d:d + dv] * inv_mass  # [B, H, c, Dv]
    log_mass = torch.where(live, torch.where(live, mass[..., 0], 1.0).log() + shift[..., 0],
                           _NEG_INF)
    if rank == 0:
        tilt = k.new_zeros(b, h, c, 0, d)
    else:
        ks, vs, bias, near, inv = k, v, key_bias, member, inv_mass
        if sample is not None:
            idx = sample[:, None, :].expand(b, h, -1)
            ks = k.gather(2, idx[..., None].expand(-1, -1, -1, d))
            vs = v.gather(2, idx[..., None].expand(-1, -1, -1, dv))
            bias = key_bias.gather(2, idx)
            near = member.gather(3, idx[:, :, None, :].expand(-1, -1, c, -1))
        # The weights of the (sampled) keys only: [B, H, c, S].
        ws = torch.baddbmm(
            (bias[:, :, None, :] - shift).view(b * h, c, -1), z.reshape(b * h, c, d),
            ks.reshape(b * h, -1, d).transpose(1, 2),
        ).view(b, h, c, -1)
        # in place unless selective checkpointing may keep baddbmm's output
        ws = ws.masked_fill_(near, _NEG_INF).exp_() if overwrite_allowed() \
            else ws.masked_fill(near, _NEG_INF).exp()
        if sample is not None:
            total = ws.sum(-1, keepdim=True)
            inv = safe_reciprocal(total, total > torch.finfo(total.dtype).tiny ** 0.5)
        vr = vs if basis is None else vs @ basis  # [B, H, S, r]
        # reshape: vr may be v itself, stored in any order (an einsum's [B, H, D, N] storage)
        outer = (vr[..., :, None] * ks[..., None, :]).reshape(b, h, ks.shape[2], rank * d)
        second = ((ws @ outer) * inv).view(b, h, c, rank, d)
        mean_k, mean_vr = kbar, (vbar if basis is None else vbar @ basis)
        if sample is not None:
            mean_k, mean_vr = (ws @ ks) * inv, (ws @ vr) * inv
        tilt = second - mean_vr[..., :, None] * mean_k[..., None, :]
    return FarField(log_mass, kbar, vbar, tilt, live)
