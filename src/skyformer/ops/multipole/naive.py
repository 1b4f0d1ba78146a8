"""Naive references for the multipole methods, written from the definitions.

One query at a time, with explicit key sets: near keys N_a (the ``near`` largest centre
logits of the query's cluster a), window W_i = {j : |i - j| <= w} minus N_a (i, j ranks
among the real queries and keys), far keys
F_a = all real keys minus N_a, and the far field's first-order expansion

    sum_{j in F_a \\ W_i} exp(l_ij) [v_j, 1]
      ~ exp(log R_a + delta.kbar) ([vbar + P Cov(v, k) delta, 1] - sum_{j in W_i} omega_j [v_j, 1]),
    omega_j = exp(z_a.k_j + b_j - log R_a) max(0, 1 + delta.(k_j - kbar)),

with P the projector on the leading principal directions of the values and the tilted
mean clamped to the values' per-coordinate range. The cluster centres are recomputed
here as the member means, so gradients through them can be compared. O(N^2) per head;
for tests only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def _value_projector(v: Tensor, rank: int) -> Tensor:
    """P = U U^T for the top ``rank`` principal directions of the rows of v ``[n, Dv]``,
    of those along which the rows vary (eigenvalue above rounding, relative to the
    largest and to what centring leaves, eps sum_j |v_j|^2): fewer than ``rank`` where
    the centred rows span fewer. Differentiable in v by autograd's eigenvector
    derivative (exact where the eigenvalues are distinct)."""
    dv = v.shape[-1]
    if rank >= dv:
        return torch.eye(dv, dtype=v.dtype)
    centred = v.double() - v.double().mean(0)
    eigenvalues, eigenvectors = torch.linalg.eigh(centred.T @ centred)
    eps = torch.finfo(torch.float64).eps  # rounding: of the largest, or of the centring
    scale = torch.maximum(eigenvalues[-1], eps * v.double().square().sum()).detach()
    varies = eigenvalues.detach() > scale * 64 * dv * eps
    u = eigenvectors[:, dv - rank:][:, varies[dv - rank:]].to(v.dtype)
    return u @ u.T


def _one_head(
    q, k, v, bias, assignment, rows, near, window, rank, self_attention, tilt_keys, buckets
):
    """S_i = sum_j exp(l_ij)[v_j, 1] approximated for the query positions ``rows`` of one
    head: ``[len(rows), Dv + 1]``."""
    nk = k.shape[0]
    real = [j for j in range(nk) if math.isfinite(float(bias[j].detach()))]
    v_real = v[real]
    projector = _value_projector(v_real, rank) if rank else None
    low, high = v_real.amin(0), v_real.amax(0)  # as the fast path: gradients to extremes
    out = []
    for i in rows.tolist():
        a = int(assignment[i])
        members = [r for r in rows.tolist() if int(assignment[r]) == a]
        z = q[members].mean(0)
        delta = q[i] - z
        centre_logits = k @ z + bias  # [nk]
        order = torch.argsort(centre_logits.detach(), descending=True).tolist()
        near_set = {j for j in order[:near] if math.isfinite(float(centre_logits[j].detach()))}
        far = [j for j in real if j not in near_set]
        window_set = set()
        if self_attention and window:
            r_i = rows.tolist().index(i)  # ranks among the real queries and keys
            window_set = {j for r_j, j in enumerate(real)
                          if abs(r_i - r_j) <= window and j not in near_set}
        if buckets is not None:
            q_bucket, k_bucket = buckets
            window_set = {j for j in real if k_bucket[j] == q_bucket[i] and j not in near_set}
        total = torch.zeros(v.shape[1] + 1, dtype=q.dtype)
        for j in sorted(near_set | window_set):
            total = total + torch.exp(q[i] @ k[j] + bias[j]) * torch.cat([v[j], v.new_ones(1)])
        if far:
            weights = torch.exp(centre_logits[far])
            mass = weights.sum()
            p = weights / mass
            kbar = p @ k[far]
            vbar = p @ v[far]
            tilted = vbar
            if rank:
                sampled = far if tilt_keys is None else [j for j in far if j in tilt_keys]
                cov = torch.zeros(v.shape[1], k.shape[1], dtype=q.dtype)
                if sampled:
                    ps = torch.exp(centre_logits[sampled])
                    ps = ps / ps.sum()
                    ks, vs = k[sampled], v[sampled]
                    cov = (vs - ps @ vs).T @ (ps[:, None] * (ks - ps @ ks))  # [Dv, D]
                tilted = vbar + projector @ (cov @ delta)
            tilted = torch.maximum(torch.minimum(tilted, high), low)
            far_num, far_den = tilted, torch.ones((), dtype=q.dtype)
            for j in sorted(window_set):
                omega = (
                    torch.exp(centre_logits[j])
                    / mass
                    * torch.clamp(1 + delta @ (k[j] - kbar), min=0.0)
                )
                far_num = far_num - omega * v[j]
                far_den = far_den - omega
            if far_den > 0:
                scale = torch.exp(torch.log(mass) + delta @ kbar)
                total = total + scale * torch.cat([far_num, far_den[None]])
        out.append(total)
    return torch.stack(out)


def reference_multipole_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_bias: Tensor,
    assignment: Tensor,
    *,
    query_valid: Tensor | None,
    near: int,
    window: int,
    rank: int,
    tilt_sample: Tensor | None = None,
    buckets: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``[B, H, Nq, Dv + 1]`` approximations of sum_j exp(q_i.k_j + b_j) [v_j, 1].

    Args:
        q, k: scaled queries/keys ``[B, H, N, D]``; v ``[B, H, Nk, Dv]``.
        key_bias: ``[B, H, Nk]``, -inf for padded keys.
        assignment: ``[B, H, Nq]`` cluster of every query (padded queries ignored).
        query_valid: ``[B, Nq]`` or ``None``.
        near, window, rank: near keys per cluster, window half-width, tilt rank.
        tilt_sample: ``[B, S]`` keys the covariance term is estimated from (``None`` = all):
            self-normalised centre weights over the sampled far keys, centred on their
            own means.
        buckets: (query bucket ``[B, H, Nq]``, key bucket ``[B, H, Nk]``): keys of the
            query's bucket are exact (instead of a window).
    Rows of padded queries are zero.
    """
    b, h, nq, _ = q.shape
    out = torch.zeros(b, h, nq, v.shape[-1] + 1, dtype=q.dtype)
    self_attention = nq == k.shape[2]
    for bi in range(b):
        rows = torch.arange(nq) if query_valid is None else query_valid[bi].nonzero()[:, 0]
        if not len(rows):
            continue
        for hi in range(h):
            out[bi, hi, rows] = _one_head(
                q[bi, hi],
                k[bi, hi],
                v[bi, hi],
                key_bias[bi, hi],
                assignment[bi, hi],
                rows,
                near,
                window,
                rank,
                self_attention,
                None if tilt_sample is None else set(tilt_sample[bi].tolist()),
                None
                if buckets is None
                else (buckets[0][bi, hi].tolist(), buckets[1][bi, hi].tolist()),
            )
    return out


def _sums(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, assignment: Tensor,
          key_padding_mask: Tensor | None, structure: dict[str, Any]
          ) -> tuple[Tensor, Tensor | None]:
    """``reference_multipole_sums`` with padded keys masked in ``bias``; also returns the
    query mask (self-attention)."""
    if key_padding_mask is not None:
        bias = bias.masked_fill(~key_padding_mask[:, None, :], float("-inf"))
    query_valid = key_padding_mask if q.shape[2] == k.shape[2] else None
    return reference_multipole_sums(q, k, v, bias, assignment, query_valid=query_valid,
                                    **structure), query_valid


def reference_softmax_multipole_attention(
    q: Tensor, k: Tensor, v: Tensor, assignment: Tensor, *,
    key_padding_mask: Tensor | None = None, scale: float | None = None, **structure: Any,
) -> Tensor:
    """Naive ``softmax_multipole`` for given cluster assignments; ``structure`` as
    ``reference_multipole_sums`` (near, window, rank, tilt_sample, buckets).
    ``[B, H, Nq, Dv]``."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    bias = torch.zeros(k.shape[:3], dtype=q.dtype)
    sums, query_valid = _sums(q * s, k, v, bias, assignment, key_padding_mask, structure)
    out = sums[..., :-1] / sums[..., -1:].clamp_min(1e-300)
    return out if query_valid is None else out * query_valid[:, None, :, None]


def reference_skyformer_multipole_attention(
    q: Tensor, k: Tensor, v: Tensor, assignment: Tensor, *,
    key_padding_mask: Tensor | None = None, scale: float | None = None, **structure: Any,
) -> Tensor:
    """Naive ``skyformer_multipole`` for given cluster assignments; ``structure`` as
    ``reference_multipole_sums``; kernel exp(-s |q - k|^2 / 2), s = ``scale`` or
    1/sqrt(D). ``[B, H, Nq, Dv]``."""
    c = (q.shape[-1] ** -0.5 if scale is None else scale) ** 0.5
    q_hat, k_hat = q * c, k * c
    bias = -0.5 * (k_hat * k_hat).sum(-1)
    sums, query_valid = _sums(q_hat, k_hat, v, bias, assignment, key_padding_mask, structure)
    out = torch.exp(-0.5 * (q_hat * q_hat).sum(-1))[..., None] * sums[..., :-1]
    return out if query_valid is None else out * query_valid[:, None, :, None]
