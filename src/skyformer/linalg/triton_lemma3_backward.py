"""The backward pass of the Lemma 3 inverse (``triton_lemma3``) in one Triton program
per matrix, its m x m matrices in a scratch area of global memory.

The adjoint keeps about a dozen m x m matrices alive. Held in registers, as the
forward kernel holds its few, they need more than an SM has from m = 128 (compiled
for sm_90: 255 registers and 7 KB of spills a thread, 256 KiB of shared memory, so
it cannot launch) and spill 3.6 KB a thread at m = 64. Here each matrix of the
program lives in its own slot of a scratch buffer ``[BH, SLOTS, m, m]`` (12 x 64 KiB
at m = 128, small enough to stay in L2), and every step is a few passes over blocks
of ``ROWS`` rows: each row block of a result is a sum of products op(X) op(Y) taken
``KC`` columns of op(X) at a time into a ``[ROWS, m]`` accumulator. The passes are
separated by a barrier of the program's threads (a pass reads what the one before
wrote), and no pass writes a slot it reads (the gradient of V and dA alternate
between two slots each), so no thread overwrites what another still reads.

The adjoint of ``triton_lemma3``'s docstring (``pinv._RazaviIteration``), step by
step from the last, V the step's input iterate (stored by the forward kernel), G the
gradient of its output, T1 = 7I - P folded into the products (P T1 = 7P - P P and
M2 T1^T = 7 M2 - M2 P^T):

    pass 1:  P   = A V,                  dT3 = V^T G / 4
    pass 2:  T2  = 15I - 7P + P P,       M2  = P^T dT3          (M2 = -dT2)
    pass 3:  T3  = 13I - P T2,           dP  = 7 M2 - M2 P^T - P^T M2 - dT3 T2^T
    pass 4:  dA' = dA + dP V^T,          G'  = G T3^T / 4 + A^T dP

and the first step, from V_0 = I (P = A, no product with V, no gradient to V_0), in
two passes. Before them: M_r, d = M_r 1, s = d^-1/2, A and G = S dW S; after them,
ds (from dW V_K and dA M_r), dM = S dA S + dd 1^T and, from the landmark rows,
dE = dM * C(X, X), dX = (dE + dE^T) X and dn = -(dE 1 + dE^T 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_kernels import _mm, _precision

# Scratch slots of one matrix (each m x m) and vectors (each m).
# (Constants the kernel reads must be tl.constexpr.)
SLOTS = tl.constexpr(12)
_MR, _A, _G, _DA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)  # G, dA: 2
_P, _DT3, _T2, _M2 = tl.constexpr(6), tl.constexpr(7), tl.constexpr(8), tl.constexpr(9)
_T3, _DP = tl.constexpr(10), tl.constexpr(11)
_DE = _P  # dE reuses P's slot once the steps are done
VECTORS = tl.constexpr(6)
_D, _S, _DS_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_DS_COLS, _DN_ROWS, _DN_COLS = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5)


@triton.jit
def _tile(P, ld, rows, cols, n_rows, n_cols, TRANS: tl.constexpr):
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
def _product_rows(X, ldx, TRANS_X: tl.constexpr, Y, ldy, TRANS_Y: tl.constexpr, rows,
                  m, inner, n, ROWS: tl.constexpr, WIDTH: tl.constexpr, KC: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Rows ``rows`` of op(X) op(Y), op(X) ``[m, inner]``, op(Y) ``[inner, n]``: a
    ``[ROWS, WIDTH]`` tile, the inner dimension ``KC`` at a time."""
    cols = tl.arange(0, WIDTH)
    acc = tl.zeros([ROWS, WIDTH], dtype=X.dtype.element_ty)
    for start in range(0, inner, KC):
        ks = start + tl.arange(0, KC)
        acc += _mm(_tile(X, ldx, rows, ks, m, inner, TRANS_X),
                   _tile(Y, ldy, ks, cols, inner, n, TRANS_Y), PRECISION, False)
    return acc


@triton.jit
def _square_rows(X, TRANS_X: tl.constexpr, Y, TRANS_Y: tl.constexpr, rows, m,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Rows ``rows`` of op(X) op(Y) for two m x m matrices: ``[ROWS, BLOCK]``."""
    return _product_rows(X, m, TRANS_X, Y, m, TRANS_Y, rows, m, m, m, ROWS, BLOCK, KC,
                         PRECISION)


@triton.jit
def _rows_of(P, rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of the m x m matrix P: ``[ROWS, BLOCK]``, zero past m."""
    return _tile(P, m, rows, tl.arange(0, BLOCK), m, m, False)


@triton.jit
def _store_rows(P, rows, m, value, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(P + rows[:, None] * m + cols[None, :], value,
             mask=(rows < m)[:, None] & (cols < m)[None, :])


@triton.jit
def _eye_rows(rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of the m x m identity (zero past m, so padding stays zero)."""
    cols = tl.arange(0, BLOCK)
    return tl.where((rows[:, None] == cols[None, :]) & (rows < m)[:, None], 1.0, 0.0)


@triton.jit
def _backward_kernel(M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D, heads,
                     ITERATIONS: tl.constexpr, FROM_ROWS: tl.constexpr, TINY: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                     KC: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    size = m * m
    scratch = SCR + bh * SLOTS * size
    vectors = VEC + bh * VECTORS * m
    mat_r, a, p, dt3, t2, m2, t3, dp = (scratch + _MR * size, scratch + _A * size,
                                        scratch + _P * size, scratch + _DT3 * size,
                                        scratch + _T2 * size, scratch + _M2 * size,
                                        scratch + _T3 * size, scratch + _DP * size)
    grad = G + bh * size
    v_last = STORE + (bh * ITERATIONS + ITERATIONS - 1) * size
    xb = X + bh * m * D
    cols = tl.arange(0, BLOCK)
    ridge = tl.load(DIAG + (bh // heads) * m + cols, mask=cols < m, other=0.0)

    # M_r = C + diag(ridge), d = M_r 1, s = rsqrt(max(d, tiny))
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        if FROM_ROWS:  # C_ij = exp(x_i . x_j - n_i - n_j)
            n_rows = tl.load(XN + bh * m + rows, mask=rows < m, other=float("inf"))
            n_cols = tl.load(XN + bh * m + cols, mask=cols < m, other=float("inf"))
            dots = _product_rows(xb, D, False, xb, D, True, rows, m, D, m, ROWS, BLOCK, KC,
                                 PRECISION)
            block = tl.exp(dots - n_rows[:, None] - n_cols[None, :])
        else:
            block = _rows_of(M + bh * size, rows, m, BLOCK)
        block += _eye_rows(rows, m, BLOCK) * ridge[None, :]
        _store_rows(mat_r, rows, m, block, BLOCK)
        d = tl.sum(block, axis=1)
        tl.store(vectors + _D * m + rows, d, mask=rows < m)
        tl.store(vectors + _S * m + rows, 1.0 / tl.sqrt(tl.maximum(d, TINY)), mask=rows < m)
    tl.debug_barrier()

    # A = S M_r S, the gradient of V_K in the normalised frame S dW S, dA = 0
    s_cols = tl.load(vectors + _S * m + cols, mask=cols < m, other=0.0)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(vectors + _S * m + rows, mask=rows < m, other=0.0)
        scale = s_rows[:, None] * s_cols[None, :]
        _store_rows(a, rows, m, scale * _rows_of(mat_r, rows, m, BLOCK), BLOCK)
        _store_rows(scratch + _G * size, rows, m, scale * _rows_of(grad, rows, m, BLOCK),
                    BLOCK)
        _store_rows(scratch + _DA * size, rows, m, tl.zeros_like(scale), BLOCK)
    tl.debug_barrier()

    for j in range(0, ITERATIONS - 1):  # steps K, ..., 2; V = V_{i-1} of step i
        v = STORE + (bh * ITERATIONS + ITERATIONS - 2 - j) * size
        g_in = scratch + (_G + j % 2) * size
        g_out = scratch + (_G + 1 - j % 2) * size
        da_in = scratch + (_DA + j % 2) * size
        da_out = scratch + (_DA + 1 - j % 2) * size
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            _store_rows(p, rows, m, _square_rows(a, False, v, False, rows, m, ROWS, BLOCK,
                                                 KC, PRECISION), BLOCK)
            _store_rows(dt3, rows, m, 0.25 * _square_rows(v, True, g_in, False, rows, m,
                                                           ROWS, BLOCK, KC, PRECISION),
                        BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            p_p = _square_rows(p, False, p, False, rows, m, ROWS, BLOCK, KC, PRECISION)
            _store_rows(t2, rows, m, 15.0 * _eye_rows(rows, m, BLOCK)
                        - 7.0 * _rows_of(p, rows, m, BLOCK) + p_p, BLOCK)
            _store_rows(m2, rows, m, _square_rows(p, True, dt3, False, rows, m, ROWS, BLOCK,
                                                  KC, PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            _store_rows(t3, rows, m, 13.0 * _eye_rows(rows, m, BLOCK)
                        - _square_rows(p, False, t2, False, rows, m, ROWS, BLOCK, KC,
                                       PRECISION), BLOCK)
            dp_rows = 7.0 * _rows_of(m2, rows, m, BLOCK) \
                - _square_rows(m2, False, p, True, rows, m, ROWS, BLOCK, KC, PRECISION) \
                - _square_rows(p, True, m2, False, rows, m, ROWS, BLOCK, KC, PRECISION) \
                - _square_rows(dt3, False, t2, True, rows, m, ROWS, BLOCK, KC, PRECISION)
            _store_rows(dp, rows, m, dp_rows, BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            _store_rows(da_out, rows, m, _rows_of(da_in, rows, m, BLOCK)
                        + _square_rows(dp, False, v, True, rows, m, ROWS, BLOCK, KC,
                                       PRECISION), BLOCK)
            _store_rows(g_out, rows, m, 0.25 * _square_rows(g_in, False, t3, True, rows, m,
                                                            ROWS, BLOCK, KC, PRECISION)
                        + _square_rows(a, True, dp, False, rows, m, ROWS, BLOCK, KC,
                                       PRECISION), BLOCK)
        tl.debug_barrier()

    # step 1 from V_0 = I: P = A, dT3 = G / 4
    g_in = scratch + (_G + (ITERATIONS - 1) % 2) * size
    da_in = scratch + (_DA + (ITERATIONS - 1) % 2) * size
    da = scratch + (_DA + ITERATIONS % 2) * size  # the final dA
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        a_a = _square_rows(a, False, a, False, rows, m, ROWS, BLOCK, KC, PRECISION)
        _store_rows(t2, rows, m, 15.0 * _eye_rows(rows, m, BLOCK)
                    - 7.0 * _rows_of(a, rows, m, BLOCK) + a_a, BLOCK)
        _store_rows(m2, rows, m, 0.25 * _square_rows(a, True, g_in, False, rows, m, ROWS,
                                                     BLOCK, KC, PRECISION), BLOCK)
    tl.debug_barrier()
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        da_rows = _rows_of(da_in, rows, m, BLOCK) + 7.0 * _rows_of(m2, rows, m, BLOCK) \
            - _square_rows(m2, False, a, True, rows, m, ROWS, BLOCK, KC, PRECISION) \
            - _square_rows(a, True, m2, False, rows, m, ROWS, BLOCK, KC, PRECISION) \
            - 0.25 * _square_rows(g_in, False, t2, True, rows, m, ROWS, BLOCK, KC, PRECISION)
        _store_rows(da, rows, m, da_rows, BLOCK)
    tl.debug_barrier()

    # ds_i = sum_j (dW V_K + dA M_r)_ij s_j + (dW V_K + dA M_r)_ji s_j
    ds_cols = tl.zeros([BLOCK], dtype=s_cols.dtype)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(vectors + _S * m + rows, mask=rows < m, other=0.0)
        both = _rows_of(grad, rows, m, BLOCK) * _rows_of(v_last, rows, m, BLOCK) \
            + _rows_of(da, rows, m, BLOCK) * _rows_of(mat_r, rows, m, BLOCK)
        tl.store(vectors + _DS_ROWS * m + rows, tl.sum(both * s_cols[None, :], axis=1),
                 mask=rows < m)
        ds_cols += tl.sum(both * s_rows[:, None], axis=0)
    tl.store(vectors + _DS_COLS * m + cols, ds_cols, mask=cols < m)
    tl.debug_barrier()

    # dM = S dA S + dd 1^T, dd = -ds s^3 / 2 where d > tiny
    dn_cols = tl.zeros([BLOCK], dtype=s_cols.dtype)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        inside = rows < m
        s_rows = tl.load(vectors + _S * m + rows, mask=inside, other=0.0)
        d_rows = tl.load(vectors + _D * m + rows, mask=inside, other=0.0)
        ds = tl.load(vectors + _DS_ROWS * m + rows, mask=inside, other=0.0) \
            + tl.load(vectors + _DS_COLS * m + rows, mask=inside, other=0.0)
        dd = tl.where(inside & (d_rows > TINY), -0.5 * ds * s_rows * s_rows * s_rows, 0.0)
        dm = s_rows[:, None] * _rows_of(da, rows, m, BLOCK) * s_cols[None, :] + dd[:, None]
        if FROM_ROWS:  # E_ij = x_i . x_j - n_i - n_j, dE = dM * C
            block = _rows_of(mat_r, rows, m, BLOCK) - _eye_rows(rows, m, BLOCK) * ridge[None, :]
            de = dm * block
            _store_rows(scratch + _DE * size, rows, m, de, BLOCK)
            tl.store(vectors + _DN_ROWS * m + rows, tl.sum(de, axis=1), mask=inside)
            dn_cols += tl.sum(de, axis=0)
        else:
            _store_rows(DM + bh * size, rows, m, dm, BLOCK)
    if FROM_ROWS:
        tl.store(vectors + _DN_COLS * m + cols, dn_cols, mask=cols < m)
        tl.debug_barrier()
        de = scratch + _DE * size
        rd = tl.arange(0, BLOCK_D)
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            inside = rows < m
            dx = _product_rows(de, m, False, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                               PRECISION) \
                + _product_rows(de, m, True, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                                PRECISION)
            tl.store(DX + bh * m * D + rows[:, None] * D + rd[None, :], dx,
                     mask=inside[:, None] & (rd < D)[None, :])
            dn = tl.load(vectors + _DN_ROWS * m + rows, mask=inside, other=0.0) \
                + tl.load(vectors + _DN_COLS * m + rows, mask=inside, other=0.0)
            tl.store(DXN + bh * m + rows, -dn, mask=inside)


def _tiles(m: int, d: int) -> tuple[int, int, int, int, int]:
    """(BLOCK, BLOCK_D, ROWS, KC, warps): the matrix and the rows padded to powers of
    two (tl.dot needs >= 16), row blocks and inner chunks of 32, eight warps from
    m = 64 (compiled for sm_90 with one pipeline stage: no spills at m = 64, 16 bytes
    a thread at m = 128, 16 KiB of shared memory; four warps or more stages spill
    hundreds of bytes at m = 128; benchmarks/triton_resources.py, not timed)."""
    block = max(16, triton.next_power_of_2(m))
    tile = min(block, 32)
    return block, max(16, triton.next_power_of_2(d)), tile, tile, (8 if block >= 64 else 4)


def lemma3_backward(source: Tensor, norm: Tensor | None, ridge: Tensor, store: Tensor,
                    grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``triton_lemma3.lemma3_forward``'s inputs for the incoming
    gradient ``grad: [BH, m, m]`` of W, from its ``store`` of iterates: (dM, None) for
    a landmark matrix ``source: [BH, m, m]``, (dX, dnorm) for landmark rows
    ``source: [BH, m, D]`` with half squared norms ``norm: [BH, m]``. Scratch:
    ``SLOTS`` m x m matrices a program."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    block, block_d, rows, chunk, warps = _tiles(m, d)
    dsource = torch.empty_like(source)
    dnorm = None if norm is None else torch.empty_like(norm)
    scratch = source.new_empty(bh, SLOTS.value, m, m)
    vectors = source.new_empty(bh, VECTORS.value, m)
    _backward_kernel[(bh,)](
        source, source, source if norm is None else norm, ridge, store, grad, dsource,
        dsource, dsource if dnorm is None else dnorm, scratch, vectors, m, d,
        bh // ridge.shape[0], ITERATIONS=store.shape[1], FROM_ROWS=norm is not None,
        TINY=torch.finfo(source.dtype).tiny, BLOCK=block, BLOCK_D=block_d, ROWS=rows,
        KC=chunk, PRECISION=_precision(source.dtype), num_warps=warps, num_stages=1)
    return dsource, dnorm
