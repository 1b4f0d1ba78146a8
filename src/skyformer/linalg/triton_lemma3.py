"""The Lemma 3 inverse of ``nystrom.lemma3_inverse`` in one Triton program per matrix.

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
V_0 = I, is two (T2 from A, then V_1 = T3 / 4).

Given the landmark rows X (scaled) and their half squared norms n instead of M
(``FROM_ROWS``), the kernel forms M_ij = exp(x_i . x_j - n_i - n_j) itself.

The forward kernel writes V_1 ... V_K (``store``, ``[BH, K, m, m]``; each V is
written there as it is computed and read back by the next step), from which the
backward kernel rebuilds P, T2, T3 of each step and runs the adjoint of
``pinv._RazaviIteration`` step by step, then the adjoints of the normalisation:

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

from .triton_kernels import _precision
from .triton_rowblocks import eye_rows, product_rows, rows_of, square_rows, store_rows

# Scratch of the forward kernel: m x m slots and m-vectors a program.
# (Constants the kernels read must be tl.constexpr.)
FORWARD_SLOTS = tl.constexpr(5)
_MR, _A, _P, _T2, _T3 = (tl.constexpr(i) for i in range(5))
FORWARD_VECTORS = tl.constexpr(2)
_D, _S = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def regularise(M, X, XN, ridge, MAT_R, D_VEC, S_VEC, bh, m, D, FROM_ROWS: tl.constexpr,
               TINY: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
               KC: tl.constexpr, PRECISION: tl.constexpr):
    """One pass: M_r = C + diag(ridge) into ``MAT_R``, d = M_r 1 into ``D_VEC`` and
    s = rsqrt(max(d, tiny)) into ``S_VEC``, where C is the landmark matrix M (loaded)
    or (``FROM_ROWS``) the Gaussian block exp(x_i . x_j - n_i - n_j) of the landmark
    rows X ``[m, D]`` with half squared norms n (+inf: a slot without a landmark).
    Ends with a barrier."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
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
    tl.debug_barrier()


@triton.jit
def normalise(MAT_R, S_VEC, A, m, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """One pass: A = S M_r S. Ends with a barrier."""
    cols = tl.arange(0, BLOCK)
    s_cols = tl.load(S_VEC + cols, mask=cols < m, other=0.0)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(S_VEC + rows, mask=rows < m, other=0.0)
        store_rows(A, rows, m, s_rows[:, None] * rows_of(MAT_R, rows, m, BLOCK)
                   * s_cols[None, :], BLOCK)
    tl.debug_barrier()


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


@triton.jit
def _forward_kernel(M, X, XN, DIAG, W, STORE, SCR, VEC, m, D, heads,
                    ITERATIONS: tl.constexpr, FROM_ROWS: tl.constexpr, TINY: tl.constexpr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, KC: tl.constexpr,
                    PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    size = m * m
    scratch = SCR + bh * FORWARD_SLOTS * size
    vectors = VEC + bh * FORWARD_VECTORS * m
    a, p, t2, t3 = (scratch + _A * size, scratch + _P * size, scratch + _T2 * size,
                    scratch + _T3 * size)
    cols = tl.arange(0, BLOCK)
    ridge = tl.load(DIAG + (bh // heads) * m + cols, mask=cols < m, other=0.0)
    regularise(M, X, XN, ridge, scratch + _MR * size, vectors + _D * m, vectors + _S * m,
               bh, m, D, FROM_ROWS, TINY, BLOCK, ROWS, KC, PRECISION)
    normalise(scratch + _MR * size, vectors + _S * m, a, m, BLOCK, ROWS)
    # step 1 from V_0 = I: P = A, V_1 = T3 / 4
    v_1 = STORE + bh * ITERATIONS * size
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        store_rows(t2, rows, m, t2_rows(a, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
    tl.debug_barrier()
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        store_rows(v_1, rows, m, 0.25 * t3_rows(a, t2, rows, m, ROWS, BLOCK, KC, PRECISION),
                   BLOCK)
    tl.debug_barrier()
    for i in range(1, ITERATIONS):
        v = STORE + (bh * ITERATIONS + i - 1) * size
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(p, rows, m, square_rows(a, False, v, False, rows, m, ROWS, BLOCK, KC,
                                               PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(t2, rows, m, t2_rows(p, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(t3, rows, m, t3_rows(p, t2, rows, m, ROWS, BLOCK, KC, PRECISION), BLOCK)
        tl.debug_barrier()
        for start in range(0, m, ROWS):
            rows = start + tl.arange(0, ROWS)
            store_rows(v + size, rows, m, 0.25 * square_rows(v, False, t3, False, rows, m, ROWS,
                                                             BLOCK, KC, PRECISION), BLOCK)
        tl.debug_barrier()
    # W = S V_K S
    v_last = STORE + (bh * ITERATIONS + ITERATIONS - 1) * size
    s_cols = tl.load(vectors + _S * m + cols, mask=cols < m, other=0.0)
    for start in range(0, m, ROWS):
        rows = start + tl.arange(0, ROWS)
        s_rows = tl.load(vectors + _S * m + rows, mask=rows < m, other=0.0)
        store_rows(W + bh * size, rows, m, s_rows[:, None] * rows_of(v_last, rows, m, BLOCK)
                   * s_cols[None, :], BLOCK)


def launch_options(m: int, backward: bool = False) -> dict:
    """Tiles and warps of the forward (or ``backward``) Lemma 3 kernel: the matrix padded
    to a power of two (``BLOCK``, tl.dot needs >= 16), row blocks and inner chunks of 32
    (``ROWS``, ``KC``: a [32, 128] float32 accumulator), eight warps from m = 64, one
    pipeline stage. Chosen from the compiled kernels' resources (sm_90: at most 24 bytes
    of spills a thread, 16 KiB of shared memory at m = 128; four warps or more stages
    spill hundreds of bytes a thread there; benchmarks/triton_resources.py), and timed
    against the alternatives that compile cleanly (``benchmarks/lemma3_tiles.py``, H200,
    m = 128): the fastest for both kernels, the others up to 1.4x slower (64-row blocks
    with warpgroup MMA too: the kernels wait on their chain of passes, not on MMAs)."""
    block = max(16, triton.next_power_of_2(m))
    tile = min(block, 32)
    return {"BLOCK": block, "ROWS": tile, "KC": tile, "num_warps": 8 if block >= 64 else 4,
            "num_stages": 1}


def lemma3_forward(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int
                   ) -> tuple[Tensor, Tensor]:
    """(W ``[BH, m, m]``, store ``[BH, iterations, m, m]``) for ``ridge: [R, m]`` (the
    diagonal added to the matrices of batch element bh // (BH / R)) and either the
    landmark matrix ``source: [BH, m, m]`` (``norm`` None) or the landmark rows
    ``source: [BH, m, D]`` with their half squared norms ``norm: [BH, m]``. Scratch:
    ``FORWARD_SLOTS`` m x m matrices a program."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    w = source.new_empty(bh, m, m)
    store = source.new_empty(bh, iterations, m, m)
    scratch = source.new_empty(bh, FORWARD_SLOTS.value, m, m)
    vectors = source.new_empty(bh, FORWARD_VECTORS.value, m)
    _forward_kernel[(bh,)](
        source, source, source if norm is None else norm, ridge, w, store, scratch, vectors,
        m, d, bh // ridge.shape[0], ITERATIONS=iterations, FROM_ROWS=norm is not None,
        TINY=torch.finfo(source.dtype).tiny, PRECISION=_precision(source.dtype),
        **launch_options(m))
    return w, store
