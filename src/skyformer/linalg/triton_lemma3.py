"""The Lemma 3 inverse of ``nystrom.lemma3_inverse`` in one Triton program per matrix.

For each landmark kernel matrix M ``[m, m]`` (one per batch element and head), with
the ridge diagonal g (gamma, or 1 for slots that hold no landmark):

    M_r = M + diag(g),   d = M_r 1,   A = D^-1/2 M_r D^-1/2,
    V_1 = T3(A) / 4,     V_{k+1} = V_k T3(A V_k) / 4     (Razavi et al., ``pinv.py``),
    W = D^-1/2 V_K D^-1/2,

with T3(P) = 13I - P (15I - P (7I - P)). The eager PyTorch path spends about forty
operations on this forward and seventy backward, each a kernel launch at m = 128 that
does almost no work on a GPU; here the whole chain is one launch forward and one
backward, every matrix of a program held in registers (m <= ``MAX_M``).

The forward kernel writes V_1 ... V_K (``store``, ``[BH, K, m, m]``); the backward
kernel rebuilds P, T1, T2, T3 of each step from its V and runs the adjoint of
``pinv._RazaviIteration`` step by step, then the adjoints of the normalisation:

    dV_K  = D^-1/2 G D^-1/2,
    dA    = (adjoint of the steps),
    dM    = D^-1/2 dA D^-1/2 + (dd) 1^T,
    dd_i  = -1/2 d_i^-3/2 (sum_j G_ij V_ij s_j + G_ji V_ji s_j + dA_ij M_ij s_j
                           + dA_ji M_ji s_j),     s = d^-1/2.

Float32 products run as ``triton_kernels._mm`` (TF32 passes per PyTorch's matmul
precision); float64 is for Triton's interpreter (the tests' exact check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_kernels import _mm, _precision

MAX_M = 128


@triton.jit
def _normalise(M, DIAG, bh, heads, m, TINY: tl.constexpr, BLOCK: tl.constexpr):
    """(M_r, s = d^-1/2, A, I) of one matrix; rows and columns past m are zero."""
    r = tl.arange(0, BLOCK)
    inside = r < m
    mat = tl.load(M + bh * m * m + r[:, None] * m + r[None, :],
                  mask=inside[:, None] & inside[None, :], other=0.0)
    eye = tl.where((r[:, None] == r[None, :]) & inside[:, None], 1.0, 0.0).to(mat.dtype)
    ridge = tl.load(DIAG + (bh // heads) * m + r, mask=inside, other=0.0).to(mat.dtype)
    mat = mat + eye * ridge[None, :]
    d = tl.sum(mat, axis=1)
    s = tl.where(inside, 1.0 / tl.sqrt(tl.maximum(d, TINY)), 0.0).to(mat.dtype)
    a = s[:, None] * mat * s[None, :]
    return mat, s, a, eye


@triton.jit
def _forward_kernel(M, DIAG, W, STORE, m, heads, ITERATIONS: tl.constexpr,
                    TINY: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    inside = r < m
    mask = inside[:, None] & inside[None, :]
    offsets = r[:, None] * m + r[None, :]
    _, s, a, eye = _normalise(M, DIAG, bh, heads, m, TINY, BLOCK)
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


@triton.jit
def _backward_kernel(M, DIAG, STORE, G, DM, m, heads, ITERATIONS: tl.constexpr,
                     TINY: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    inside = r < m
    mask = inside[:, None] & inside[None, :]
    offsets = r[:, None] * m + r[None, :]
    mat, s, a, eye = _normalise(M, DIAG, bh, heads, m, TINY, BLOCK)
    a_t = tl.trans(a)
    grad = tl.load(G + bh * m * m + offsets, mask=mask, other=0.0)
    v_last = tl.load(STORE + (bh * ITERATIONS + ITERATIONS - 1) * m * m + offsets,
                     mask=mask, other=0.0)
    gs = grad * v_last
    ds = tl.sum(gs * s[None, :], axis=1) + tl.sum(gs * s[:, None], axis=0)
    g = s[:, None] * grad * s[None, :]  # dV_K
    da = tl.zeros([BLOCK, BLOCK], dtype=a.dtype)
    for j in range(0, ITERATIONS - 1):  # steps K, K-1, ..., 2 (input V = V_{i-1})
        i = ITERATIONS - 1 - j
        v = tl.load(STORE + (bh * ITERATIONS + i - 1) * m * m + offsets, mask=mask, other=0.0)
        p = _mm(a, v, PRECISION, False)
        t1 = 7.0 * eye - p
        t2 = 15.0 * eye - _mm(p, t1, PRECISION, False)
        t3 = 13.0 * eye - _mm(p, t2, PRECISION, False)
        p_t = tl.trans(p)
        dt3 = 0.25 * _mm(tl.trans(v), g, PRECISION, False)
        m2 = _mm(p_t, dt3, PRECISION, False)  # -dT2
        m1 = _mm(p_t, m2, PRECISION, False)  # dT1
        dp = _mm(m2, tl.trans(t1), PRECISION, False) - m1 \
            - _mm(dt3, tl.trans(t2), PRECISION, False)
        da += _mm(dp, tl.trans(v), PRECISION, False)
        g = 0.25 * _mm(g, tl.trans(t3), PRECISION, False) + _mm(a_t, dp, PRECISION, False)
    # step 1 from V_0 = I: P = A, dT3 = g / 4, no gradient to V_0
    t1 = 7.0 * eye - a
    t2 = 15.0 * eye - _mm(a, t1, PRECISION, False)
    dt3 = 0.25 * g
    m2 = _mm(a_t, dt3, PRECISION, False)
    m1 = _mm(a_t, m2, PRECISION, False)
    da += _mm(m2, tl.trans(t1), PRECISION, False) - m1 \
        - _mm(dt3, tl.trans(t2), PRECISION, False)
    # A = S M_r S, s = rsqrt(max(M_r 1, tiny))
    dam = da * mat
    ds += tl.sum(dam * s[None, :], axis=1) + tl.sum(dam * s[:, None], axis=0)
    d = tl.sum(mat, axis=1)
    dd = tl.where(inside & (d > TINY), -0.5 * ds * s * s * s, 0.0)
    dm = s[:, None] * da * s[None, :] + dd[:, None]
    tl.store(DM + bh * m * m + offsets, dm, mask=mask)


def _launch_options(m: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the matrix padded to a power of two (tl.dot needs >= 16);
    eight warps hold a 128 x 128 float32 matrix in 64 registers a thread."""
    block = max(16, triton.next_power_of_2(m))
    return block, (8 if block >= 128 else 4)


def lemma3_forward(mat: Tensor, ridge: Tensor, iterations: int) -> tuple[Tensor, Tensor]:
    """(W ``[BH, m, m]``, store ``[BH, iterations, m, m]``) for ``mat: [BH, m, m]`` and
    ``ridge: [B, m]`` (the diagonal added to the matrices of batch element BH // B)."""
    bh, m, _ = mat.shape
    block, warps = _launch_options(m)
    w = torch.empty_like(mat)
    store = mat.new_empty(bh, iterations, m, m)
    _forward_kernel[(bh,)](
        mat, ridge, w, store, m, bh // ridge.shape[0], ITERATIONS=iterations,
        TINY=torch.finfo(mat.dtype).tiny, BLOCK=block, PRECISION=_precision(mat.dtype),
        num_warps=warps)
    return w, store


def lemma3_backward(mat: Tensor, ridge: Tensor, store: Tensor, grad: Tensor) -> Tensor:
    """dM ``[BH, m, m]`` for the incoming gradient ``grad`` of W; tensors as
    ``lemma3_forward`` returned and took them."""
    bh, m, _ = mat.shape
    block, warps = _launch_options(m)
    dm = torch.empty_like(mat)
    _backward_kernel[(bh,)](
        mat, ridge, store, grad, dm, m, bh // ridge.shape[0], ITERATIONS=store.shape[1],
        TINY=torch.finfo(mat.dtype).tiny, BLOCK=block, PRECISION=_precision(mat.dtype),
        num_warps=warps)
    return dm
