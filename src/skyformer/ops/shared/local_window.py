"""The exact part on a sliding window of neighbouring keys (Scatterbrain's SBLocal support).

Query i sees the ``window`` keys j with -(w // 2) <= j - i < (w + 1) // 2 (positions in the
key sequence; for cross-attention the query's own index). Computed chunk by chunk: a chunk
of c queries and the c + w - 1 keys their windows cover, the entries outside each query's
band set to -inf, so memory is O(N (c + w)) and never N^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LocalWindows:
    """Chunked windows of one call: ``chunk`` queries per chunk, ``span`` = chunk + w - 1
    keys per chunk, ``band [nc, chunk, span]`` True inside a query's window on a real key
    position (padded keys are masked separately)."""

    window: int
    chunk: int
    chunks: int
    nq: int
    band: Tensor


def local_windows(nq: int, nk: int, window: int, device: torch.device) -> LocalWindows:
    """The chunk layout for ``nq`` queries over ``nk`` keys and windows of ``window`` keys."""
    chunk = max(min(window, nq), 1)
    chunks = math.ceil(nq / chunk)
    span = chunk + window - 1
    left = window // 2
    r = torch.arange(chunk, device=device)[:, None]
    t = torch.arange(span, device=device)[None, :]
    start = torch.arange(chunks, device=device)[:, None, None] * chunk
    key_pos = start + t - left  # [nc, 1, span] key index of each column
    band = (t >= r) & (t < r + window) & (key_pos >= 0) & (key_pos < nk)
    return LocalWindows(window, chunk, chunks, nq, band)


def window_rows(x: Tensor, layout: LocalWindows) -> Tensor:
    """Keys (or key-indexed rows) per chunk: ``[B, H, Nk, F] -> [B, H, nc, span, F]``, zero
    outside the sequence."""
    left = layout.window // 2
    length = layout.chunks * layout.chunk + layout.window - 1
    x = x[..., : max(length - left, 0), :]
    x = torch.nn.functional.pad(x, (0, 0, left, length - left - x.shape[-2]))
    return x.unfold(-2, layout.chunk + layout.window - 1, layout.chunk).transpose(-1, -2)


def query_chunks(x: Tensor, layout: LocalWindows) -> Tensor:
    """``[B, H, Nq, F] -> [B, H, nc, chunk, F]`` (zero rows past the end)."""
    pad = layout.chunks * layout.chunk - x.shape[-2]
    x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.unflatten(-2, (layout.chunks, layout.chunk))


def unchunk(x: Tensor, layout: LocalWindows) -> Tensor:
    """``[B, H, nc, chunk, F] -> [B, H, Nq, F]``."""
    return x.flatten(-3, -2)[..., : layout.nq, :]
