"""The landmark selection keys of one stream in one Triton kernel.

``landmarks.selection_keys(stream(key, name), ...)`` is a few dozen integer tensor
operations (the hash rounds of ``rng``), each a kernel launch on a GPU: about half of
the launches of an eager Skyformer forward + backward at GPU speeds. This kernel
computes the same int64 keys ``[B, n]`` bit for bit in one launch: it derives the
stream key and the per-batch keys (``rng.fold_in``), hashes each row's rank
(``rng.uniform_at``, float32 branch: its 24 bits are the score) and packs (score, rank),
or ``PADDED_KEY`` + position for padded rows. Every step is the int64 arithmetic of
``rng`` transcribed (wrapping products, arithmetic shifts, 32-bit masks), so the keys
are equal for any key tensor, not only for keys below 2^32.

This module imports Triton; ``landmarks`` imports it only when the Triton path is
chosen, so the library runs without Triton installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import rng


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
    golden = tl.full(data.shape, 0x9E3779B9, tl.int64)
    data = data & mask
    a = _mix(k0 ^ _mix((data * golden) & mask))
    b = _mix(k1 ^ _mix(a + tl.full(data.shape, 0x632BE5AB, tl.int64)))
    return a, b


@triton.jit
def _selection_keys_kernel(
    KEY, RANK, VALID, BEFORE, OUT, n, stream_data, rows_before,
    HAS_RANK: tl.constexpr, HAS_VALID: tl.constexpr, HAS_BEFORE: tl.constexpr,
    SALT: tl.constexpr, PADDED: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = pos < n
    one = tl.full([1], 0, tl.int64)
    k0, k1 = _fold_in(tl.load(KEY + one), tl.load(KEY + 1 + one), one + stream_data)
    k0, k1 = _fold_in(k0, k1, one + b)  # the batch element's key
    if HAS_RANK:
        rank = tl.load(RANK + b * n + pos, mask=inside, other=0)
    else:
        rank = pos
        if HAS_BEFORE:
            rank += tl.load(BEFORE + b + one)
    # rng._bits(key, rank, salt), then uniform_at's 24-bit float32 score (its top bits)
    mask = tl.full(rank.shape, 0xFFFFFFFF, tl.int64)
    i = rank & mask
    h = _mix(((i * tl.full(rank.shape, 0x9E3779B9, tl.int64)) & mask) ^ k0)
    h = _mix(h ^ k1 ^ tl.full(rank.shape, SALT, tl.int64))
    h = _mix((h + i) & mask)
    keys = ((h >> 8) << 32) | rank
    if HAS_VALID:
        valid = tl.load(VALID + b * n + pos, mask=inside, other=0) != 0
        keys = tl.where(valid, keys, tl.full(pos.shape, PADDED, tl.int64) + rows_before + pos)
    tl.store(OUT + b * n + pos, keys, mask=inside)


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
    block = 1024
    _selection_keys_kernel[(batch, triton.cdiv(n, block))](
        key.contiguous(),
        out if rank is None else rank.contiguous(),
        out if valid is None else valid.contiguous().view(torch.uint8),
        out if valid_before is None else valid_before.to(key.device, torch.long).contiguous(),
        out, n, rng.stream_data(stream_name), rows_before,
        HAS_RANK=rank is not None, HAS_VALID=valid is not None,
        HAS_BEFORE=valid_before is not None, SALT=rng.UNIFORM_SALT, PADDED=padded_key,
        BLOCK=block,
    )
    return out
