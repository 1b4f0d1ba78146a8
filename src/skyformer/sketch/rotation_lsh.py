"""Random-rotation LSH of Reformer (Kitaev et al. ICLR 2020, Section 2, after Andoni et al.).

To hash into b buckets (b even), draw a random matrix R of size [D, b/2] with N(0, 1)
entries and set h(x) = argmax([x R ; -x R]); nearby directions collide with high
probability. ``b = 1`` puts every vector in one bucket.

The number of buckets depends on the sequence length (Reformer picks b = 2 l / m for
chunks of m), so the columns of R are counter-based draws indexed by their position:
column c is the same whatever the total number of columns, and a sequence hashed with
the first b/2 columns hashes the same whether the draw went on for longer sequences of
the batch or not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rng import normal, random_key, stream


def draw_rotations(
    heads: int, rounds: int, dim: int, columns: int, *, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Random rotations ``[heads, rounds, dim, columns]``, one independent set per head and
    hash round; entry (h, r, d, c) is indexed by its position with the column last, so a
    prefix of columns does not depend on ``columns``. ``generator``: or a random key."""
    key = stream(random_key(generator, device), "rotations")
    if columns == 0:
        return torch.zeros((heads, rounds, dim, 0), device=device, dtype=dtype)
    return normal(key, (columns, heads, rounds, dim)).movedim(0, -1).to(dtype)


def rotation_hash(x: Tensor, rotations: Tensor, num_buckets: Tensor) -> Tensor:
    """Buckets h(x) = argmax([x R_b ; -x R_b]) with R_b the first ``num_buckets[b] / 2``
    columns, per batch element.

    The argmax over [xR, -xR] is the column of largest |xR|, in the first half if that
    entry is positive and in the second half otherwise: computed that way, without
    forming the doubled projection.

    Args:
        x: ``[B, H, N, D]``.
        rotations: ``[H, R, D, C]`` with C >= max(num_buckets) / 2.
        num_buckets: ``[B]`` long, each 1 or even (an odd count hashes into one bucket
            fewer; not checked: a check of a tensor's values is a host read, or a
            device-side assert that ends a GPU process, on every Reformer call, whose
            counts are even by construction).
    Returns:
        ``[B, R, H, N]`` long buckets in ``[0, num_buckets[b])``.
    """
    b, h, n, d = x.shape
    rounds, columns = rotations.shape[1], rotations.shape[-1]
    if columns == 0:
        return torch.zeros((b, rounds, h, n), dtype=torch.long, device=x.device)
    flat = rotations.to(x.dtype).permute(0, 2, 1, 3).reshape(h, d, rounds * columns)
    proj = (x @ flat).view(b, h, n, rounds, columns)  # [B, H, N, R, C]
    half = (num_buckets // 2).view(b, 1, 1, 1)
    live = torch.arange(columns, device=x.device) < half[..., None]  # [B, 1, 1, 1, C]
    magnitude = proj.abs().masked_fill(~live, -1.0)
    column = magnitude.argmax(dim=-1)  # [B, H, N, R]
    positive = proj.gather(-1, column[..., None])[..., 0] >= 0
    bucket = torch.where(positive, column, column + half)
    bucket = bucket.masked_fill((num_buckets <= 1).view(b, 1, 1, 1), 0)
    return bucket.permute(0, 3, 1, 2)

