"""Exact kernelized attention as flash-style Triton kernels: C never formed, O(N) memory.

With s the kernel's scale (``kernelized.py``: C_ij = exp(-s |q_i - k_j|^2 / 2)), in
log2 units (exp2 is the hardware's exponential), c = s log2(e),

    t_ij = c q_i.k_j - a_i - b_j,   a_i = c |q_i|^2 / 2,   b_j = c |k_j|^2 / 2,
    C_ij = 2^t_ij <= 1,             out = C V.

Every weight is at most 1, so unlike softmax there is no running maximum, no
rescaling and no normaliser to keep: the forward kernel (one program per block of
queries) adds 2^t V block by block, and the backward pass needs nothing from the
forward but its inputs. With dC = dO V^T and dS = dC * C (the gradient of the
exponent in natural units), since d t_ij / d q_i = s (k_j - q_i) / log2(e):

    dV = C^T dO,   dQ = s (dS K - (dS 1) * Q),   dK = s (dS^T Q - (dS^T 1) * K),

two kernels as in FlashAttention-2: one program per block of keys runs over the
queries for dK and dV, one per block of queries over the keys for dQ; the row and
column sums of dS come with the products. The norms are summed from the tiles the
kernels read anyway. Padded keys get b_j = +inf (weight 0, no gradient); causal
masking (Nq = Nk) skips the blocks above the diagonal.

Precision: bfloat16 / float16 inputs go to the tensor cores as they are (exact
products, float32 sums), and the weights are rounded to the input dtype before their
product with V or with Q, K (as flash attention rounds softmax's); dS is rounded once
and its row and column sums are taken of the rounded numbers, so that the two terms of
dQ (and dK) cancel exactly where q_i ~ k_j, whatever the size of q and k; float32 takes
PyTorch's matmul precision (three TF32 passes at "highest", ``triton_kernels._mm``);
float64 is exact (Triton's interpreter, for the tests). Norms and sums are float32
(float64 for float64). This module imports Triton (``flash.py`` imports it only when
the kernels run).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...linalg import triton_kernels
from ...linalg.kernel_backend import float64_dots, interpreter_on
from ...linalg.launch_grid import cdiv, tile_width
from ...linalg.triton_kernels import _mm, _precision
from ...linalg.triton_limits import launch_within_limits
from ...linalg.triton_rounding import to_dtype

LOG2E = math.log2(math.e)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, FMA: tl.constexpr):
    """a @ b summed in float32 (float64 for float64 tiles). ``"half"``: half-type tiles
    on the tensor cores; ``"half-interpreted"``: the same products as float32 values
    (exact, as the tensor cores make them; the interpreter's half ``tl.dot`` is wrong,
    ``triton_kernels._mm``); else ``_mm``'s precisions."""
    if PRECISION == "half":
        return tl.dot(a, b, out_dtype=tl.float32)
    elif PRECISION == "half-interpreted":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return _mm(a, b, PRECISION, FMA)


@triton.jit
def _compute(x, F64: tl.constexpr):
    """A tile in the compute dtype: float64 stays, everything else becomes float32."""
    if F64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _tile(PTR, b, h, s_b, s_h, s_n, rows, n, width, BLOCK: tl.constexpr):
    """Rows ``rows`` of head (b, h) of a ``[B, H, n, width]`` tensor with strides (s_b,
    s_h, s_n, 1), ``[len(rows), BLOCK]``, zero past n and width."""
    cols = tl.arange(0, BLOCK)
    return tl.load(PTR + b * s_b + h * s_h + rows.to(tl.int64)[:, None] * s_n + cols[None, :],
                   mask=(rows < n)[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def _matrix_offsets(bh, rows, n, width, BLOCK: tl.constexpr):
    """(int64 offsets, mask) of rows ``rows`` of matrix bh of a contiguous ``[BH, n,
    width]``, ``[len(rows), BLOCK]``, masked past n and width. bh (int64) multiplies
    first: n * width alone is an int32 product, which wraps from one head of 2^31
    entries (n = 2^25 rows of width 64)."""
    cols = tl.arange(0, BLOCK)
    offsets = bh.to(tl.int64) * n * width + rows.to(tl.int64)[:, None] * width + cols[None, :]
    return offsets, (rows < n)[:, None] & (cols < width)[None, :]


@triton.jit
def _matrix_tile(PTR, bh, rows, n, width, BLOCK: tl.constexpr):
    """Rows ``rows`` of matrix bh of a contiguous ``[BH, n, width]``, ``[len(rows),
    BLOCK]``, zero past n and width."""
    offsets, mask = _matrix_offsets(bh, rows, n, width, BLOCK)
    return tl.load(PTR + offsets, mask=mask, other=0.0)


@triton.jit
def _store(PTR, bh, rows, n, width, value, BLOCK: tl.constexpr):
    """``value`` into rows ``rows`` of matrix bh of a contiguous ``[BH, n, width]``."""
    offsets, mask = _matrix_offsets(bh, rows, n, width, BLOCK)
    tl.store(PTR + offsets, to_dtype(value, PTR.dtype.element_ty), mask=mask)


@triton.jit
def _query_offsets(q, c, F64: tl.constexpr):
    """(q in the compute dtype, a_i = c |q_i|^2 / 2) for a query tile."""
    qf = _compute(q, F64)
    return qf, 0.5 * c * tl.sum(qf * qf, axis=1)


@triton.jit
def _key_offsets(k, cols, VALID, b, NK, c, HAS_VALID: tl.constexpr, F64: tl.constexpr):
    """b_j = c |k_j|^2 / 2 for a key tile ``k [BLOCK_N, BLOCK_D]``; +inf for padded and
    out-of-range keys (weight 0)."""
    kf = _compute(k, F64)
    bn = 0.5 * c * tl.sum(kf * kf, axis=1)
    live = cols < NK
    if HAS_VALID:
        live = live & (tl.load(VALID + b * NK + cols, mask=cols < NK, other=0) != 0)
    return tl.where(live, bn, float("inf"))


@triton.jit
def _exponents(q, k, a, bn, rows, cols, c, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               FMA: tl.constexpr):
    """t = c q k^T - a - b for a query tile against a key tile, ``[len(rows),
    len(cols)]`` in a's dtype; -inf above the diagonal when ``CAUSAL``."""
    t = _dot(q, tl.trans(k), PRECISION, FMA).to(a.dtype) * c - a[:, None] - bn[None, :]
    if CAUSAL:
        t = tl.where(cols[None, :] <= rows[:, None], t, float("-inf"))
    return t


@triton.jit
def _keys_seen(pid_m, NK, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """How many keys the queries of block pid_m see: all, or (causal) up to the block's
    last query."""
    if CAUSAL:
        return tl.minimum(NK, (pid_m + 1) * BLOCK_M)
    else:
        return NK


@triton.jit
def _flash_forward_kernel(
    Q, K, V, VALID, OUT,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    heads, NQ, NK, D, DV, c,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, F64: tl.constexpr,
    PRECISION: tl.constexpr, FMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """C V for one block of queries, running over the keys."""
    pid_m = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _tile(Q, b, h, sq_b, sq_h, sq_n, rows, NQ, D, BLOCK_D)
    qf, a = _query_offsets(q, c, F64)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=qf.dtype)
    for start in range(0, _keys_seen(pid_m, NK, BLOCK_M, CAUSAL), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _tile(K, b, h, sk_b, sk_h, sk_n, cols, NK, D, BLOCK_D)
        bn = _key_offsets(k, cols, VALID, b, NK, c, HAS_VALID, F64)
        t = _exponents(q, k, a, bn, rows, cols, c, CAUSAL, PRECISION, FMA)
        v = _tile(V, b, h, sv_b, sv_h, sv_n, cols, NK, DV, BLOCK_DV)
        acc += _dot(to_dtype(tl.exp2(t), v.dtype), v, PRECISION, FMA).to(qf.dtype)
    _store(OUT, bh, rows, NQ, DV, acc, BLOCK_DV)


@triton.jit
def _flash_key_grad_kernel(
    Q, K, V, VALID, DO, DK, DV_OUT,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    heads, NQ, NK, D, DV, c, s,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, F64: tl.constexpr,
    PRECISION: tl.constexpr, FMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK and dV of one block of keys, running over the queries (transposed tiles:
    [keys, queries])."""
    pid_n = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * heads + h
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _tile(K, b, h, sk_b, sk_h, sk_n, cols, NK, D, BLOCK_D)
    v = _tile(V, b, h, sv_b, sv_h, sv_n, cols, NK, DV, BLOCK_DV)
    bn = _key_offsets(k, cols, VALID, b, NK, c, HAS_VALID, F64)
    kf = _compute(k, F64)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=kf.dtype)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=kf.dtype)
    col_sums = tl.zeros([BLOCK_N], dtype=kf.dtype)
    start = 0
    if CAUSAL:  # query i sees key j <= i: the first block holding row pid_n * BLOCK_N
        start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for m0 in range(start, NQ, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q = _tile(Q, b, h, sq_b, sq_h, sq_n, rows, NQ, D, BLOCK_D)
        do = _matrix_tile(DO, bh, rows, NQ, DV, BLOCK_DV)
        _, a = _query_offsets(q, c, F64)
        t = _dot(k, tl.trans(q), PRECISION, FMA).to(kf.dtype) * c - bn[:, None] - a[None, :]
        live = (rows < NQ)[None, :]
        if CAUSAL:
            live = live & (cols[:, None] <= rows[None, :])
        weights = tl.where(live, tl.exp2(t), 0.0)  # C^T, [BLOCK_N, BLOCK_M]
        dv += _dot(to_dtype(weights, do.dtype), do, PRECISION, FMA).to(kf.dtype)
        # dS^T, rounded to the inputs' dtype once: its product with Q and its sums use
        # the same numbers, so that dS^T Q - (dS^T 1) k cancels exactly where q ~ k
        ds = to_dtype(weights * _dot(v, tl.trans(do), PRECISION, FMA).to(kf.dtype), q.dtype)
        col_sums += tl.sum(ds.to(kf.dtype), axis=1)
        dk += _dot(ds, q, PRECISION, FMA).to(kf.dtype)
    _store(DK, bh, cols, NK, D, s * (dk - col_sums[:, None] * kf), BLOCK_D)
    _store(DV_OUT, bh, cols, NK, DV, dv, BLOCK_DV)


@triton.jit
def _flash_query_grad_kernel(
    Q, K, V, VALID, DO, DQ,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
    heads, NQ, NK, D, DV, c, s,
    HAS_VALID: tl.constexpr, CAUSAL: tl.constexpr, F64: tl.constexpr,
    PRECISION: tl.constexpr, FMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ of one block of queries, running over the keys."""
    pid_m = tl.program_id(0)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _tile(Q, b, h, sq_b, sq_h, sq_n, rows, NQ, D, BLOCK_D)
    do = _matrix_tile(DO, bh, rows, NQ, DV, BLOCK_DV)
    qf, a = _query_offsets(q, c, F64)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=qf.dtype)
    row_sums = tl.zeros([BLOCK_M], dtype=qf.dtype)
    for start in range(0, _keys_seen(pid_m, NK, BLOCK_M, CAUSAL), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _tile(K, b, h, sk_b, sk_h, sk_n, cols, NK, D, BLOCK_D)
        v = _tile(V, b, h, sv_b, sv_h, sv_n, cols, NK, DV, BLOCK_DV)
        bn = _key_offsets(k, cols, VALID, b, NK, c, HAS_VALID, F64)
        t = _exponents(q, k, a, bn, rows, cols, c, CAUSAL, PRECISION, FMA)
        # dS, rounded once (as in the key kernel)
        ds = to_dtype(tl.exp2(t) * _dot(do, tl.trans(v), PRECISION, FMA).to(qf.dtype), k.dtype)
        row_sums += tl.sum(ds.to(qf.dtype), axis=1)
        dq += _dot(ds, k, PRECISION, FMA).to(qf.dtype)
    _store(DQ, bh, rows, NQ, D, s * (dq - row_sums[:, None] * qf), BLOCK_D)


def flash_precision(dtype: torch.dtype, device: torch.device | None = None) -> str:
    """The dots' precision for inputs of ``dtype`` on ``device`` (module docstring)."""
    if dtype in (torch.bfloat16, torch.float16):
        return "half-interpreted" if interpreter_on() else "half"
    return _precision(dtype, device=device)


def flash_tiles(dtype: torch.dtype, head_dim: int, kind: str,
                capability: tuple[int, int] | None = None) -> dict:
    """Launch options of the ``kind`` kernel (``"forward"``, ``"keys"``, ``"queries"``) for
    inputs of ``dtype`` and head dim ``head_dim`` (the wider of the query/key and the value
    dims: a program holds blocks of rows of both): the block over the program's own rows
    (``BLOCK_M`` queries, or ``BLOCK_N`` keys for ``"keys"``), the block of its loop, warps
    and pipeline stages. Half types: blocks as FlashAttention-2's; float32 (three TF32
    products a dot) and float64 (the interpreter) smaller. Chosen from the kernels compiled
    for sm_90 (``benchmarks/triton_resources.py``, Triton 3.6 and 3.9): none spills in half
    types up to head dim 256 (8 warps from 128, where 4 spill; smaller blocks above 128) nor
    in float32 at head dim 32; float32 spills up to 120 bytes a thread at 64-128 and 370-500
    bytes in the backward kernels at 256 (16 x 16 blocks, the least). Not timed on a GPU yet
    (``benchmarks/flash_tiles.py`` times candidates). ``capability``: the GPU's (None:
    sm_90's tiles); GPUs whose dots compile otherwise (``triton_kernels.dot_family``) take
    the blocks of ``_BY_FAMILY`` where sm_90's spill there."""
    other = None if dtype == torch.float64 else _BY_FAMILY.get(
        (triton_kernels.dot_family(capability), dtype in (torch.bfloat16, torch.float16),
         kind))
    if other and head_dim <= other["up_to_head_dim"]:
        own, step, warps, stages = other["tiles"]
    elif dtype == torch.float64:
        own, step, warps, stages = 32, 32, 4, 1
    elif dtype == torch.float32:
        if head_dim > 128:
            own, step, warps, stages = 16, 16, 8, 1
        else:
            own, step, warps, stages = (64 if head_dim <= 32 else 32,
                                        32 if head_dim <= 64 else 16,
                                        4 if head_dim <= 64 else 8, 2)
    elif head_dim > 128:
        own, step, warps, stages = (64, 32, 8, 1) if kind == "forward" else (32, 32, 8, 1)
    elif kind == "forward":
        own, step, warps, stages = 128, 64, 8 if head_dim > 64 else 4, 2
    else:
        wide = head_dim > 64
        own, step, warps, stages = 64, 32 if wide and kind == "keys" else 64, \
            8 if wide else 4, 2
    if kind == "keys":
        return {"BLOCK_N": own, "BLOCK_M": step, "num_warps": warps, "num_stages": stages}
    return {"BLOCK_M": own, "BLOCK_N": step, "num_warps": warps, "num_stages": stages}


# Blocks by dot family (triton_kernels.dot_family) where sm_90's spill, keyed by (family,
# half type, kind): (own, step, warps, stages); float64 keeps its own. "mma_sync"
# (compiled for sm_80, Triton 3.9): sm_90's spilled keys 480 and queries 96 bytes a
# thread in half types at head dim 64, keys 120 in float32 at 32; these spill nothing
# (in half types keys 124 registers, 16 warps an SM, queries 140 and 12); wider heads
# spill nothing with sm_90's blocks. "fma" (sm_75, float16 at head dim 64): sm_90's
# forward blocks spilled 7352 bytes, the mma_sync gradient blocks 440-576; these spill
# nothing (forward 240 registers, gradients 128 and 16 warps an SM); float32 keys
# spilled 424 at head dim 32, with mma_sync's blocks none. Not timed: no such GPU ran
# them.
_BY_FAMILY = {
    ("mma_sync", True, "keys"): {"up_to_head_dim": 64, "tiles": (32, 64, 8, 2)},
    ("mma_sync", True, "queries"): {"up_to_head_dim": 64, "tiles": (32, 64, 4, 2)},
    ("mma_sync", False, "keys"): {"up_to_head_dim": 32, "tiles": (64, 16, 4, 2)},
    ("fma", True, "forward"): {"up_to_head_dim": 64, "tiles": (64, 32, 8, 2)},
    ("fma", True, "keys"): {"up_to_head_dim": 64, "tiles": (16, 16, 8, 2)},
    ("fma", True, "queries"): {"up_to_head_dim": 64, "tiles": (16, 16, 8, 2)},
    ("fma", False, "keys"): {"up_to_head_dim": 32, "tiles": (64, 16, 4, 2)},
}


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _common(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, s: float,
            causal: bool) -> tuple[list, dict]:
    """The arguments every kernel shares (tensors with a unit last stride)."""
    _, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    valid = q if key_valid is None else key_valid.contiguous().view(torch.uint8)
    args = [*_strides(q), *_strides(k), *_strides(v), h, nq, nk, d, dv, s * LOG2E]
    meta = {"HAS_VALID": key_valid is not None, "CAUSAL": causal,
            "F64": q.dtype == torch.float64, "PRECISION": flash_precision(q.dtype, q.device),
            "FMA": q.dtype == torch.float64 and not float64_dots(),
            "BLOCK_D": tile_width(d),
            "BLOCK_DV": tile_width(dv)}
    return [valid, args], meta


def _batch_slices(b: int) -> list[slice | None]:
    """The batch in slices of at most ``MAX_GRID_YZ`` sequences (``[None]``: whole): the
    kernels put the batch index on the grid's third dimension, which CUDA limits to
    65535 (more sequences, e.g. a ``vmap`` folded into the batch, failed to launch)."""
    most = triton_kernels.MAX_GRID_YZ
    return [None] if b <= most else [slice(start, start + most) for start in range(0, b, most)]


def _at(t: Tensor | None, part: slice | None) -> Tensor | None:
    """The sequences ``part`` of ``t`` (``t`` itself for None)."""
    return t if t is None or part is None else t[part]


def unit_last_stride(t: Tensor) -> Tensor:
    """``t`` as it is if its last dim is dense (the kernels take any other strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, s: float,
                  causal: bool) -> Tensor:
    """C V for q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``, v ``[B, H, Nk, Dv]`` (one dtype,
    any strides with a dense last dim), ``key_valid`` ``[B, Nk]`` bool or None, the
    kernel's scale s; ``[B, H, Nq, Dv]`` in the inputs' dtype."""
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    b, h, nq, _ = q.shape
    out = q.new_empty(b, h, nq, v.shape[3])
    if out.numel() == 0:
        return out
    tiles = flash_tiles(q.dtype, max(q.shape[3], v.shape[3]), "forward",
                        triton_kernels.device_capability(q.device))
    for part in _batch_slices(b):
        qp, kp, vp = _at(q, part), _at(k, part), _at(v, part)
        (valid, args), meta = _common(qp, kp, vp, _at(key_valid, part), s, causal)
        grid = (cdiv(nq, tiles["BLOCK_M"]), h, qp.shape[0])
        launch_within_limits(_flash_forward_kernel, grid,
                             (qp, kp, vp, valid, _at(out, part), *args), {**meta, **tiles},
                             "flash forward")
    return out


def flash_backward(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None,
                   grad: Tensor, s: float, causal: bool, *, need_q: bool = True,
                   need_kv: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dq, dk, dv) of ``flash_forward`` for the output gradient ``grad``
    ``[B, H, Nq, Dv]``; each in its input's shape and dtype (contiguous), None where
    not asked for (``need_q``; ``need_kv``: dk and dv, one kernel)."""
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    grad = grad.contiguous().to(q.dtype)
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    width = max(q.shape[3], v.shape[3])  # the accumulators are as wide as the wider one
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
    dk, dv = ((torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
              if need_kv else (None, None))
    if b * h == 0 or nq == 0 or nk == 0:  # no weight at all: zero gradients
        return tuple(None if t is None else t.zero_() for t in (dq, dk, dv))
    for part in _batch_slices(b):
        qp, kp, vp, gp = _at(q, part), _at(k, part), _at(v, part), _at(grad, part)
        (valid, args), meta = _common(qp, kp, vp, _at(key_valid, part), s, causal)
        bp = qp.shape[0]
        if need_kv:
            tiles = flash_tiles(q.dtype, width, "keys",
                                triton_kernels.device_capability(q.device))
            launch_within_limits(_flash_key_grad_kernel, (cdiv(nk, tiles["BLOCK_N"]), h, bp),
                                 (qp, kp, vp, valid, gp, _at(dk, part), _at(dv, part), *args,
                                  s), {**meta, **tiles}, "flash key gradient")
        if need_q:
            tiles = flash_tiles(q.dtype, width, "queries",
                                triton_kernels.device_capability(q.device))
            launch_within_limits(_flash_query_grad_kernel, (cdiv(nq, tiles["BLOCK_M"]), h, bp),
                                 (qp, kp, vp, valid, gp, _at(dq, part), *args, s),
                                 {**meta, **tiles}, "flash query gradient")
    return dq, dk, dv
