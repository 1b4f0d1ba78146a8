"""The landmark draws in one Triton kernel each, bit for bit those of ``rng``.

A counter-based draw is a few dozen integer tensor operations (the hash rounds of
``rng``), each a kernel launch on a GPU: about half of the launches of an eager
Skyformer forward + backward at GPU speeds. These kernels compute the same numbers in
one launch:

- ``selection_keys``: ``landmarks.selection_keys(rng.stream(key, name), ...)``, the
  int64 keys ``[B, n]`` (score, rank) whose smallest pick the landmarks, padded rows
  ``PADDED_KEY`` + position; ``paired_selection_keys`` those of two streams (the
  query and key sides of an unpadded call) in one launch;
- ``slot_ranks``: the causal landmark slots' token ranks ``[B, m]``
  (``ops.shared.causal_nystrom.slot_ranks``), s R + floor(u_s R) with a float64 u_s.

Each derives the stream key and the per-batch keys (``rng.fold_in``) and hashes its
indices (``rng._bits``) with ``rng``'s int64 arithmetic transcribed (wrapping products,
arithmetic shifts, 32-bit masks), so the numbers are equal for any key tensor, not only
for keys below 2^32.

This module imports Triton; callers import it only when the Triton path is chosen, so
the library runs without Triton installed.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..linalg.launch_grid import cdiv
from . import rng

BLOCK = 1024


@triton.jit
def _mix(x):
    """``rng._mix`` on int64 values (products wrap; the masks keep the low 32 bits)."""
    mask = tl.full(x.shape, 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * tl.full(x.shape, 0x7FEB352D, tl.int64)) & mask
    x = x ^ (x >> 15)
    x = (x * tl.full(x.shape, 0x846CA68B, tl.int64)) & mask
    return x ^ (x >> 16)


@triton.jit
def _fold_in(k0, k1, data):
    """``rng.fold_in`` of the key (k0, k1) with the int64 ``data``."""
    mask = tl.full(data.shape, 0xFFFFFFFF, tl.int64)
    data = data & mask
    a = _mix(k0 ^ _mix((data * tl.full(data.shape, 0x9E3779B9, tl.int64)) & mask))
    b = _mix(k1 ^ _mix(a + tl.full(data.shape, 0x632BE5AB, tl.int64)))
    return a, b


@triton.jit
def _bits(k0, k1, index, salt):
    """``rng._bits``: 32 random bits for each int64 ``index`` under the key (k0, k1)."""
    mask = tl.full(index.shape, 0xFFFFFFFF, tl.int64)
    i = index & mask
    h = _mix(((i * tl.full(index.shape, 0x9E3779B9, tl.int64)) & mask) ^ k0)
    h = _mix(h ^ k1 ^ salt)
    return _mix((h + i) & mask)


@triton.jit
def _batch_key(KEY, stream_data, b):
    """``fold_in(stream(key, name), b)`` as two int64 ``[1]`` words."""
    one = tl.full([1], 0, tl.int64)
    k0, k1 = _fold_in(tl.load(KEY + one), tl.load(KEY + 1 + one), one + stream_data)
    return _fold_in(k0, k1, one + b)


@triton.jit
def _row_and_block(n, BLOCK: tl.constexpr):
    """(row, block of ``BLOCK`` positions) of this program, int64, from the one grid
    dimension ``row_grid`` numbers them along (row-major)."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(n, BLOCK)
    return pid // blocks, pid % blocks


def row_grid(rows: int, n: int) -> tuple[int]:
    """The launch grid of a kernel with a program per block of ``BLOCK`` positions of
    each of ``rows`` rows of ``n``: all on the first dimension (CUDA's limit 2^31 - 1),
    since the second and third hold at most 65535 blocks, which a row of more than
    65535 * 1024 positions (67M tokens) had needed."""
    return (rows * cdiv(n, BLOCK),)


@triton.jit
def _selection_keys_kernel(
    KEY, RANK, VALID, BEFORE, OUT, batch, n, stream_data, second_stream_data, rows_before,
    HAS_RANK: tl.constexpr, HAS_VALID: tl.constexpr, HAS_BEFORE: tl.constexpr,
    SALT: tl.constexpr, PADDED: tl.constexpr, BLOCK: tl.constexpr,
):
    row, block = _row_and_block(n, BLOCK)  # row of OUT: [streams * B, n], stream-major
    b = row % batch
    pos = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = pos < n
    k0, k1 = _batch_key(KEY, tl.where(row < batch, stream_data, second_stream_data), b)
    if HAS_RANK:
        rank = tl.load(RANK + b * n + pos, mask=inside, other=0)
    else:
        rank = pos
        if HAS_BEFORE:
            rank += tl.load(BEFORE + b + tl.full([1], 0, tl.int64))
    # uniform_at's float32 score is the top 24 of the 32 bits, exactly
    score = _bits(k0, k1, rank, tl.full(rank.shape, SALT, tl.int64)) >> 8
    keys = (score << 32) | rank
    if HAS_VALID:
        valid = tl.load(VALID + b * n + pos, mask=inside, other=0) != 0
        keys = tl.where(valid, keys, tl.full(pos.shape, PADDED, tl.int64) + rows_before + pos)
    tl.store(OUT + row * n + pos, keys, mask=inside)


@triton.jit
def _slot_ranks_kernel(
    KEY, OUT, m, stream_data, STRIDE,
    SALT: tl.constexpr, LOW_SALT: tl.constexpr, BLOCK: tl.constexpr,
    PER_ELEMENT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    stride = tl.load(STRIDE + b) if PER_ELEMENT else STRIDE  # PER_ELEMENT: one per element
    slot = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    k0, k1 = _batch_key(KEY, stream_data, b)
    hi = _bits(k0, k1, slot, tl.full(slot.shape, SALT, tl.int64))
    lo = _bits(k0, k1, slot, tl.full(slot.shape, LOW_SALT, tl.int64)) >> 11
    u = ((hi << 21) + lo).to(tl.float64) * 1.1102230246251565e-16  # uniform_at, float64
    offset = (u * stride).to(tl.int64)  # floor, as u * stride >= 0
    tl.store(OUT + b * m + slot, slot * stride + offset, mask=slot < m)


def _on(device: torch.device):
    """Launch on ``device`` (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def selection_keys(
    key: Tensor, stream_name: str, valid: Tensor | None, batch: int, n: int, *,
    rank: Tensor | None, valid_before: Tensor | None, rows_before: int, padded_key: int,
) -> Tensor:
    """``landmarks.selection_keys(rng.stream(key, stream_name), ...)`` in one launch.

    ``rank``: ``rng.valid_rank`` of the rows when ``valid`` is given (else None: the
    kernel counts positions, offset by ``valid_before``).
    """
    out = torch.empty(batch, n, dtype=torch.long, device=key.device)
    if batch == 0 or n == 0:
        return out
    with _on(key.device):
        _selection_keys_kernel[row_grid(batch, n)](
            key.contiguous(),
            out if rank is None else rank.contiguous(),
            out if valid is None else valid.contiguous().view(torch.uint8),  # bool mask
            out if valid_before is None
            else valid_before.to(key.device, torch.long).contiguous(),
            out, batch, n, rng.stream_data(stream_name), 0, rows_before,
            HAS_RANK=rank is not None, HAS_VALID=valid is not None,
            HAS_BEFORE=valid_before is not None, SALT=rng.UNIFORM_SALT, PADDED=padded_key,
            BLOCK=BLOCK,
        )
    return out


def paired_selection_keys(key: Tensor, stream_names: tuple[str, str], batch: int, n: int
                          ) -> Tensor:
    """``[2 B, n]``: ``selection_keys`` of every row under each of the two streams (the
    first's ``B`` rows, then the second's) in one launch, for rows without padding (the
    keys of both sides of a call whose queries and keys have one length)."""
    out = torch.empty(2 * batch, n, dtype=torch.long, device=key.device)
    if batch == 0 or n == 0:
        return out
    first, second = map(rng.stream_data, stream_names)
    with _on(key.device):
        _selection_keys_kernel[row_grid(2 * batch, n)](
            key.contiguous(), out, out, out, out, batch, n, first, second, 0,
            HAS_RANK=False, HAS_VALID=False, HAS_BEFORE=False, SALT=rng.UNIFORM_SALT,
            PADDED=0, BLOCK=BLOCK,
        )
    return out


def slot_ranks(key: Tensor, stream_name: str, batch: int, num_features: int,
               stride: int | Tensor) -> Tensor:
    """``[B, m]`` long: slot s takes the real token of rank s R + floor(u_s R), u_s the
    float64 ``rng.uniform_at`` of s under ``fold_in(stream(key, stream_name), b)``; R an
    int or a ``[B]`` long tensor (one per batch element)."""
    per_element = isinstance(stride, Tensor)
    if per_element:
        if tuple(stride.shape) != (batch,):
            raise ValueError(f"slot_ranks: a stride tensor needs one stride per batch "
                             f"element, shape ({batch},), got {tuple(stride.shape)}.")
        stride = stride.to(key.device, torch.long).contiguous()
    out = torch.empty(batch, num_features, dtype=torch.long, device=key.device)
    if batch == 0 or num_features == 0:
        return out
    with _on(key.device):
        _slot_ranks_kernel[(batch, cdiv(num_features, BLOCK))](
            key.contiguous(), out, num_features, rng.stream_data(stream_name), stride,
            SALT=rng.UNIFORM_SALT, LOW_SALT=rng.UNIFORM_LOW_SALT, BLOCK=BLOCK,
            PER_ELEMENT=per_element,
        )
    return out
