"""The Lemma 3 inverse of ``nystrom.lemma3_inverse`` in one Triton program per matrix,
or in one launch a pass.

For each landmark kernel matrix M ``[m, m]`` (one per batch element and head), with
the ridge diagonal g (gamma, or 1 for slots that hold no landmark):

    M_r = M + diag(g),   d = M_r 1,   A = D^-1/2 M_r D^-1/2,
    V_1 = T3(A) / 4,     V_{k+1} = V_k T3(A V_k) / 4     (Razavi et al., ``pinv.py``),
    W = D^-1/2 V_K D^-1/2,

with T3(P) = 13I - P (15I - P (7I - P)). The eager PyTorch path spends about forty
operations on this forward and seventy backward, each a kernel launch at m = 128 that
does almost no work on a GPU; here the whole chain is one launch forward and one
backward (``triton_lemma3_backward``), m <= ``lemma3_triton.MAX_M``. Each program's
matrices live in a scratch buffer and every product runs a block of rows at a time
(``triton_rowblocks``): held in registers, five 128 x 128 float32 matrices spill
1.7 KB a thread (compiled for sm_90), and the backward pass's dozen do not fit an SM.
Per step, V its input:

    P = A V,   T2 = 15I - 7P + P P,   T3 = 13I - P T2,   V' = V T3 / 4

(P T1 = 7P - P P with T1 = 7I - P), each a pass over row blocks; the first step, from
V_0 = I, is two (T2 from A, then V_1 = T3 / 4). A pass (``forward_pass``) computes any
block of rows from what earlier passes wrote, so the chain also runs as one launch per
pass with a program per row block (``launch``, ``PER_PASS``): passes ordered by the
stream instead of a barrier, more programs per matrix.

For the implicit gradient (``CHAIN``, ``chains``), whose backward pass needs V_K = A^-1
to rounding and nothing else, the steps are scaled Newton-Schulz steps instead
(``newton_inverse.py``): with H_k = 2 alpha_k I - alpha_k^2 P_k, one pass forms
V_k+1 = V_k H_k and P_k+1 = P_k H_k side by side, the last step from P = A V_K-1; the
alphas follow from K and the dtype alone (``LOWER``, ``FLOOR``; float64 in the kernel).
K + 4 passes and 2K - 2 products of two m x m matrices (13 and 16 at K = 9).

Given the landmark rows X (scaled) and their half squared norms n instead of M
(``FROM_ROWS``), the kernel forms M_ij = exp(x_i . x_j - n_i - n_j) itself.

The forward kernel writes V_1 ... V_K (``store``, ``[BH, K, m, m]``; each V is
written there as it is computed and read back by the next step), from which the
backward kernel rebuilds P, T2, T3 of each step (or reads them: where its launch
options ask, a differentiated call keeps them in the store too, ``keeps_products``)
and runs the adjoint of ``pinv._RazaviIteration`` step by step, then the adjoints of
the normalisation:

    dV_K  = D^-1/2 G D^-1/2,
    dA    = (adjoint of the steps),
    dM    = D^-1/2 dA D^-1/2 + (dd) 1^T,
    dd_i  = -1/2 d_i^-3/2 (sum_j G_ij V_ij s_j + G_ji V_ji s_j + dA_ij M_ij s_j
                           + dA_ji M_ji s_j),     s = d^-1/2,

and, from the rows, with dE = dM * M: dX = (dE + dE^T) X and dn = -(dE 1 + dE^T 1).

Float32 products run as ``triton_kernels._mm`` (TF32 passes per PyTorch's matmul
precision); float64 is for Triton's interpreter (the tests' exact check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import triton_kernels
from .graph_launches import graph_launches_on
from .launch_grid import cdiv, tile_width
from .newton_inverse import newton_floor, newton_lower_end
from .triton_kernels import _precision
from .triton_rowblocks import eye_rows, product_rows, rows_of, square_rows, store_rows

# Scratch of the forward kernel: m x m slots and m-vectors a program.
# (Constants the kernels read must be tl.constexpr.)
FORWARD_SLOTS, KEPT_FORWARD_SLOTS = tl.constexpr(5), tl.constexpr(2)  # P, T2, T3 kept: 2
CHAIN_FORWARD_SLOTS = tl.constexpr(4)  # the Newton chain (``CHAIN``): M_r, A, two P
_MR, _A, _P, _T2, _T3 = (tl.constexpr(i) for i in range(5))
FORWARD_VECTORS = tl.constexpr(2)
_D, _S = tl.constexpr(0), tl.constexpr(1)

# The forward passes (``forward_passes``: their order), each computing the rows it is
# given of one matrix, reading only what earlier passes wrote.
REGULARISE, NORMALISE, FIRST_T2, FIRST_V = (tl.constexpr(i) for i in range(4))
STEP_P, STEP_T2, STEP_T3, STEP_V, SCALE_W = (tl.constexpr(i) for i in range(4, 9))
NEWTON_FIRST, NEWTON_PAIR, NEWTON_LAST = (tl.constexpr(i) for i in range(9, 12))


@triton.jit
def regularise_rows(M, X, XN, DIAG, MAT_R, D_VEC, S_VEC, bh, rows, m, D, heads,
                    FROM_ROWS: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, KC: tl.constexpr, PRECISION: tl.constexpr):
    """Rows ``rows`` of M_r = C + diag(ridge) into ``MAT_R``, of d = M_r 1 into
    ``D_VEC`` and of s = rsqrt(max(d, tiny)) into ``S_VEC``, where C is the landmark
    matrix M (loaded) or (``FROM_ROWS``) the Gaussian block exp(x_i . x_j - n_i - n_j)
    of the landmark rows X ``[m, D]`` with half squared norms n (+inf: a slot without a
    landmark), and the ridge is row bh // heads of ``DIAG``."""
    cols = tl.arange(0, BLOCK)
    ridge = tl.load(DIAG + (bh // heads) * m + cols, mask=cols < m, other=0.0)
    if FROM_ROWS:
        n_rows = tl.load(XN + bh * m + rows, mask=rows < m, other=float("inf"))
        n_cols = tl.load(XN + bh * m + cols, mask=cols < m, other=float("inf"))
        x = X + bh * m * D
        dots = product_rows(x, D, False, x, D, True, rows, m, D, m, ROWS, BLOCK, KC,
                            PRECISION)
        block = tl.exp(dots - n_rows[:, None] - n_cols[None, :])
    else:
        block = rows_of(M + bh * m * m, rows, m, BLOCK)
    block += eye_rows(rows, m, BLOCK) * ridge[None, :]
    store_rows(MAT_R, rows, m, block, BLOCK)
    d = tl.sum(block, axis=1)
    tl.store(D_VEC + rows, d, mask=rows < m)
    tl.store(S_VEC + rows, 1.0 / tl.sqrt(tl.maximum(d, TINY)), mask=rows < m)


@triton.jit
def scaled_rows(P, S_VEC, rows, m, BLOCK: tl.constexpr):
    """Rows ``rows`` of S P S, S = diag(``S_VEC``)."""
    cols = tl.arange(0, BLOCK)
    s_cols = tl.load(S_VEC + cols, mask=cols < m, other=0.0)
    s_rows = tl.load(S_VEC + rows, mask=rows < m, other=0.0)
    return s_rows[:, None] * rows_of(P, rows, m, BLOCK) * s_cols[None, :]


@triton.jit
def t2_rows(P, rows, m, ROWS: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr,
            PRECISION: tl.constexpr):
    """Rows of a step's T2 = 15I - P T1 = 15I - 7P + P P (T1 = 7I - P)."""
    return 15.0 * eye_rows(rows, m, BLOCK) - 7.0 * rows_of(P, rows, m, BLOCK) \
        + square_rows(P, False, P, False, rows, m, ROWS, BLOCK, KC, PRECISION)


@triton.jit
def t3_rows(P, T2, rows, m, ROWS: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr,
            PRECISION: tl.constexpr):
    """Rows of a step's T3 = 13I - P T2."""
    return 13.0 * eye_rows(rows, m, BLOCK) \
        - square_rows(P, False, T2, False, rows, m, ROWS, BLOCK, KC, PRECISION)


def store_slots(iterations: int, keep: bool, backward: bool = True) -> int:
    """m x m matrices a program stores for the backward kernel: V_1 ... V_K, and
    (``keep``) the step products too, T2 of the first step and P, T2, T3 of each later
    one (``stored``), which the backward kernel then reads instead of forming again.
    Without a ``backward`` pass to follow, the forward kernel keeps the latest two
    iterates alone (``iterate``)."""
    if not backward:
        return min(iterations, 2)
    return 4 * iterations - 2 if keep else iterations


@triton.jit
def stored(STORE, bh, index, size, ITERATIONS: tl.constexpr, KEEP: tl.constexpr):
    """Slot ``index`` of matrix bh's store (``store_slots``): V_k at k - 1; when the
    products are kept (``KEEP``), P, T2, T3 of the step from V_s to V_s+1 at
    K + 3 (s - 1) + 0, 1, 2 (1 <= s < K) and T2 of the first step at 4K - 3."""
    slots: tl.constexpr = 4 * ITERATIONS - 2 if KEEP else ITERATIONS
    return STORE + (bh * slots + index) * size


@triton.jit
def iterate(STORE, bh, k, size, ITERATIONS: tl.constexpr, KEEP: tl.constexpr,
            LAST_TWO: tl.constexpr):
    """V_k's slot in matrix bh's store (1 <= k <= ITERATIONS): k - 1 (``stored``), or
    (``LAST_TWO``: no backward pass follows) (k - 1) mod 2 of two slots. Not one slot
    with each V written over the last: a block of rows of V T3 / 4 reads only the same
    rows of V, but on a GPU a warp may store its columns of those rows while another
    warp still reads them."""
    slots: tl.constexpr = 2 if ITERATIONS > 1 else 1
    return STORE + (bh * slots + (k - 1) % 2) * size if LAST_TWO else stored(
        STORE, bh, k - 1, size, ITERATIONS, KEEP)


@triton.jit
def _chain_p(scratch, size, k):
    """P_k of the Newton chain (``CHAIN``): A for k = 0, then the slots of P and T2 in
    turn (a pass reads P_k and writes P_k+1)."""
    return scratch + (_A + (k > 0) * (1 + (k % 2 == 0))) * size


@triton.jit
def _newton_scale(LOWER: tl.constexpr, FLOOR: tl.constexpr, k):
    """alpha_k of the scaled Newton steps (``newton_inverse.newton_scales``): the
    interval's lower end from ``LOWER`` after k steps, in float64 as on the host."""
    lower = tl.full([], LOWER, tl.float64)
    for _ in range(k):
        alpha = 2.0 / (1.0 + tl.maximum(lower, FLOOR))
        lower = tl.minimum(alpha * lower * (2.0 - alpha * lower), alpha * (2.0 - alpha))
    return 2.0 / (1.0 + tl.maximum(lower, FLOOR))


@triton.jit
def _newton_rows(v, p, FROM_IDENTITY: tl.constexpr, alpha, rows, m,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Rows of V (2 alpha I - alpha^2 P) = 2 alpha V - alpha^2 V P, or (``FROM_IDENTITY``,
    V = I) of 2 alpha I - alpha^2 P."""
    p_rows = rows_of(p, rows, m, BLOCK)
    if FROM_IDENTITY:
        first, second = eye_rows(rows, m, BLOCK).to(p_rows.dtype), p_rows
    else:
        first = rows_of(v, rows, m, BLOCK)
        second = square_rows(v, False, p, False, rows, m, ROWS, BLOCK, KC, PRECISION)
    return (2.0 * alpha).to(p_rows.dtype) * first - (alpha * alpha).to(p_rows.dtype) * second


@triton.jit
def forward_pass(PASS: tl.constexpr, step, rows, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D,
                 heads, ITERATIONS: tl.constexpr, KEEP: tl.constexpr, LAST_TWO: tl.constexpr,
                 CHAIN: tl.constexpr, LOWER: tl.constexpr, FLOOR: tl.constexpr,
                 FROM_ROWS: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr,
                 ROWS: tl.constexpr, KC: tl.constexpr, PRECISION: tl.constexpr):
    """Rows ``rows`` of pass ``PASS`` for matrix ``bh`` (the step passes: of the step
    from V_step to V_step+1, 1 <= step < ITERATIONS; the chain passes: of its step
    ``step``); the step products go to the store (``KEEP``) or to the program's
    scratch, the iterates to the store (``iterate``: all of them, or the latest two)."""
    size = m * m
    slots: tl.constexpr = KEPT_FORWARD_SLOTS if KEEP else (
        CHAIN_FORWARD_SLOTS if CHAIN else FORWARD_SLOTS)
    scratch = SCR + bh * slots * size
    mat_r, a = scratch + _MR * size, scratch + _A * size
    s_vec = VEC + (bh * FORWARD_VECTORS + _S) * m
    if KEEP:
        first_t2 = stored(STORE, bh, 4 * ITERATIONS - 3, size, ITERATIONS, KEEP)
        p = stored(STORE, bh, ITERATIONS + 3 * (step - 1), size, ITERATIONS, KEEP)
        t2, t3 = p + size, p + 2 * size
    else:
        first_t2 = scratch + _T2 * size
        p, t2, t3 = scratch + _P * size, scratch + _T2 * size, scratch + _T3 * size
    if PASS == REGULARISE:
        regularise_rows(M, X, XN, DIAG, mat_r, VEC + (bh * FORWARD_VECTORS + _D) * m, s_vec,
                        bh, rows, m, D, heads, FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)
    elif PASS == NORMALISE:  # A = S M_r S
        store_rows(a, rows, m, scaled_rows(mat_r, s_vec, rows, m, BLOCK), BLOCK)
    elif PASS == FIRST_T2:  # step 1 from V_0 = I: P = A
        store_rows(first_t2, rows, m, t2_rows(a, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
    elif PASS == FIRST_V:  # V_1 = T3 / 4
        store_rows(iterate(STORE, bh, 1, size, ITERATIONS, KEEP, LAST_TWO), rows, m,
                   0.25 * t3_rows(a, first_t2, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
    elif PASS == SCALE_W:  # W = S V_K S
        v_last = iterate(STORE, bh, ITERATIONS, size, ITERATIONS, KEEP, LAST_TWO)
        store_rows(W + bh * size, rows, m, scaled_rows(v_last, s_vec, rows, m, BLOCK), BLOCK)
    elif PASS == NEWTON_FIRST:  # V_1 = H_0 = 2 alpha I - alpha^2 A, P_1 = A H_0
        alpha = _newton_scale(LOWER, FLOOR, 0)
        store_rows(iterate(STORE, bh, 1, size, ITERATIONS, KEEP, LAST_TWO), rows, m,
                   _newton_rows(a, a, True, alpha, rows, m, ROWS, BLOCK, KC, PRECISION),
                   BLOCK)
        if ITERATIONS > 2:  # P_1 for step 1 (the last step forms its own P from A)
            store_rows(_chain_p(scratch, size, 1), rows, m,
                       _newton_rows(a, a, False, alpha, rows, m, ROWS, BLOCK, KC, PRECISION),
                       BLOCK)
    elif PASS == NEWTON_PAIR:  # V_k+1 = V_k H_k and P_k+1 = P_k H_k, side by side
        alpha = _newton_scale(LOWER, FLOOR, step)
        p_k = _chain_p(scratch, size, step)
        v_k = iterate(STORE, bh, step, size, ITERATIONS, KEEP, LAST_TWO)
        store_rows(iterate(STORE, bh, step + 1, size, ITERATIONS, KEEP, LAST_TWO), rows, m,
                   _newton_rows(v_k, p_k, False, alpha, rows, m, ROWS, BLOCK, KC, PRECISION),
                   BLOCK)
        if step < ITERATIONS - 2:
            store_rows(_chain_p(scratch, size, step + 1), rows, m,
                       _newton_rows(p_k, p_k, False, alpha, rows, m, ROWS, BLOCK, KC,
                                    PRECISION), BLOCK)
    elif PASS == NEWTON_LAST:  # V_K = V_K-1 (2 alpha I - alpha^2 P), P = A V_K-1 (STEP_P)
        v_k = iterate(STORE, bh, step, size, ITERATIONS, KEEP, LAST_TWO)
        store_rows(iterate(STORE, bh, step + 1, size, ITERATIONS, KEEP, LAST_TWO), rows, m,
                   _newton_rows(v_k, p, False, _newton_scale(LOWER, FLOOR, step), rows, m, ROWS,
                                BLOCK, KC, PRECISION), BLOCK)
    else:
        v = iterate(STORE, bh, step, size, ITERATIONS, KEEP, LAST_TWO)
        if PASS == STEP_P:
            value = square_rows(a, False, v, False, rows, m, ROWS, BLOCK, KC, PRECISION)
            store_rows(p, rows, m, value, BLOCK)
        elif PASS == STEP_T2:
            store_rows(t2, rows, m, t2_rows(p, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
        elif PASS == STEP_T3:
            store_rows(t3, rows, m, t3_rows(p, t2, rows, m, ROWS, BLOCK, KC, PRECISION),
                       BLOCK)
        else:  # STEP_V: V' = V T3 / 4
            value = square_rows(v, False, t3, False, rows, m, ROWS, BLOCK, KC, PRECISION)
            store_rows(iterate(STORE, bh, step + 1, size, ITERATIONS, KEEP, LAST_TWO), rows,
                       m, 0.25 * value, BLOCK)


@triton.jit
def _all_rows(PASS: tl.constexpr, step, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
              ITERATIONS: tl.constexpr, KEEP: tl.constexpr, LAST_TWO: tl.constexpr,
              CHAIN: tl.constexpr, LOWER: tl.constexpr, FLOOR: tl.constexpr,
              FROM_ROWS: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
              KC: tl.constexpr, PRECISION: tl.constexpr):
    """Pass ``PASS`` over every block of rows, then a barrier."""
    for start in range(0, m, ROWS):
        forward_pass(PASS, step, start + tl.arange(0, ROWS), bh, M, X, XN, DIAG, W, STORE,
                     SCR, VEC, m, D, heads, ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR,
                     FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)
    tl.debug_barrier()


@triton.jit
def _forward_kernel(M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads, ITERATIONS: tl.constexpr,
                    KEEP: tl.constexpr, LAST_TWO: tl.constexpr, CHAIN: tl.constexpr,
                    LOWER: tl.constexpr, FLOOR: tl.constexpr, FROM_ROWS: tl.constexpr,
                    TINY: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, KC: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Every pass of ``forward_passes`` for matrix program_id(0), in order."""
    bh = tl.program_id(0).to(tl.int64)
    for kind in tl.static_range(REGULARISE, FIRST_T2):
        _all_rows(kind, 0, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
                  ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK, ROWS, KC,
                  PRECISION)
    if CHAIN:  # scaled Newton steps, paired; the last from A (newton_inverse.py)
        _all_rows(NEWTON_FIRST, 0, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
                  ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK, ROWS, KC,
                  PRECISION)
        for k in range(1, ITERATIONS - 1):
            _all_rows(NEWTON_PAIR, k, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
                      ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK, ROWS,
                      KC, PRECISION)
        if ITERATIONS > 1:
            for kind in tl.static_range(STEP_P, STEP_T2):
                _all_rows(kind, ITERATIONS - 1, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m,
                          D, heads, ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS,
                          TINY, BLOCK, ROWS, KC, PRECISION)
            _all_rows(NEWTON_LAST, ITERATIONS - 1, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m,
                      D, heads, ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY,
                      BLOCK, ROWS, KC, PRECISION)
    else:
        for kind in tl.static_range(FIRST_T2, STEP_P):
            _all_rows(kind, 0, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads, ITERATIONS,
                      KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK, ROWS, KC,
                      PRECISION)
        for step in range(1, ITERATIONS):
            for kind in tl.static_range(STEP_P, SCALE_W):
                _all_rows(kind, step, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
                          ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK,
                          ROWS, KC, PRECISION)
    _all_rows(SCALE_W, 0, bh, M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads, ITERATIONS, KEEP,
              LAST_TWO, CHAIN, LOWER, FLOOR, FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)


@triton.jit(do_not_specialize=["step"])
def _forward_pass_kernel(M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads, step,
                         PASS: tl.constexpr, ITERATIONS: tl.constexpr, KEEP: tl.constexpr,
                         LAST_TWO: tl.constexpr, CHAIN: tl.constexpr,
                         LOWER: tl.constexpr, FLOOR: tl.constexpr, FROM_ROWS: tl.constexpr,
                         TINY: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         KC: tl.constexpr, PRECISION: tl.constexpr):
    """One pass: rows block program_id(1) of matrix program_id(0)."""
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    forward_pass(PASS, step, rows, tl.program_id(0).to(tl.int64), M, X, XN, DIAG, W,
                 STORE, SCR, VEC, m, D, heads, ITERATIONS, KEEP, LAST_TWO, CHAIN, LOWER, FLOOR,
                 FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)


def forward_passes(iterations: int, chain: bool = False) -> list[tuple[int, int]]:
    """(pass, step) of the forward chain in order, as ``_forward_kernel`` runs them;
    ``chain``: the scaled Newton steps (``chains``), paired, the last from A."""
    start = [(kind, 0) for kind in range(REGULARISE, FIRST_T2)]
    if chain:
        steps = [(NEWTON_FIRST.value, 0)] \
            + [(NEWTON_PAIR.value, k) for k in range(1, iterations - 1)]
        if iterations > 1:
            steps += [(STEP_P.value, iterations - 1), (NEWTON_LAST.value, iterations - 1)]
        return start + steps + [(SCALE_W.value, 0)]
    steps = [(kind, step) for step in range(1, iterations) for kind in range(STEP_P, SCALE_W)]
    return start + [(kind, 0) for kind in range(FIRST_T2, STEP_P)] + steps \
        + [(SCALE_W.value, 0)]


def chains(iterations: int, implicit: bool) -> bool:
    """Whether the forward kernel runs the scaled Newton chain (``newton_inverse.py``)
    instead of Razavi's steps: for the implicit gradient, whose backward pass needs
    V_K = A^-1 to rounding and nothing else, so that the chain is free; at m = 128,
    9 steps, 13 passes and 16 products of two m x m matrices against the 24 passes and
    37 products of Razavi's steps paired, and the 37 passes of their ordinary chain.
    The unrolled gradient keeps the authors' steps."""
    return implicit and iterations >= 1


def launch(program_kernel, pass_kernel, passes: list[tuple[int, int]], bh: int, m: int,
           args: tuple, options: dict) -> None:
    """The chain of ``passes`` for ``bh`` matrices: all of it in one program per matrix
    (``program_kernel``, a barrier between passes), or (``options["PER_PASS"]``) one
    launch of ``pass_kernel`` per pass, a program per block of ``ROWS`` rows of each
    matrix: more programs on the GPU (the row blocks of a pass are independent) for a
    launch per pass (the stream orders them)."""
    options = dict(options)
    options.pop("KEEP_PRODUCTS", None)  # read by the forward call (``keeps_products``)
    if not options.pop("PER_PASS", False):
        program_kernel[(bh,)](*args, **options)
        return
    grid = (bh, cdiv(m, options["ROWS"]))
    for kind, step in passes:
        pass_kernel[grid](*args, step, PASS=kind, **options)


# (kernel, GPU family) -> the least padded m at which the one-program Lemma 3 kernel
# takes inner chunks of 16 (``KC``). Compiled for sm_80 (Triton 3.9, bfloat16 inputs,
# D = 64), sm_90's options spilled 72 bytes a thread in the forward kernel at m = 64,
# 24 in the backward at m = 128 and, for the implicit gradient, 40 in the backward at
# m = 64; with 16 none of the eight kernels (forward, backward; unrolled, implicit;
# m = 64, 128) spills, and as many or more warps fit an SM (sm_120 alike). sm_75 (no
# MMA): the backward spilled 80 bytes at m = 128 and spills nothing with 16 there
# (either gradient); with 16 the implicit backward would spill 24 bytes at m = 64 and
# the forward 16 at m = 128, so those keep 32. The launches a CUDA graph replays spill on
# neither family. Not timed: docs/gpu-record.md, "Tiles and precision before Hopper".
FAMILY_KC = {("forward", "mma_sync"): 64, ("backward", "mma_sync"): 64,
             ("backward", "fma"): 128}


def launch_options(m: int, backward: bool = False, graphed: bool = False,
                   family: str = "default") -> dict:
    """Tiles and warps of the forward (or ``backward``) Lemma 3 kernel: the matrix padded
    to a power of two (``BLOCK``, tl.dot needs >= 16), row blocks and inner chunks of 32
    (``ROWS``, ``KC``: a [32, 128] float32 accumulator), eight warps from m = 64, one
    pipeline stage, the whole chain in one program per matrix (``PER_PASS`` False; see
    ``launch``). Chosen from the compiled kernels' resources (sm_90: no spills,
    16 KiB of shared memory at m = 128; four warps or more stages
    spill hundreds of bytes a thread there; benchmarks/triton_resources.py), and timed
    against the alternatives that compile cleanly (``benchmarks/lemma3_tiles.py``, H200,
    m = 128): the fastest for both kernels, the others up to 1.4x slower (64-row blocks
    with warpgroup MMA too: the kernels wait on their chain of passes, not on MMAs).
    ``graphed`` (inside ``cuda_graph_launches()``, ``graph_launches.py``): a launch per
    pass, 16-row blocks and four warps forward, 32-row blocks backward, the step
    products kept (``KEEP_PRODUCTS``): the fastest options replayed from a CUDA graph
    on an H100 (``lemma3_tiles_h100.txt``, m = 128; no spills on sm_90).
    ``KEEP_PRODUCTS`` (backward): whether the forward kernel keeps the step products
    for the backward kernel (``keeps_products``); eagerly not, for the memory.
    ``family``: ``triton_kernels.dot_family`` of the GPU (``device_family``); where
    sm_90's options spilled, inner chunks of 16 from the m that ``FAMILY_KC`` names."""
    block = tile_width(m)
    tile = min(block, 32)
    options = {"BLOCK": block, "ROWS": tile, "KC": tile, "num_warps": 8 if block >= 64 else 4,
               "num_stages": 1, "PER_PASS": graphed}
    least = FAMILY_KC.get(("backward" if backward else "forward", family))
    if not graphed and least is not None and block >= least:
        options["KC"] = 16
    if backward:
        return {**options, "KEEP_PRODUCTS": graphed}
    return {**options, "ROWS": 16, "KC": 16, "num_warps": 4} if graphed else options


def device_family(device: torch.device) -> str:
    """``triton_kernels.dot_family`` of ``device`` (read through the module, which tests
    and ``benchmarks/triton_resources.py`` patch)."""
    return triton_kernels.dot_family(triton_kernels.device_capability(device))


def keeps_products(m: int, graphed: bool = False) -> bool:
    """Whether a differentiated forward call stores the step products P, T2, T3 beside
    the iterates (``store_slots``), as the backward kernel's launch options ask
    (``KEEP_PRODUCTS``): the backward kernel then multiplies 8 pairs of m x m matrices a
    step instead of 11 (at 6 iterations 44 instead of 60 in all, 27 % fewer; the
    forward kernel's 22 are unchanged), for 16 more m x m float32 matrices a matrix held
    from the forward to the backward pass (64 MiB at B x H = 64, m = 128, beside the
    iterates' 24; the backward kernel's scratch shrinks by 3 of its 12)."""
    return bool(launch_options(m, backward=True, graphed=graphed).get("KEEP_PRODUCTS",
                                                                       False))


def lemma3_forward(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int,
                   keep: bool = False, backward: bool = True, implicit: bool = False
                   ) -> tuple[Tensor, Tensor]:
    """(W ``[BH, m, m]``, store ``[BH, store_slots(iterations, keep, backward), m, m]``)
    for ``ridge: [R, m]`` (the diagonal added to the matrices of batch element
    bh // (BH / R)) and either the landmark matrix ``source: [BH, m, m]`` (``norm`` None)
    or the landmark rows ``source: [BH, m, D]`` with their half squared norms
    ``norm: [BH, m]``; the store holds the iterates and (``keep``) the step products,
    or without a ``backward`` pass to follow the latest two iterates alone, as for the
    ``implicit`` gradient, whose forward runs the scaled Newton chain (``chains``).
    Scratch: ``FORWARD_SLOTS`` m x m matrices a program (``KEPT_FORWARD_SLOTS`` when
    keeping, ``CHAIN_FORWARD_SLOTS`` for the Newton chain)."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    keep = keep and backward
    chain = chains(iterations, implicit)
    if chain and backward:
        raise ValueError("the Newton chain keeps the latest two iterates alone: the implicit "
                         "gradient's forward call takes backward=False")
    slots = KEPT_FORWARD_SLOTS if keep else CHAIN_FORWARD_SLOTS if chain else FORWARD_SLOTS
    w = source.new_empty(bh, m, m)
    store = source.new_empty(bh, store_slots(iterations, keep, backward), m, m)
    scratch = source.new_empty(bh, slots.value, m, m)
    vectors = source.new_empty(bh, FORWARD_VECTORS.value, m)
    args = (source, source, source if norm is None else norm, ridge, w, store, scratch,
            vectors, m, d, bh // ridge.shape[0])
    options = {"ITERATIONS": iterations, "KEEP": keep, "LAST_TWO": not backward,
               "CHAIN": chain, "FROM_ROWS": norm is not None,
               "LOWER": newton_lower_end(iterations, source.dtype) if chain else 0.0,
               "FLOOR": newton_floor(source.dtype),
               "TINY": torch.finfo(source.dtype).tiny,
               "PRECISION": _precision(source.dtype, device=source.device),
               **launch_options(m, graphed=graph_launches_on(),
                                family=device_family(source.device))}
    launch(_forward_kernel, _forward_pass_kernel, forward_passes(iterations, chain), bh, m,
           args, options)
    return w, store
