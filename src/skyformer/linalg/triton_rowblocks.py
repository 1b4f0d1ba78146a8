"""Products of small matrices held in global memory, a block of rows at a time, inside
one Triton program (the Lemma 3 kernels, ``triton_lemma3``, ``triton_lemma3_backward``).

A chain of m x m products (m <= 128) whose matrices do not all fit in registers keeps
each matrix in a slot of a scratch buffer (64 KiB a slot at m = 128, read back through
the caches) and computes each result a block of ``ROWS`` rows at a time: a ``[ROWS, m]``
accumulator summing ``_mm`` of ``[ROWS, KC]`` and ``[KC, m]`` tiles. A chain of such
passes is correct on a GPU when a barrier of the program's threads
(``tl.debug_barrier``: bar.sync, which orders the CTA's global memory accesses too)
separates a pass that writes a slot from one that reads it, and no pass writes a slot
that it reads (a thread may store rows that another thread has yet to load). Triton's
interpreter runs a program's whole tensors at once and would pass without the
barriers: they are the kernels' own discipline, kept by the passes' structure.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _mm


@triton.jit
def tile(P, ld, rows, cols, n_rows, n_cols, TRANS: tl.constexpr):
    """op(P)[rows, cols] of the row-major matrix P (leading dimension ``ld``; op: the
    transpose if ``TRANS``, read along P's rows and transposed in registers), zero
    outside op(P)'s ``n_rows x n_cols``."""
    if TRANS:
        mask = (cols < n_cols)[:, None] & (rows < n_rows)[None, :]
        return tl.trans(tl.load(P + cols[:, None] * ld + rows[None, :], mask=mask, other=0.0))
    else:
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        return tl.load(P + rows[:, None] * ld + cols[None, :], mask=mask, other=0.0)


@triton.jit
def product_rows(X, ldx, TRANS_X: tl.constexpr, Y, ldy, TRANS_Y: tl.constexpr, rows,
                  m, inner, n, ROWS: tl.constexpr, WIDTH: tl.constexpr, KC: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Rows ``rows`` of op(X) op(Y), op(X) ``[m, inner]``, op(Y) ``[inner, n]``: a
    ``[ROWS, WIDTH]`` tile, the inner dimension ``KC`` at a time."""
    cols = tl.arange(0, WIDTH)
    acc = tl.zeros([ROWS, WIDTH], dtype=X.dtype.element_ty)
    for start in range(0, inner, KC):
        ks = start + tl.arange(0, KC)
        acc += _mm(tile(X, ldx, rows, ks, m, inner, TRANS_X),
                   tile(Y, ldy, ks, cols, inner, n, TRANS_Y), PRECISION, False)
    return acc


@triton.jit
def square_rows(X, TRANS_X: tl.constexpr, Y, TRANS_Y: tl.constexpr, rows, m,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Rows ``rows`` of op(X) op(Y) for two m x m matrices: ``[ROWS, BLOCK]``."""
    return product_rows(X, m, TRANS_X, Y, m, TRANS_Y, rows, m, m, m, ROWS, BLOCK, KC,
                         PRECISION)


@triton.jit
def rows_of(P, rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of the m x m matrix P: ``[ROWS, BLOCK]``, zero past m."""
    return tile(P, m, rows, tl.arange(0, BLOCK), m, m, False)


@triton.jit
def store_rows(P, rows, m, value, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(P + rows[:, None] * m + cols[None, :], value,
             mask=(rows < m)[:, None] & (cols < m)[None, :])


@triton.jit
def eye_rows(rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of the m x m identity (zero past m, so padding stays zero)."""
    cols = tl.arange(0, BLOCK)
    return tl.where((rows[:, None] == cols[None, :]) & (rows < m)[:, None], 1.0, 0.0)
