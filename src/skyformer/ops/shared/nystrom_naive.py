"""The naive modified Nystrom method, written from the paper's equations.

They materialise the lifted 2n x 2n matrix C_bar = kappa([Q; K], [Q; K]) and an
explicit 2n x d sub-sampling matrix S, form C_bar S W S^T C_bar (eq. (5)) and take
its (Q-rows, K-columns) block (eq. (6)). One batch element at a time, float64 at
heart. Memory O(n^2): for tests and small analyses only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.nystrom import core_iterations
from ...sketch import Landmarks
from .modified_nystrom import NystromOptions


def _naive_razavi(a: Tensor, iterations: int, init: str) -> Tensor:
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    if init == "identity":
        v = eye.expand_as(a).clone()
    else:
        norm_1 = torch.linalg.matrix_norm(a, ord=1)
        norm_inf = torch.linalg.matrix_norm(a, ord=float("inf"))
        v = a.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]
    for _ in range(iterations):
        av = a @ v
        v = 0.25 * v @ (13 * eye - av @ (15 * eye - av @ (7 * eye - av)))
    return v


def naive_lemma3_inverse(m: Tensor, gamma: float, pinv: str, iterations: int, init: str) -> Tensor:
    """D^-1/2 inv(D^-1/2 (M + gamma I) D^-1/2) D^-1/2 with explicit diagonal matrices."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    mg = m + gamma * eye
    d_inv_sqrt = torch.diag_embed((mg @ torch.ones_like(mg[..., :1]))[..., 0] ** -0.5)
    a = d_inv_sqrt @ mg @ d_inv_sqrt
    if pinv != "exact":
        a_inv = _naive_razavi(a, iterations, init)
    elif gamma > 0:  # positive definite: its inverse (an eigendecomposition is exact
        a_inv = torch.linalg.inv(a)  # norm-wise only, linalg.nystrom.exact_inverse)
    else:  # each matrix far from pinv's cut (1-norm condition number) takes its inverse
        invertible = torch.linalg.cond(a, p=1) * 100 * a.shape[-1] * torch.finfo(a.dtype).eps < 1
        eye = torch.eye(a.shape[-1], dtype=a.dtype)
        inverse = torch.linalg.inv(torch.where(invertible[..., None, None], a, eye))
        a_inv = torch.where(invertible[..., None, None], inverse,
                            torch.linalg.pinv(a, hermitian=True))
    return d_inv_sqrt @ a_inv @ d_inv_sqrt


def _selection_matrix(landmarks: Landmarks, b: int, q_rows: Tensor, k_rows: Tensor,
                      dtype: torch.dtype) -> Tensor:
    """Explicit 0/1 sub-sampling matrix S ``[2n, d]`` over the valid rows [Q_valid; K_valid]."""
    columns = []
    for index, live, rows, offset in (
        (landmarks.query_index[b], landmarks.query_live[b], q_rows, 0),
        (landmarks.key_index[b], landmarks.key_live[b], k_rows, len(q_rows)),
    ):
        position = {int(r): i for i, r in enumerate(rows)}
        for i, alive in zip(index.tolist(), live.tolist(), strict=True):
            if alive:
                col = torch.zeros(len(q_rows) + len(k_rows), dtype=dtype)
                col[offset + position[i]] = 1.0
                columns.append(col)
    return torch.stack(columns, dim=1)


def reference_lifted_factors(
    q_hat: Tensor,
    k_hat: Tensor,
    landmarks: Landmarks,
    b: int,
    q_rows: Tensor,
    k_rows: Tensor,
    options: NystromOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """Factors of C~ = (I, 0) C_bar S W S^T C_bar (0, I)^T for batch element b.

    Returns ``((I, 0) C_bar S  [H, nq, d],  W  [H, d, d],  S^T C_bar (0, I)^T  [H, d, nk])``.
    """
    z = torch.cat([q_hat[b][:, q_rows], k_hat[b][:, k_rows]], dim=1)  # [H, 2n, D]
    c_bar = torch.exp(-torch.cdist(z, z) ** 2 / 2)  # [H, 2n, 2n]
    s = _selection_matrix(landmarks, b, q_rows, k_rows, z.dtype).to(z.device)
    # the fast path's steps (core_iterations also checks the options); with the implicit
    # gradient it forms the ridge inverse to rounding (scaled Newton steps, as many as
    # Lemma 3's bound needs for its slots, or a factorisation): the exact inverse here
    slots = landmarks.query_index.shape[-1] + landmarks.key_index.shape[-1]
    iterations = core_iterations(options.pinv_gradient, options.pinv_iterations, slots,
                                 options.gamma, options.pinv, options.pinv_init, z.dtype)
    pinv = "exact" if options.pinv_gradient == "implicit" else options.pinv
    w = naive_lemma3_inverse(s.T @ c_bar @ s, options.gamma, pinv, iterations,
                             options.pinv_init)
    nq = len(q_rows)
    return (c_bar @ s)[:, :nq], w, (s.T @ c_bar)[:, :, nq:]


def _valid_rows(mask: Tensor | None, b: int, n: int, device: torch.device) -> Tensor:
    if mask is None:
        return torch.arange(n, device=device)
    return mask[b].nonzero()[:, 0]


def naive_modified_nystrom(
    q: Tensor, k: Tensor, v: Tensor, landmarks: Landmarks, key_padding_mask: Tensor | None,
    scale: float, options: NystromOptions, *, softmax_threshold: float | None = None,
) -> Tensor:
    """Eqs. (4)-(6) per batch element on the inputs scaled by ``scale``: C~ V, or with
    ``softmax_threshold`` the row-normalised D~^-1 A~ V, A~ = E_Q C~ E_K (rows whose
    normaliser D~_i <= threshold * sum_s C(q_i, x_s) |(W C(X_S, K) E_K 1)_s| return the
    mean of the values). ``[B, H, Nq, Dv]``; rows of padded queries, and every row of a
    batch element with no key, are zero."""
    nq, nk = q.shape[2], k.shape[2]
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
    q_mask = key_padding_mask if (key_padding_mask is not None and nq == nk) else None
    for b in range(q.shape[0]):
        q_rows = _valid_rows(q_mask, b, nq, q.device)
        k_rows = _valid_rows(key_padding_mask, b, nk, k.device)
        if len(k_rows) == 0:  # no key: a sum over none, zero rows as the fast path gives
            continue
        c_qx, w, c_xk = reference_lifted_factors(
            q * scale, k * scale, landmarks, b, q_rows, k_rows, options
        )
        c_tilde = c_qx @ w @ c_xk  # [H, nq, nk]
        v_b = v[b][:, k_rows]
        if softmax_threshold is None:
            out[b][:, q_rows] = c_tilde @ v_b
            continue
        # A~ = E_Q C~ E_K; E_Q cancels in the row normalisation.
        e_k = torch.exp(0.5 * (k[b][:, k_rows] * scale).pow(2).sum(-1))  # [H, nk]
        a_tilde = c_tilde * e_k[:, None, :]
        normaliser = a_tilde.sum(-1, keepdim=True)
        bound = c_qx @ (w @ (c_xk @ e_k[..., None])).abs()
        reliable = (normaliser > softmax_threshold * bound) & (normaliser > 0)
        out[b][:, q_rows] = torch.where(
            reliable, (a_tilde @ v_b) / normaliser, v_b.mean(dim=1, keepdim=True)
        )
    return out
