"""Causal attention through feature maps, by chunked exclusive prefix sums.

Every causal method whose weights factor as a_ij = phi(q_i) . psi(k_j) (linear attention,
Performer, the causal Nystrom methods) computes

    out_i = sum_{j <= i} a_ij v_j

by chunks of L positions (Katharopoulos et al. 2020, eqs. (8)-(10), evaluated blockwise):
for query i in chunk c, the keys of earlier chunks contribute phi(q_i) . S_c with
S_c = sum_{c' < c} psi(K_c')^T V_c' an *exclusive* prefix sum over chunks ([m, Dv] per
chunk), and the keys of chunk c up to i a lower-triangular L x L block. That block is
phi(Q_c) psi(K_c)^T by default, or any exact local scores the caller passes (the causal
Nystrom methods use the exact kernel there). Output i depends on no position after i,
not even through rounding: S_c sums earlier chunks only, and the block is masked by
``where`` (exact zeros, also in the gradient).

Time O(N L m + N m Dv), memory O(N m Dv / L + N L): matmul-bound.

While ``torch.export`` traces (N may be a symbol, ``torch.export.Dim``, which its
strict mode does not show as one), the chunks are gathered rows of N followed by
padding, two chunks more than ceil(N / L): export cannot decide a size that is 1 at
some lengths of the Dim's range and more at others (a dim of size 1 broadcasts), so
C and the count of earlier chunks C - 1 are never 1 there, and it cannot divide
N + ((-N) mod L) by L for the view eager code takes. The padding rows come after
every real position, as in eager code, so the outputs are the same; eager and
compiled code keep ceil(N / L) chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg.functional_ops import exporting
from ...linalg.tracing import may_read_values

# Positions per chunk: the intra-chunk block is CAUSAL_CHUNK^2 per head, the prefix states
# (N / CAUSAL_CHUNK) m Dv, both O(N m) for m ~ CAUSAL_CHUNK.
CAUSAL_CHUNK = 64
# Chunks of padding appended while exporting (module docstring)
EXPORT_CHUNKS = 2
# Rows per block of a causal call that records no gradient (``by_blocks``)
STREAM_ROWS = 64 * CAUSAL_CHUNK


def by_blocks(n: int, *tensors: Tensor | None) -> bool:
    """Whether a causal call over ``n`` rows runs by blocks of ``STREAM_ROWS`` rows, each
    from the state of the keys before it: eager calls (a traced one keeps one graph
    whatever n) longer than a block that record no gradient through ``tensors``
    (inference, a prompt's prefill; a training call keeps its single pass). The
    features and chunk states of one block are held at a time, where the whole call
    held them for every row."""
    present = [t for t in tensors if t is not None]
    return n > STREAM_ROWS and may_read_values(*present) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in present))


def row_blocks(n: int, chunk: int = 1) -> list[slice]:
    """The blocks of ``n`` rows a call ``by_blocks`` takes: ``STREAM_ROWS`` rows each,
    rounded down to whole chunks of ``chunk`` rows (the exact local parts follow the
    chunk grid), the last one shorter."""
    size = max(1, STREAM_ROWS // chunk) * chunk
    return [slice(first, min(n, first + size)) for first in range(0, n, size)]


def chunk_length(n: int, chunk: int) -> int:
    """The chunk length L for ``n`` positions: ``chunk``, or ``n`` where fewer (a
    decoding step of one token is one chunk of one row, not of ``chunk`` rows of which
    all but one are padding: ~chunk^2 times the work of its block); ``chunk`` while
    exporting (module docstring). The sums are the same for any L."""
    return chunk if exporting() or n >= chunk else max(n, 1)


def chunk_rows(x: Tensor, chunk: int, fill: float = 0.0) -> Tensor:
    """``[B, H, N, F] -> [B, H, C, L, F]`` with C = ceil(N / L) (two more while
    exporting: module docstring), rows of ``fill`` appended."""
    b, h, n, f = x.shape
    if exporting():  # [C, L] row indices into a static padding, no view of N rows
        count = (n + chunk - 1) // chunk + EXPORT_CHUNKS
        rows = torch.arange(count, device=x.device)[:, None] * chunk \
            + torch.arange(chunk, device=x.device)
        return F.pad(x, (0, 0, 0, (EXPORT_CHUNKS + 1) * chunk), value=fill)[:, :, rows]
    pad = (-n) % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad), value=fill)
    return x.reshape(b, h, (n + pad) // chunk, chunk, f)


def unchunk_rows(x: Tensor, n: int) -> Tensor:
    """``[B, H, C, L, F] -> [B, H, N, F]``: the first ``n`` rows of the chunks."""
    rows = x.flatten(2, 3)
    if exporting():  # a slice would need n <= C L, which export cannot prove
        return rows.index_select(2, torch.arange(n, device=x.device))
    return rows[:, :, :n]


def per_row(x: Tensor, chunk: int, n: int) -> Tensor:
    """``[..., C] -> [..., N]``: each row gets the value of its chunk. An index, not
    ``unchunk_rows`` of ``x`` expanded over the chunk: inductor (torch 2.13, CPU) gave
    the rows of a last, partial chunk another chunk's value through that expand (or
    ``repeat_interleave``), which made causal ``nystrom_softmax``'s compiled gradients
    NaN under a padding mask."""
    return x.index_select(-1, torch.arange(n, device=x.device) // chunk)


def exclusive_chunk_sums(psi_k: Tensor, v: Tensor) -> Tensor:
    """S_c = sum_{c' < c} psi(K_c')^T V_c': ``[B, H, C, L, m]``, ``[B, H, C, L, Dv]``
    -> ``[B, H, C, m, Dv]`` (chunk 0 gets zeros)."""
    kv = psi_k.transpose(-1, -2) @ v  # [B, H, C, m, Dv]
    return torch.cat([torch.zeros_like(kv[:, :, :1]), kv.cumsum(2)[:, :, :-1]], dim=2)


def lower_triangle(scores: Tensor) -> Tensor:
    """Entries j > i of ``[..., L, L]`` set to exact zeros (values and gradients)."""
    size = scores.shape[-1]
    keep = torch.ones(size, size, dtype=torch.bool, device=scores.device).tril()
    return torch.where(keep, scores, 0.0)


def causal_feature_sums(phi_q: Tensor, psi_k: Tensor, v: Tensor, *,
                        chunk: int = CAUSAL_CHUNK, local: Tensor | None = None,
                        start: Tensor | None = None) -> Tensor:
    """sum_{j <= i} a_ij v_j by chunks (module docstring).

    Args:
        phi_q: ``[B, H, N, m]`` query features; psi_k: ``[B, H, N, m]`` key features
            (zero rows for padded keys); v: ``[B, H, N, Dv]``.
        chunk: L, positions per chunk.
        local: ``[B, H, C, L, L]`` scores of each chunk's queries against the same
            chunk's keys, replacing phi(Q_c) psi(K_c)^T (entries j > i are ignored).
        start: ``[B, H, m, Dv]`` sum psi(k_j)^T v_j of keys before these rows (a shard
            after others, sequence parallel), added to every chunk's state.
    Returns:
        ``[B, H, N, Dv]``.
    """
    n = phi_q.shape[2]
    if local is None:  # else its [L, L] blocks fix L
        chunk = chunk_length(n, chunk)
    q_c, k_c, v_c = (chunk_rows(t, chunk) for t in (phi_q, psi_k, v))
    before = exclusive_chunk_sums(k_c, v_c)  # [B, H, C, m, Dv]
    if start is not None:
        before = before + start[:, :, None]
    scores = q_c @ k_c.transpose(-1, -2) if local is None else local  # [B, H, C, L, L]
    out = q_c @ before + lower_triangle(scores) @ v_c  # [B, H, C, L, Dv]
    return unchunk_rows(out, n)


def prefix_mean_values(v: Tensor, key_valid: Tensor | None,
                       earlier: Tensor | None = None) -> Tensor:
    """Mean of the values of the real keys j <= i, ``[B, H, N, Dv]`` (zero before the
    first real key): the causal answer of uniform attention, for rows whose normaliser
    is lost. ``earlier: [B, H, 1, Dv + 1]``: the sums of [v_j, 1] over the real keys
    before these (the shards before this one, sequence parallel)."""
    if key_valid is None and earlier is None:
        count = torch.arange(1, v.shape[2] + 1, device=v.device, dtype=v.dtype)[:, None]
        return v.cumsum(2) / count
    if key_valid is None:
        real = v.new_ones(1, 1, v.shape[2], 1)
    else:
        real = key_valid[:, None, :, None].to(v.dtype)  # [B, 1, N, 1]
    sums, count = torch.where(real > 0, v, 0.0).cumsum(2), real.cumsum(2)
    if earlier is not None:
        sums, count = sums + earlier[..., :-1], count + earlier[..., -1:]
    return sums / count.clamp_min(1.0)
