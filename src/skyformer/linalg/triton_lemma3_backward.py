"""The backward pass of the Lemma 3 inverse (``triton_lemma3``) in one Triton program
per matrix, its m x m matrices in scratch memory a block of rows at a time
(``triton_rowblocks``).

The adjoint keeps about a dozen m x m matrices alive: held in registers they need more
than an SM has at m = 128 (compiled for sm_90: 256 KiB of shared memory, so the kernel
cannot launch, and 7 KB of spills a thread) and spill 3.6 KB a thread at m = 64. In
scratch (``SLOTS`` slots a program, 64 KiB each at m = 128) the kernel needs 16 KiB of
shared memory and spills 24 bytes a thread at most. The gradient of V and dA alternate
between two slots each, so that no pass writes a slot it reads.

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

from .triton_kernels import _precision
from .triton_lemma3 import launch_options, normalise, regularise, t2_rows, t3_rows
from .triton_rowblocks import eye_rows, product_rows, rows_of, square_rows, store_rows

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
def _dp_rows(M2, P, X, x_scale, T2, rows, m, ROWS: tl.constexpr, BLOCK: tl.constexpr,
             KC: tl.constexpr, PRECISION: tl.constexpr):
    """Rows of a step's dP = 7 M2 - M2 P^T - P^T M2 - dT3 T2^T, dT3 = x_scale X
    (M2 T1^T = 7 M2 - M2 P^T)."""
    return 7.0 * rows_of(M2, rows, m, BLOCK) \
        - square_rows(M2, False, P, True, rows, m, ROWS, BLOCK, KC, PRECISION) \
        - square_rows(P, True, M2, False, rows, m, ROWS, BLOCK, KC, PRECISION) \
        - x_scale * square_rows(X, False, T2, True, rows, m, ROWS, BLOCK, KC, PRECISION)


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

    regularise(M, X, XN, ridge, mat_r, vectors + _D * m, vectors + _S * m, bh, m, D,
               FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)
    normalise(mat_r, vectors + _S * m, a, m, BLOCK, ROWS)
    # the gradient of V_K in the normalised frame, S dW S; dA = 0
    s_cols = tl.load(vectors + _S * m + cols, mask=cols < m, other=0.0)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(vectors + _S * m + rows, mask=rows < m, other=0.0)
        g_rows = s_rows[:, None] * rows_of(grad, rows, m, BLOCK) * s_cols[None, :]
        store_rows(scratch + _G * size, rows, m, g_rows, BLOCK)
        store_rows(scratch + _DA * size, rows, m, tl.zeros_like(g_rows), BLOCK)
    tl.debug_barrier()

    for j in range(0, ITERATIONS - 1):  # steps K, ..., 2; V = V_{i-1} of step i
        v = STORE + (bh * ITERATIONS + ITERATIONS - 2 - j) * size
        g_in = scratch + (_G + j % 2) * size
        g_out = scratch + (_G + 1 - j % 2) * size
        da_in = scratch + (_DA + j % 2) * size
        da_out = scratch + (_DA + 1 - j % 2) * size
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(p, rows, m, square_rows(a, False, v, False, rows, m, ROWS, BLOCK,
                                                 KC, PRECISION), BLOCK)
            store_rows(dt3, rows, m, 0.25 * square_rows(v, True, g_in, False, rows, m,
                                                           ROWS, BLOCK, KC, PRECISION),
                        BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(t2, rows, m, t2_rows(p, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
            store_rows(m2, rows, m, square_rows(p, True, dt3, False, rows, m, ROWS, BLOCK,
                                                  KC, PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(t3, rows, m, t3_rows(p, t2, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
            store_rows(dp, rows, m, _dp_rows(m2, p, dt3, 1.0, t2, rows, m, ROWS, BLOCK, KC,
                                             PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(da_out, rows, m, rows_of(da_in, rows, m, BLOCK)
                        + square_rows(dp, False, v, True, rows, m, ROWS, BLOCK, KC,
                                       PRECISION), BLOCK)
            store_rows(g_out, rows, m, 0.25 * square_rows(g_in, False, t3, True, rows, m,
                                                            ROWS, BLOCK, KC, PRECISION)
                        + square_rows(a, True, dp, False, rows, m, ROWS, BLOCK, KC,
                                       PRECISION), BLOCK)
        tl.debug_barrier()

    # step 1 from V_0 = I: P = A, dT3 = G / 4
    g_in = scratch + (_G + (ITERATIONS - 1) % 2) * size
    da_in = scratch + (_DA + (ITERATIONS - 1) % 2) * size
    da = scratch + (_DA + ITERATIONS % 2) * size  # the final dA
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        store_rows(t2, rows, m, t2_rows(a, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
        store_rows(m2, rows, m, 0.25 * square_rows(a, True, g_in, False, rows, m, ROWS,
                                                     BLOCK, KC, PRECISION), BLOCK)
    tl.debug_barrier()
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        store_rows(da, rows, m, rows_of(da_in, rows, m, BLOCK) + _dp_rows(
            m2, a, g_in, 0.25, t2, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
    tl.debug_barrier()

    # ds_i = sum_j (dW V_K + dA M_r)_ij s_j + (dW V_K + dA M_r)_ji s_j
    ds_cols = tl.zeros([BLOCK], dtype=s_cols.dtype)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(vectors + _S * m + rows, mask=rows < m, other=0.0)
        both = rows_of(grad, rows, m, BLOCK) * rows_of(v_last, rows, m, BLOCK) \
            + rows_of(da, rows, m, BLOCK) * rows_of(mat_r, rows, m, BLOCK)
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
        dm = s_rows[:, None] * rows_of(da, rows, m, BLOCK) * s_cols[None, :] + dd[:, None]
        if FROM_ROWS:  # E_ij = x_i . x_j - n_i - n_j, dE = dM * C
            block = rows_of(mat_r, rows, m, BLOCK) - eye_rows(rows, m, BLOCK) * ridge[None, :]
            de = dm * block
            store_rows(scratch + _DE * size, rows, m, de, BLOCK)
            tl.store(vectors + _DN_ROWS * m + rows, tl.sum(de, axis=1), mask=inside)
            dn_cols += tl.sum(de, axis=0)
        else:
            store_rows(DM + bh * size, rows, m, dm, BLOCK)
    if FROM_ROWS:
        tl.store(vectors + _DN_COLS * m + cols, dn_cols, mask=cols < m)
        tl.debug_barrier()
        de = scratch + _DE * size
        rd = tl.arange(0, BLOCK_D)
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            inside = rows < m
            dx = product_rows(de, m, False, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                               PRECISION) \
                + product_rows(de, m, True, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                                PRECISION)
            tl.store(DX + bh * m * D + rows[:, None] * D + rd[None, :], dx,
                     mask=inside[:, None] & (rd < D)[None, :])
            dn = tl.load(vectors + _DN_ROWS * m + rows, mask=inside, other=0.0) \
                + tl.load(vectors + _DN_COLS * m + rows, mask=inside, other=0.0)
            tl.store(DXN + bh * m + rows, -dn, mask=inside)


def lemma3_backward(source: Tensor, norm: Tensor | None, ridge: Tensor, store: Tensor,
                    grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``triton_lemma3.lemma3_forward``'s inputs for the incoming
    gradient ``grad: [BH, m, m]`` of W, from its ``store`` of iterates: (dM, None) for
    a landmark matrix ``source: [BH, m, m]``, (dX, dnorm) for landmark rows
    ``source: [BH, m, D]`` with half squared norms ``norm: [BH, m]``. Scratch:
    ``SLOTS`` m x m matrices a program."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    dsource = torch.empty_like(source)
    dnorm = None if norm is None else torch.empty_like(norm)
    scratch = source.new_empty(bh, SLOTS.value, m, m)
    vectors = source.new_empty(bh, VECTORS.value, m)
    _backward_kernel[(bh,)](
        source, source, source if norm is None else norm, ridge, store, grad, dsource,
        dsource, dsource if dnorm is None else dnorm, scratch, vectors, m, d,
        bh // ridge.shape[0], ITERATIONS=store.shape[1], FROM_ROWS=norm is not None,
        TINY=torch.finfo(source.dtype).tiny, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION=_precision(source.dtype), **launch_options(m, backward=True))
    return dsource, dnorm
