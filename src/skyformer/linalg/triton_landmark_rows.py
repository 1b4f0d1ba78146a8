"""The gradient of the landmark rows added into dq and dk in one Triton kernel.

Skyformer's landmark rows X = s [Q_S; K_S] enter its products and its core with their
half squared norms n = |x|^2 / 2. Their gradient reaches q and k as

    dq[i_j] += s (dX_j + dn_j x_j),    dX = dX_query + dX_core + dX_keys,
                                       dn = dn_query + dn_core + dn_keys,

the sums over the query product, the Lemma 3 core and the key product, dn zero on dead
slots (``live``), rounded to q's dtype and added at each slot's row (``rows``'s flat
row numbers). By PyTorch operations that is 13 launches (the sums, the norm term, the
scale, the conversion, and for each side a copy of its slice and an ``index_add_``);
here one, with the same arithmetic in the same order, so the results are the same bits
(``landmark_rows.add_rows_gradient_by_pytorch``; compiled without contracting a product
and a sum into one rounding, which PyTorch's separate operations do not do). Each side's
slots hold distinct rows (the draws sample without replacement), so every row is
written by one program at most: no atomics, the same numbers every run.

This module imports Triton; ``landmark_rows`` imports it only on the Triton path.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .launch_grid import cdiv, tile_width
from .triton_rounding import to_dtype

BLOCK_S = 16  # slots a program


@triton.jit
def _landmark_rows_gradient_kernel(
    DX, DX_CORE, DX_KEYS, DN, DN_CORE, DN_KEYS, LIVE, X, DQ, FLAT_Q, DK, FLAT_K,
    m, mq, d, heads, scale,
    HAS_LIVE: tl.constexpr, ADD_Q: tl.constexpr, ADD_K: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One matrix ``bh`` (grid dim 0) and ``BLOCK_S`` of its ``m`` slots (dim 1): the
    slots' gradient s ((dX + dX_core + dX_keys) + dn x + dn x) with dn =
    ((dn + dn_core) + dn_keys) / 2 (0 on dead slots), added into the rows ``FLAT_Q`` of
    DQ (slots below ``mq``) and ``FLAT_K`` of DK (the rest) in their dtype."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    in_s = s < m
    tile = in_s[:, None] & (c[None, :] < d)
    at = (bh * m + s)[:, None] * d + c[None, :]
    grad = tl.load(DX + at, mask=tile, other=0.0) + tl.load(DX_CORE + at, mask=tile, other=0.0)
    grad = grad + tl.load(DX_KEYS + at, mask=tile, other=0.0)
    norm = tl.load(DN + bh * m + s, mask=in_s, other=0.0) \
        + tl.load(DN_CORE + bh * m + s, mask=in_s, other=0.0)
    norm = norm + tl.load(DN_KEYS + bh * m + s, mask=in_s, other=0.0)
    if HAS_LIVE:  # the dead slots' +inf norms take no gradient
        live = tl.load(LIVE + (bh // heads) * m + s, mask=in_s, other=0)
        norm = tl.where(live != 0, norm, 0.0)
    half = (norm * 0.5)[:, None] * tl.load(X + at, mask=tile, other=0.0)
    grad = ((grad + half) + half) * scale
    if ADD_Q:
        side = tile & (s < mq)[:, None]
        row = tl.load(FLAT_Q + bh * mq + s, mask=in_s & (s < mq), other=0)
        to = DQ + row[:, None] * d + c[None, :]
        part = to_dtype(grad, DQ.dtype.element_ty).to(grad.dtype)
        total = tl.load(to, mask=side, other=0.0).to(grad.dtype) + part
        tl.store(to, to_dtype(total, DQ.dtype.element_ty), mask=side)
    if ADD_K:
        mk = m - mq
        side = tile & (s >= mq)[:, None]
        row = tl.load(FLAT_K + bh * mk + (s - mq), mask=in_s & (s >= mq), other=0)
        to = DK + row[:, None] * d + c[None, :]
        part = to_dtype(grad, DK.dtype.element_ty).to(grad.dtype)
        total = tl.load(to, mask=side, other=0.0).to(grad.dtype) + part
        tl.store(to, to_dtype(total, DK.dtype.element_ty), mask=side)


def add_landmark_rows_gradient(
    dq: Tensor | None, dk: Tensor | None, flat_q: Tensor, flat_k: Tensor, x: Tensor,
    dx: tuple[Tensor, Tensor, Tensor], dnorm: tuple[Tensor, Tensor, Tensor],
    live: Tensor | None, scale: float,
) -> None:
    """Adds the landmark rows' gradient into ``dq`` and ``dk`` in place (either None:
    that side is left out). ``x: [BH, m, D]`` the rows (scaled), ``dx``: their three
    gradients ``[BH, m, D]`` and ``dnorm`` their norms' ``[BH, m]`` (query product,
    core, key product), ``live: [B, m]`` or None, ``flat_q: [BH, mq]`` and
    ``flat_k: [BH, m - mq]`` the slots' rows in dq and dk viewed as ``[rows, D]``; all
    contiguous, on one device, the rows' gradients in x's dtype."""
    bh, m, d = x.shape
    mq = flat_q.shape[-1]
    heads = bh // live.shape[0] if live is not None else 1
    dummy = x
    _landmark_rows_gradient_kernel[(bh, cdiv(m, BLOCK_S))](
        *dx, *dnorm, dummy if live is None else live, x,
        dummy if dq is None else dq, flat_q, dummy if dk is None else dk, flat_k,
        m, mq, d, heads, float(scale),
        HAS_LIVE=live is not None, ADD_Q=dq is not None, ADD_K=dk is not None,
        BLOCK_S=BLOCK_S, BLOCK_D=tile_width(d), num_warps=4, enable_fp_fusion=False,
    )

