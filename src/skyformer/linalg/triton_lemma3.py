"""The Lemma 3 inverse of ``nystrom.lemma3_inverse`` in one Triton program per matrix.

For each landmark kernel matrix M ``[m, m]`` (one per batch element and head), with
the ridge diagonal g (gamma, or 1 for slots that hold no landmark):

    M_r = M + diag(g),   d = M_r 1,   A = D^-1/2 M_r D^-1/2,
    V_1 = T3(A) / 4,     V_{k+1} = V_k T3(A V_k) / 4     (Razavi et al., ``pinv.py``),
    W = D^-1/2 V_K D^-1/2,

with T3(P) = 13I - P (15I - P (7I - P)). The eager PyTorch path spends about forty
operations on this forward and seventy backward, each a kernel launch at m = 128 that
does almost no work on a GPU; here the whole chain is one launch forward and one
backward (``triton_lemma3_backward``), the forward's few matrices of a program held in
registers (m <= ``lemma3_triton.MAX_M``).

Given the landmark rows X (scaled) and their half squared norms n instead of M
(``FROM_ROWS``), the kernel forms M_ij = exp(x_i . x_j - n_i - n_j) itself.

The forward kernel writes V_1 ... V_K (``store``, ``[BH, K, m, m]``), from which the
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

from .triton_kernels import _mm, _precision


@triton.jit
def _landmark_matrix(M, X, XN, bh, m, D, FROM_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """M of one matrix: loaded, or (``FROM_ROWS``) the Gaussian block
    exp(x_i . x_j - n_i - n_j) of the landmark rows X (n = +inf: a dead slot)."""
    r = tl.arange(0, BLOCK)
    inside = r < m
    if FROM_ROWS:
        rd = tl.arange(0, BLOCK_D)
        x = tl.load(X + bh * m * D + r[:, None] * D + rd[None, :],
                    mask=inside[:, None] & (rd < D)[None, :], other=0.0)
        n = tl.load(XN + bh * m + r, mask=inside, other=float("inf"))
        e = _mm(x, tl.trans(x), PRECISION, False) - n[:, None] - n[None, :]
        mat = tl.exp(e)
    else:
        mat = tl.load(M + bh * m * m + r[:, None] * m + r[None, :],
                      mask=inside[:, None] & inside[None, :], other=0.0)
    return mat


@triton.jit
def _normalise(mat, DIAG, bh, heads, m, TINY: tl.constexpr, BLOCK: tl.constexpr):
    """(M_r, s = d^-1/2, A, I) of one matrix M; rows and columns past m are zero."""
    r = tl.arange(0, BLOCK)
    inside = r < m
    eye = tl.where((r[:, None] == r[None, :]) & inside[:, None], 1.0, 0.0).to(mat.dtype)
    ridge = tl.load(DIAG + (bh // heads) * m + r, mask=inside, other=0.0).to(mat.dtype)
    mat = mat + eye * ridge[None, :]
    d = tl.sum(mat, axis=1)
    s = tl.where(inside, 1.0 / tl.sqrt(tl.maximum(d, TINY)), 0.0).to(mat.dtype)
    a = s[:, None] * mat * s[None, :]
    return mat, s, a, eye


@triton.jit
def _forward_kernel(M, X, XN, DIAG, W, STORE, m, D, heads, ITERATIONS: tl.constexpr,
                    FROM_ROWS: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    inside = r < m
    mask = inside[:, None] & inside[None, :]
    offsets = r[:, None] * m + r[None, :]
    mat = _landmark_matrix(M, X, XN, bh, m, D, FROM_ROWS, BLOCK, BLOCK_D, PRECISION)
    _, s, a, eye = _normalise(mat, DIAG, bh, heads, m, TINY, BLOCK)
    # step 1 from V_0 = I: P = A, V_1 = T3 / 4
    t1 = 7.0 * eye - a
    t2 = 15.0 * eye - _mm(a, t1, PRECISION, False)
    v = 0.25 * (13.0 * eye - _mm(a, t2, PRECISION, False))
    tl.store(STORE + bh * ITERATIONS * m * m + offsets, v, mask=mask)
    for i in range(1, ITERATIONS):
        p = _mm(a, v, PRECISION, False)
        t1 = 7.0 * eye - p
        t2 = 15.0 * eye - _mm(p, t1, PRECISION, False)
        t3 = 13.0 * eye - _mm(p, t2, PRECISION, False)
        v = 0.25 * _mm(v, t3, PRECISION, False)
        tl.store(STORE + (bh * ITERATIONS + i) * m * m + offsets, v, mask=mask)
    tl.store(W + bh * m * m + offsets, s[:, None] * v * s[None, :], mask=mask)


def _launch_options(m: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the matrix padded to a power of two (tl.dot needs >= 16);
    eight warps hold a 128 x 128 float32 matrix in 64 registers a thread."""
    block = max(16, triton.next_power_of_2(m))
    return block, (8 if block >= 128 else 4)


def lemma3_forward(source: Tensor, norm: Tensor | None, ridge: Tensor, iterations: int
                   ) -> tuple[Tensor, Tensor]:
    """(W ``[BH, m, m]``, store ``[BH, iterations, m, m]``) for ``ridge: [R, m]`` (the
    diagonal added to the matrices of batch element bh // (BH / R)) and either the
    landmark matrix ``source: [BH, m, m]`` (``norm`` None) or the landmark rows
    ``source: [BH, m, D]`` with their half squared norms ``norm: [BH, m]``."""
    bh, m = source.shape[:2]
    d = source.shape[2] if norm is not None else 1
    block, warps = _launch_options(m)
    w = source.new_empty(bh, m, m)
    store = source.new_empty(bh, iterations, m, m)
    _forward_kernel[(bh,)](
        source, source, source if norm is None else norm, ridge, w, store, m, d,
        bh // ridge.shape[0], ITERATIONS=iterations, FROM_ROWS=norm is not None,
        TINY=torch.finfo(source.dtype).tiny, BLOCK=block, BLOCK_D=_block_d(d),
        PRECISION=_precision(source.dtype), num_warps=warps)
    return w, store


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))
