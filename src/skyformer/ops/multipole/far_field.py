"""Far-field moments of each query cluster's centre over its far keys (first-order
expansion by exponential tilting; see ``sums.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_matmul
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import (
    first_order_backward,
    functional_ops_only,
    no_derivatives,
)
from ...linalg.kernels import finite_matrices, overwrite_allowed
from ...linalg.vmap import vmap_into_batch

_NEG_INF = float("-inf")


# Eigenvalues of the values' covariance at most this many rounding units of float64
# (times Dv) of the largest, or of what centring leaves by rounding (eps sum_j |v_j|^2),
# are zero: no direction of variance. Two eigenvalues this close are equal: the
# subspace is not determined between them.
_ZERO_VARIANCE_ULPS = 64


def _centred(v: Tensor, weights: Tensor | None) -> Tensor:
    """The values in float64 minus their mean over the real keys, zero on the padded ones:
    ``[B, H, Nk, Dv]`` (``weights``: ``[B, 1, Nk, 1]`` 0/1, ``None`` = every key)."""
    vv = v.double()
    if weights is None:
        return vv - vv.mean(2, keepdim=True)
    count = weights.sum(2, keepdim=True).clamp_min(1.0)
    return (vv - (vv * weights).sum(2, keepdim=True) / count) * weights


@no_derivatives
def _covariance_eigh(v: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Eigenvalues (ascending, ``[B, H, Dv]``) and eigenvectors (``[B, H, Dv, Dv]``) of
    the real values' covariance sum_j (v_j - vbar)(v_j - vbar)^T, in float64, and the
    rounding level ``[B, H, 1]`` at and below which an eigenvalue (or a gap) is zero."""
    centred = _centred(v, weights)
    eigenvalues, eigenvectors = torch.linalg.eigh(
        finite_matrices(centred.transpose(-1, -2) @ centred))
    eps = torch.finfo(torch.float64).eps
    vv = v.double() if weights is None else v.double() * weights
    rounding = eps * vv.square().sum((2, 3))[..., None]  # centring's rounding, squared
    floor = torch.maximum(eigenvalues[..., -1:], rounding) \
        * (_ZERO_VARIANCE_ULPS * v.shape[-1] * eps)
    return eigenvalues, eigenvectors, torch.where(torch.isfinite(floor), floor, 0.0)


def _kept(eigenvalues: Tensor, floor: Tensor, rank: int) -> Tensor:
    """Which eigenvectors form the basis, ``[B, H, Dv]`` bool: the top ``rank``, of those
    with an eigenvalue above the rounding ``floor`` ``[B, H, 1]``."""
    dv = eigenvalues.shape[-1]
    top = torch.arange(dv, device=eigenvalues.device) >= dv - rank
    return (eigenvalues > floor) & top


def _inverse_gaps(eigenvalues: Tensor, floor: Tensor, rank: int) -> Tensor:
    """F ``[B, H, Dv, Dv]``: F_ji = 1 / (lambda_i - lambda_j) for a kept eigenvector i and
    a dropped one j, 0 for every other pair and where the gap is at rounding level."""
    kept = _kept(eigenvalues, floor, rank)
    gap = eigenvalues[..., None, :] - eigenvalues[..., :, None]  # [.., j, i] = l_i - l_j
    ok = kept[..., None, :] & ~kept[..., :, None] & (gap > floor[..., None])
    return safe_reciprocal(gap, ok)


def subspace_tangent(d_cov: Tensor, eigenvalues: Tensor, eigenvectors: Tensor,
                     floor: Tensor, rank: int) -> Tensor:
    """dU ``[B, H, Dv, r]`` of the basis for a change ``d_cov`` of the covariance:
    du_i = sum_{j dropped} u_j (u_j^T dC u_i) / (lambda_i - lambda_j), i.e.
    dU = V [F o (V^T dC V)] (the kept columns). The kept-kept terms of the full
    eigenvector derivative rotate U within its span and leave U U^T unchanged."""
    vecs = eigenvectors
    du = vecs @ (_inverse_gaps(eigenvalues, floor, rank) * (vecs.transpose(-1, -2) @ d_cov @ vecs))
    return du[..., vecs.shape[-1] - rank:]


def subspace_gradient(grad_basis: Tensor, eigenvalues: Tensor, eigenvectors: Tensor,
                      floor: Tensor, rank: int) -> Tensor:
    """The covariance's gradient ``[B, H, Dv, Dv]`` (symmetric) from the basis' one
    G ``[B, H, Dv, r]``, the adjoint of ``subspace_tangent``:
    grad_C = sym(V [F o (V^T G)] V^T), G in the kept columns. Exact for a loss that
    depends on U through U U^T only (then V_k^T G is symmetric)."""
    vecs = eigenvectors
    dv = vecs.shape[-1]
    full = torch.cat([grad_basis.new_zeros(*grad_basis.shape[:-1], dv - rank), grad_basis], -1)
    x = vecs @ (_inverse_gaps(eigenvalues, floor, rank) * (vecs.transpose(-1, -2) @ full)) \
        @ vecs.transpose(-1, -2)
    return 0.5 * (x + x.transpose(-1, -2))


class _ValueBasis(torch.autograd.Function):
    """U ``[B, H, Dv, r]`` from the values v and their covariance's eigen-pairs (computed
    without derivatives by ``_covariance_eigh``), differentiable in v through the
    subspace U spans (``value_basis``)."""

    @staticmethod
    def forward(v: Tensor, weights: Tensor | None, eigenvalues: Tensor,  # type: ignore[override]
                eigenvectors: Tensor, floor: Tensor, rank: int) -> Tensor:
        return _top_columns(eigenvalues, eigenvectors, floor, rank).to(v.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        v, weights, eigenvalues, eigenvectors, floor, rank = inputs
        ctx.save_for_backward(v, weights, eigenvalues, eigenvectors, floor)
        ctx.rank = rank

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # C = sum_j c_j c_j^T (c_j = v_j - vbar on the real keys): dL/dv_j = 2 grad_C c_j
        # (the mean's term is 0: the c_j sum to 0)
        v, weights, eigenvalues, eigenvectors, floor = ctx.saved_tensors
        grad_cov = subspace_gradient(grad.double(), eigenvalues, eigenvectors, floor, ctx.rank)
        grad_v = 2.0 * (_centred(v, weights) @ grad_cov)
        return grad_v.to(v.dtype), None, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[Tensor, int]:
        out, dims = vmap_into_batch(_ValueBasis.apply, info, in_dims, args,
                                    tensors=(0, 1, 2, 3, 4), outputs=1)
        return out[0], dims[0]


def _top_columns(eigenvalues: Tensor, eigenvectors: Tensor, floor: Tensor, rank: int
                 ) -> Tensor:
    """The kept eigenvectors as the last ``rank`` columns (zero columns: not kept)."""
    kept = _kept(eigenvalues, floor, rank)
    return (eigenvectors * kept[..., None, :])[..., eigenvectors.shape[-1] - rank:]


def _plain_basis(v: Tensor, weights: Tensor | None, eigenvalues: Tensor,
                 eigenvectors: Tensor, floor: Tensor, rank: int) -> Tensor:
    """``_ValueBasis`` in plain operators (forward-mode AD, ``torch.export``; dynamo
    traces no custom jvp): U plus ``subspace_tangent`` of dC = C(v) - C(sg(v)), which is
    zero and carries dC's derivative, sum_j c_j dv_j^T + dv_j c_j^T (0 at a non-finite
    value, whose NaN would reach the basis the eager path keeps finite)."""
    zero = torch.where(torch.isfinite(v.detach()), v - v.detach(), 0.0)
    half = _centred(v.detach(), weights).transpose(-1, -2) @ zero.double()
    d_cov = half + half.transpose(-1, -2)
    basis = _top_columns(eigenvalues, eigenvectors, floor, rank)
    return (basis + subspace_tangent(d_cov, eigenvalues, eigenvectors, floor, rank)).to(v.dtype)


def value_basis(v: Tensor, key_valid: Tensor | None, rank: int | None) -> Tensor | None:
    """Leading principal directions of the values, ``[B, H, Dv, r]``, or ``None`` when
    every direction is kept.

    U holds the top r eigenvectors of the real values' covariance
    C = sum_j (v_j - vbar)(v_j - vbar)^T (float64, per head). Only directions the real
    values vary along: where they span fewer than r (fewer than r + 1 real keys), the
    other columns are zero instead of eigenvectors of a zero eigenvalue, which eigh
    picks at will.

    Differentiable in v: the far field depends on U through the projector U U^T only,
    whose derivative involves the kept-vs-dropped eigen-pairs alone,
    du_i = sum_{j dropped} u_j (u_j^T dC u_i) / (lambda_i - lambda_j)
    (``subspace_tangent``; backward ``subspace_gradient``). Where a kept and a dropped
    eigenvalue are equal to rounding the subspace is not determined by C and that
    pair contributes nothing. First derivatives only: a backward with
    ``create_graph=True`` is refused, and forward mode (``torch.func.jvp``, ``hessian``)
    holds the eigen-pairs fixed beyond the first derivative (a Hessian's v-v block
    lacks the basis' second derivative).
    """
    dv = v.shape[-1]
    if rank is None or rank >= dv:
        return None
    weights = None if key_valid is None else key_valid[:, None, :, None].to(torch.float64)
    eigenvalues, eigenvectors, floor = _covariance_eigh(v, weights)
    if functional_ops_only():
        return _plain_basis(v, weights, eigenvalues, eigenvectors, floor, rank)
    return apply(_ValueBasis, v, weights, eigenvalues, eigenvectors, floor, rank)


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
