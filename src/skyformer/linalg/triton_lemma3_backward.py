"""The backward pass of the Lemma 3 inverse (``triton_lemma3``) in one Triton program
per matrix, its m x m matrices in scratch memory a block of rows at a time
(``triton_rowblocks``).

The adjoint keeps about a dozen m x m matrices alive: held in registers they need more
than an SM has at m = 128 (compiled for sm_90: 256 KiB of shared memory, so the kernel
cannot launch, and 7 KB of spills a thread) and spill 3.6 KB a thread at m = 64. In
scratch (``SLOTS`` slots a program, 64 KiB each at m = 128) the kernel needs 16 KiB of
shared memory and spills nothing. The gradient of V and dA alternate
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
two passes. Where the forward kernel kept P, T2, T3 (``KEEP``), passes 1-3 read them
and form only dT3, M2 and dP: 8 products a step instead of 11. Every pass computes any
block of rows from what earlier passes wrote (the sums over columns, ds and dn, read
the transposed rows instead of adding across row blocks), so the chain runs in one
program per matrix or as a launch per pass (``triton_lemma3.launch``). Before them:
M_r, d = M_r 1, s = d^-1/2, A and G = S dW S; after them, ds (from dW V_K and dA M_r),
dM = S dA S + dd 1^T and, from the landmark rows, dE = dM * C(X, X), dX = (dE + dE^T) X
and dn = -(dE 1 + dE^T 1).

The implicit gradient (``IMPLICIT``, ``implicit_inverse``) replaces the steps' adjoints
by two passes, H = V_K^T G and dA = -H V_K^T, V_K read from the forward kernel's last
two iterates (``triton_lemma3.iterate``); nothing else changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .graph_launches import graph_launches_on
from .launch_grid import tile_width
from .triton_kernels import _precision
from .triton_lemma3 import (
    device_family,
    iterate,
    launch,
    launch_options,
    regularise_rows,
    scaled_rows,
    store_slots,
    stored,
    t2_rows,
    t3_rows,
)
from .triton_rowblocks import eye_rows, product_rows, rows_of, square_rows, store_rows, tile

# Scratch slots of one matrix (each m x m) and vectors (each m); the step products P,
# T2, T3 come last: where the forward kernel kept them (``KEEP``), the backward kernel
# reads them from the store and its scratch ends before them (``KEPT_SLOTS``).
# (Constants the kernel reads must be tl.constexpr.)
SLOTS, KEPT_SLOTS = tl.constexpr(12), tl.constexpr(9)
_MR, _A, _G, _DA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)  # G, dA: 2
_DT3, _M2, _DP = tl.constexpr(6), tl.constexpr(7), tl.constexpr(8)
_P, _T2, _T3 = tl.constexpr(9), tl.constexpr(10), tl.constexpr(11)
_DE = _DT3  # dE reuses dT3's slot once the steps are done
VECTORS = tl.constexpr(4)
_D, _S, _DS, _DN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)

# The backward passes (``backward_passes``: their order), each computing the rows it is
# given of one matrix from what earlier passes wrote.
REGULARISE, NORMALISE, START = (tl.constexpr(i) for i in range(3))
ADJ_P, ADJ_T2, ADJ_T3, ADJ_UPDATE = (tl.constexpr(i) for i in range(3, 7))
FIRST_T2, FIRST_DA, SCALE_DS, DM_ROWS, DX_ROWS = (tl.constexpr(i) for i in range(7, 12))
IMPLICIT_H, IMPLICIT_DA = tl.constexpr(12), tl.constexpr(13)


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
def _transposed_rows(P, rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of P^T for the m x m matrix P."""
    return tile(P, m, rows, tl.arange(0, BLOCK), m, m, True)


@triton.jit
def backward_pass(PASS: tl.constexpr, step, rows, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN,
                  SCR, VEC, m, D, heads, ITERATIONS: tl.constexpr, KEEP: tl.constexpr,
                  IMPLICIT: tl.constexpr, FROM_ROWS: tl.constexpr, TINY: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                  KC: tl.constexpr, PRECISION: tl.constexpr):
    """Rows ``rows`` of pass ``PASS`` for matrix ``bh`` (the step passes: of the
    adjoint of step ITERATIONS - ``step``); the step products are read from the store
    where the forward kernel kept them (``KEEP``), else formed again into scratch;
    ``IMPLICIT``: the store holds the forward's last two iterates alone."""
    size = m * m
    slots: tl.constexpr = KEPT_SLOTS if KEEP or IMPLICIT else SLOTS
    scratch = SCR + bh * slots * size
    vectors = VEC + bh * VECTORS * m
    mat_r, a = scratch + _MR * size, scratch + _A * size
    s_vec = vectors + _S * m
    inside = rows < m
    if IMPLICIT:
        v_last = iterate(STORE, bh, ITERATIONS, size, ITERATIONS, False, True)
    else:
        v_last = stored(STORE, bh, ITERATIONS - 1, size, ITERATIONS, KEEP)
    if PASS == REGULARISE:
        regularise_rows(M, X, XN, DIAG, mat_r, vectors + _D * m, s_vec, bh, rows, m, D,
                        heads, FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)
    elif PASS == NORMALISE:  # A = S M_r S
        store_rows(a, rows, m, scaled_rows(mat_r, s_vec, rows, m, BLOCK), BLOCK)
    elif PASS == START:  # the gradient of V_K in the normalised frame, S dW S; dA = 0
        g_rows = scaled_rows(G + bh * size, s_vec, rows, m, BLOCK)
        store_rows(scratch + _G * size, rows, m, g_rows, BLOCK)
        if not IMPLICIT:
            store_rows(scratch + _DA * size, rows, m, tl.zeros_like(g_rows), BLOCK)
    elif PASS == IMPLICIT_H:  # H = V_K^T G
        store_rows(scratch + _DT3 * size, rows, m,
                   square_rows(v_last, True, scratch + _G * size, False, rows, m, ROWS, BLOCK,
                               KC, PRECISION), BLOCK)
    elif PASS == IMPLICIT_DA:  # dA = -H V_K^T, where SCALE_DS and DM_ROWS read it
        store_rows(scratch + (_DA + ITERATIONS % 2) * size, rows, m,
                   -square_rows(scratch + _DT3 * size, False, v_last, True, rows, m, ROWS,
                                BLOCK, KC, PRECISION), BLOCK)
    elif PASS == FIRST_T2:  # step 1 from V_0 = I: P = A, M2 = A^T dT3, dT3 = G / 4
        g_in = scratch + (_G + (ITERATIONS - 1) % 2) * size
        m2 = scratch + _M2 * size
        if not KEEP:
            store_rows(scratch + _T2 * size, rows, m,
                       t2_rows(a, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
        store_rows(m2, rows, m, 0.25 * square_rows(a, True, g_in, False, rows, m, ROWS,
                                                   BLOCK, KC, PRECISION), BLOCK)
    elif PASS == FIRST_DA:  # the final dA
        g_in = scratch + (_G + (ITERATIONS - 1) % 2) * size
        da_in = scratch + (_DA + (ITERATIONS - 1) % 2) * size
        if KEEP:
            t2 = stored(STORE, bh, 4 * ITERATIONS - 3, size, ITERATIONS, KEEP)
        else:
            t2 = scratch + _T2 * size
        m2 = scratch + _M2 * size
        store_rows(scratch + (_DA + ITERATIONS % 2) * size, rows, m,
                   rows_of(da_in, rows, m, BLOCK)
                   + _dp_rows(m2, a, g_in, 0.25, t2, rows, m, ROWS, BLOCK, KC, PRECISION),
                   BLOCK)
    elif PASS == SCALE_DS:
        # ds_i = sum_j (B_ij + B_ji) s_j, B = dW * V_K + dA * M_r
        da = scratch + (_DA + ITERATIONS % 2) * size
        grad = G + bh * size
        both = rows_of(grad, rows, m, BLOCK) * rows_of(v_last, rows, m, BLOCK) \
            + rows_of(da, rows, m, BLOCK) * rows_of(mat_r, rows, m, BLOCK) \
            + _transposed_rows(grad, rows, m, BLOCK) * _transposed_rows(v_last, rows, m, BLOCK) \
            + _transposed_rows(da, rows, m, BLOCK) * _transposed_rows(mat_r, rows, m, BLOCK)
        cols = tl.arange(0, BLOCK)
        s_cols = tl.load(s_vec + cols, mask=cols < m, other=0.0)
        tl.store(vectors + _DS * m + rows, tl.sum(both * s_cols[None, :], axis=1), mask=inside)
    elif PASS == DM_ROWS:  # dM = S dA S + dd 1^T, dd = -ds s^3 / 2 where d > tiny
        da = scratch + (_DA + ITERATIONS % 2) * size
        s_rows = tl.load(s_vec + rows, mask=inside, other=0.0)
        d_rows = tl.load(vectors + _D * m + rows, mask=inside, other=0.0)
        ds = tl.load(vectors + _DS * m + rows, mask=inside, other=0.0)
        dd = tl.where(inside & (d_rows > TINY), -0.5 * ds * s_rows * s_rows * s_rows, 0.0)
        dm = scaled_rows(da, s_vec, rows, m, BLOCK) + dd[:, None]
        if FROM_ROWS:  # E_ij = x_i . x_j - n_i - n_j, dE = dM * C
            cols = tl.arange(0, BLOCK)
            ridge = tl.load(DIAG + (bh // heads) * m + cols, mask=cols < m, other=0.0)
            block = rows_of(mat_r, rows, m, BLOCK) - eye_rows(rows, m, BLOCK) * ridge[None, :]
            de = dm * block
            store_rows(scratch + _DE * size, rows, m, de, BLOCK)
            tl.store(vectors + _DN * m + rows, tl.sum(de, axis=1), mask=inside)
        else:
            store_rows(DM + bh * size, rows, m, dm, BLOCK)
    elif PASS == DX_ROWS:  # dX = (dE + dE^T) X, dn = -(dE 1 + dE^T 1)
        de = scratch + _DE * size
        xb = X + bh * m * D
        rd = tl.arange(0, BLOCK_D)
        dx = product_rows(de, m, False, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                          PRECISION) \
            + product_rows(de, m, True, xb, D, False, rows, m, m, D, ROWS, BLOCK_D, KC,
                           PRECISION)
        tl.store(DX + bh * m * D + rows[:, None] * D + rd[None, :], dx,
                 mask=inside[:, None] & (rd < D)[None, :])
        dn = tl.load(vectors + _DN * m + rows, mask=inside, other=0.0) \
            + tl.sum(_transposed_rows(de, rows, m, BLOCK), axis=1)
        tl.store(DXN + bh * m + rows, -dn, mask=inside)
    else:  # the adjoint of step ITERATIONS - j, whose input iterate V is stored; G and
        # dA alternate between two slots each
        j = step
        v = stored(STORE, bh, ITERATIONS - 2 - j, size, ITERATIONS, KEEP)
        if KEEP:  # the forward's products of its step ITERATIONS - 1 - j
            p = stored(STORE, bh, ITERATIONS + 3 * (ITERATIONS - 2 - j), size, ITERATIONS,
                       KEEP)
            t2, t3 = p + size, p + 2 * size
        else:
            p, t2, t3 = scratch + _P * size, scratch + _T2 * size, scratch + _T3 * size
        a, dt3 = scratch + _A * size, scratch + _DT3 * size
        m2, dp = scratch + _M2 * size, scratch + _DP * size
        g_in = scratch + (_G + j % 2) * size
        if PASS == ADJ_P:  # P = A V, dT3 = V^T G / 4
            if not KEEP:
                store_rows(p, rows, m, square_rows(a, False, v, False, rows, m, ROWS, BLOCK,
                                                   KC, PRECISION), BLOCK)
            store_rows(dt3, rows, m, 0.25 * square_rows(v, True, g_in, False, rows, m, ROWS,
                                                        BLOCK, KC, PRECISION), BLOCK)
        elif PASS == ADJ_T2:  # T2, M2 = P^T dT3
            if not KEEP:
                store_rows(t2, rows, m, t2_rows(p, rows, m, ROWS, BLOCK, KC, PRECISION),
                           BLOCK)
            store_rows(m2, rows, m, square_rows(p, True, dt3, False, rows, m, ROWS, BLOCK, KC,
                                                PRECISION), BLOCK)
        elif PASS == ADJ_T3:  # T3, dP
            if not KEEP:
                store_rows(t3, rows, m, t3_rows(p, t2, rows, m, ROWS, BLOCK, KC, PRECISION),
                           BLOCK)
            store_rows(dp, rows, m, _dp_rows(m2, p, dt3, 1.0, t2, rows, m, ROWS, BLOCK, KC,
                                             PRECISION), BLOCK)
        else:  # ADJ_UPDATE: dA' = dA + dP V^T, G' = G T3^T / 4 + A^T dP
            da_in = scratch + (_DA + j % 2) * size
            store_rows(scratch + (_DA + 1 - j % 2) * size, rows, m, rows_of(da_in, rows, m, BLOCK)
                       + square_rows(dp, False, v, True, rows, m, ROWS, BLOCK, KC, PRECISION),
                       BLOCK)
            store_rows(scratch + (_G + 1 - j % 2) * size, rows, m,
                       0.25 * square_rows(g_in, False, t3, True, rows, m, ROWS, BLOCK, KC,
                                          PRECISION)
                       + square_rows(a, True, dp, False, rows, m, ROWS, BLOCK, KC, PRECISION),
                       BLOCK)


@triton.jit
def _all_rows(PASS: tl.constexpr, step, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC,
              m, D, heads, ITERATIONS: tl.constexpr, KEEP: tl.constexpr,
              IMPLICIT: tl.constexpr, FROM_ROWS: tl.constexpr,
              TINY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
              ROWS: tl.constexpr, KC: tl.constexpr, PRECISION: tl.constexpr):
    """Pass ``PASS`` over every block of rows, then a barrier."""
    for start in range(0, m, ROWS):
        backward_pass(PASS, step, start + tl.arange(0, ROWS), bh, M, X, XN, DIAG, STORE, G,
                      DM, DX, DXN, SCR, VEC, m, D, heads, ITERATIONS, KEEP, IMPLICIT,
                      FROM_ROWS, TINY, BLOCK, BLOCK_D, ROWS, KC, PRECISION)
    tl.debug_barrier()


@triton.jit
def _backward_kernel(M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D, heads,
                     ITERATIONS: tl.constexpr, KEEP: tl.constexpr, IMPLICIT: tl.constexpr,
                     FROM_ROWS: tl.constexpr, TINY: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                     KC: tl.constexpr, PRECISION: tl.constexpr):
    """Every pass of ``backward_passes`` for matrix program_id(0), in order."""
    bh = tl.program_id(0).to(tl.int64)
    for kind in tl.static_range(REGULARISE, ADJ_P):  # the passes in their numbering's order
        if kind != NORMALISE or not IMPLICIT:  # the implicit gradient never reads A
            _all_rows(kind, 0, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D,
                      heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS, TINY, BLOCK, BLOCK_D,
                      ROWS, KC, PRECISION)
    if IMPLICIT:
        for kind in tl.static_range(IMPLICIT_H, IMPLICIT_DA + 1):
            _all_rows(kind, 0, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D,
                      heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS, TINY, BLOCK, BLOCK_D,
                      ROWS, KC, PRECISION)
    else:
        for j in range(0, ITERATIONS - 1):  # the adjoints of steps K, ..., 2
            for kind in tl.static_range(ADJ_P, FIRST_T2):
                _all_rows(kind, j, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D,
                          heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS, TINY, BLOCK, BLOCK_D,
                          ROWS, KC, PRECISION)
        for kind in tl.static_range(FIRST_T2, SCALE_DS):
            _all_rows(kind, 0, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D,
                      heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS, TINY, BLOCK, BLOCK_D,
                      ROWS, KC, PRECISION)
    for kind in tl.static_range(SCALE_DS, DX_ROWS + 1):
        if kind != DX_ROWS or FROM_ROWS:
            _all_rows(kind, 0, bh, M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D,
                      heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS, TINY, BLOCK, BLOCK_D,
                      ROWS, KC, PRECISION)


@triton.jit(do_not_specialize=["step"])
def _backward_pass_kernel(M, X, XN, DIAG, STORE, G, DM, DX, DXN, SCR, VEC, m, D, heads, step,
                          PASS: tl.constexpr, ITERATIONS: tl.constexpr, KEEP: tl.constexpr,
                          IMPLICIT: tl.constexpr, FROM_ROWS: tl.constexpr,
                          TINY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROWS: tl.constexpr, KC: tl.constexpr, PRECISION: tl.constexpr):
    """One pass: rows block program_id(1) of matrix program_id(0)."""
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    backward_pass(PASS, step, rows, tl.program_id(0).to(tl.int64), M, X, XN, DIAG, STORE, G,
                  DM, DX, DXN, SCR, VEC, m, D, heads, ITERATIONS, KEEP, IMPLICIT, FROM_ROWS,
                  TINY, BLOCK, BLOCK_D, ROWS, KC, PRECISION)


def backward_passes(iterations: int, from_rows: bool, implicit: bool = False
                    ) -> list[tuple[int, int]]:
    """(pass, step) of the backward chain in order, as ``_backward_kernel`` runs them."""
    if implicit:
        middle = [(REGULARISE.value, 0), (START.value, 0), (IMPLICIT_H.value, 0),
                  (IMPLICIT_DA.value, 0)]
    else:
        middle = [(kind, 0) for kind in range(REGULARISE, ADJ_P)] \
            + [(kind, j) for j in range(iterations - 1) for kind in range(ADJ_P, FIRST_T2)] \
            + [(kind, 0) for kind in range(FIRST_T2, SCALE_DS)]
    return middle + [(kind, 0) for kind in range(SCALE_DS, DX_ROWS + from_rows)]


def lemma3_backward(source: Tensor, norm: Tensor | None, ridge: Tensor, store: Tensor,
                    grad: Tensor, iterations: int, implicit: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``triton_lemma3.lemma3_forward``'s inputs for the incoming
    gradient ``grad: [BH, m, m]`` of W, from its ``store`` of iterates (and step
    products, if it kept them: ``store_slots``; ``implicit``: the latest two iterates,
    differentiated as an inverse): (dM, None) for a landmark matrix
    ``source: [BH, m, m]``, (dX, dnorm) for landmark rows ``source: [BH, m, D]`` with
    half squared norms ``norm: [BH, m]``. Scratch: ``SLOTS`` m x m matrices a program
    (``KEPT_SLOTS`` where the products were kept, or for the implicit gradient)."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    expected = [store_slots(iterations, False, backward=False)] if implicit else \
        [store_slots(iterations, False), store_slots(iterations, True)]
    if store.shape[1] not in expected:
        raise ValueError(f"a store of {store.shape[1]} matrices for {iterations} iterations"
                         f"{' (implicit gradient)' if implicit else ''}: lemma3_forward "
                         f"stores {' or '.join(map(str, expected))}")
    keep = not implicit and store.shape[1] == expected[-1] != expected[0]
    dsource = torch.empty_like(source)
    dnorm = None if norm is None else torch.empty_like(norm)
    scratch = source.new_empty(bh, (KEPT_SLOTS if keep or implicit else SLOTS).value, m, m)
    vectors = source.new_empty(bh, VECTORS.value, m)
    args = (source, source, source if norm is None else norm, ridge, store, grad, dsource,
            dsource, dsource if dnorm is None else dnorm, scratch, vectors, m, d,
            bh // ridge.shape[0])
    options = {"ITERATIONS": iterations, "KEEP": keep, "IMPLICIT": implicit,
               "FROM_ROWS": norm is not None,
               "TINY": torch.finfo(source.dtype).tiny,
               "BLOCK_D": tile_width(d),
               "PRECISION": _precision(source.dtype, device=source.device),
               **launch_options(m, backward=True, graphed=graph_launches_on(),
                                family=device_family(source.device))}
    launch(_backward_kernel, _backward_pass_kernel,
           backward_passes(iterations, norm is not None, implicit), bh, m, args, options)
    return dsource, dnorm
