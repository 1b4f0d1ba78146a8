"""Causal Skyformer: out_i ~ sum_{j <= i} C(q_i, k_j) v_j with no dependence on j > i.

The construction is derived in this folder's README ("Causal") and built from
``shared/causal_nystrom.py`` (landmarks revealed in order, nested cores from one
Cholesky) and ``shared/causal_prefix.py`` (chunked prefix sums): for query i in
chunk c (64 positions; the callers gather the real tokens to the front first, so
these are 64 real tokens: ``causal_nystrom.causal_inputs``),

    out_i = phi_<=i(q_i) . sum_{j < 64 c} phi(k_j) v_j^T  +  sum_{64 c <= j <= i} C(q_i, k_j) v_j,

phi(y) = L^-1 C(X_S, y), phi_<=i its entries of the slots available at i. With
``causal_local=False`` the second sum goes through the landmarks too. Time
O(N m (m + D) + N 64 D), memory O(N m).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_block, half_sq_norm
from ..shared.causal_nystrom import (
    CausalCore,
    CausalLandmarks,
    causal_core,
    draw_causal_landmarks,
    gaussian_features,
    uses_failed,
)
from ..shared.causal_prefix import (
    CAUSAL_CHUNK,
    by_blocks,
    causal_feature_sums,
    chunk_rows,
    row_blocks,
)
from ..shared.inputs import AttentionInputs

__all__ = ["causal_skyformer", "causal_skyformer_from_core", "draw_causal_landmarks"]


def causal_skyformer(q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs, scale: float,
                     gamma: float, local: bool, landmarks: CausalLandmarks, *,
                     chunk: int = CAUSAL_CHUNK, kernel: str = "auto"
                     ) -> tuple[Tensor, CausalCore]:
    """Causal Skyformer of ``q, k: [B, H, N, D]``, ``v: [B, H, N, Dv]`` (compute dtype,
    unscaled): ``([B, H, N, Dv], core)``; rows of padded queries are not zeroed here.
    ``kernel``: the features' products (``gaussian_features``)."""
    q, k, core = causal_core(q, k, scale, gamma, landmarks)
    out = causal_skyformer_from_core(q * scale, k * scale, v, info.key_valid, core, landmarks,
                                     local, chunk=chunk, kernel=kernel)
    return out, core


def causal_skyformer_from_core(qs: Tensor, ks: Tensor, v: Tensor, key_valid: Tensor | None,
                               core: CausalCore, landmarks: CausalLandmarks, local: bool, *,
                               chunk: int = CAUSAL_CHUNK, kernel: str = "auto",
                               start: Tensor | None = None, phi_k: Tensor | None = None
                               ) -> Tensor:
    """The outputs given the core: ``qs, ks: [B, H, N, D]`` scaled rows, ``key_valid:
    [B, N]`` or None, ``landmarks`` at positions of these rows. ``start: [B, H, m, Dv]``:
    sum phi(k_j) v_j^T of keys before these rows (a shard after others, sequence
    parallel; position 0 must start a chunk of the sequence); ``phi_k``: the keys'
    features where the caller has them (``gaussian_features`` of ``ks``, ``key_valid``).
    ``[B, H, N, Dv]``.

    An eager call that records no gradient (inference, a prompt's prefill) runs by
    blocks of rows (``causal_prefix.by_blocks``), each starting from the keys before it
    (``start``): the features, exact chunks and chunk states of one block at a time,
    where the whole call held them for every row at once (4.8 KiB a row at B = 1,
    H = 2, m = 128). The same sums, added in another order."""
    if phi_k is None and by_blocks(qs.shape[2], qs, ks, v, core.x, core.l_inv, start):
        return _by_blocks(qs, ks, v, key_valid, core, landmarks, local, chunk=chunk,
                          kernel=kernel, start=start)
    return _whole(qs, ks, v, key_valid, core, landmarks, local, chunk=chunk, kernel=kernel,
                  start=start, phi_k=phi_k)


def _by_blocks(qs: Tensor, ks: Tensor, v: Tensor, key_valid: Tensor | None, core: CausalCore,
               landmarks: CausalLandmarks, local: bool, *, chunk: int, kernel: str,
               start: Tensor | None) -> Tensor:
    """``causal_skyformer_from_core`` block by block (blocks of whole chunks), each
    block's keys added to the state the next one starts from."""
    b, h, n, _ = qs.shape
    state = start if start is not None else v.new_zeros(b, h, core.l_inv.shape[-1], v.shape[-1])
    outs = []
    for rows in row_blocks(n, chunk):
        valid = None if key_valid is None else key_valid[:, rows]
        phi_k = gaussian_features(ks[:, :, rows], core, row_valid=valid, kernel=kernel)
        here = CausalLandmarks(landmarks.position - rows.start, landmarks.live,
                               landmarks.from_query)
        outs.append(_whole(qs[:, :, rows], ks[:, :, rows], v[:, :, rows], valid, core, here,
                           local, chunk=chunk, kernel=kernel, start=state, phi_k=phi_k))
        state = state + phi_k.transpose(-1, -2) @ v[:, :, rows]
    return torch.cat(outs, dim=2)


def _whole(qs: Tensor, ks: Tensor, v: Tensor, key_valid: Tensor | None, core: CausalCore,
           landmarks: CausalLandmarks, local: bool, *, chunk: int, kernel: str,
           start: Tensor | None, phi_k: Tensor | None) -> Tensor:
    """``causal_skyformer_from_core`` on every row at once."""
    n = qs.shape[2]
    available = landmarks.available(n)  # [B, 1, N, m]
    phi_q = gaussian_features(qs, core, kernel=kernel)
    phi_q = torch.where(available, phi_q, 0.0)  # [B, H, N, m]
    if phi_k is None:
        phi_k = gaussian_features(ks, core, row_valid=key_valid, kernel=kernel)
    exact = None
    if local:  # C(q_i, k_j) within each chunk; padded keys have +inf norms: exact zeros
        q_norm = half_sq_norm(qs)
        k_norm = half_sq_norm(ks)  # [B, H, N]
        if key_valid is not None:
            k_norm = torch.where(key_valid[:, None, :], k_norm, float("inf"))
        q_c, k_c = chunk_rows(qs, chunk), chunk_rows(ks, chunk)
        qn_c, kn_c = (chunk_rows(t[..., None], chunk)[..., 0] for t in (q_norm, k_norm))
        exact = gaussian_kernel_block(q_c, k_c, qn_c, kn_c)  # [B, H, C, L, L]
    out = causal_feature_sums(phi_q, phi_k, v, chunk=chunk, local=exact, start=start)
    return torch.where(uses_failed(available, core.failed)[..., None], float("nan"), out)
