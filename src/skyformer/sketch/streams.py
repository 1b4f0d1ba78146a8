"""Random streams whose draws do not depend on the padded length or on other sequences.

Some samplers draw an amount of randomness that depends on how many *real* tokens a
sequence has: Informer samples ``c ln n`` keys for each real query, BigBird draws random
blocks among the real blocks. One tensor of draws for the whole batch would have a
shape, and therefore a layout of the generator's stream, that depends on the padded
length and on the other sequences. Instead, one draw of the caller's generator gives one
seed per batch element, and each element draws from its own generator seeded with it.
An element's draws then depend only on the caller's generator, its index in the batch
and its own number of real tokens: padding a sequence (anywhere) draws exactly what the
truncated sequence draws, on any device.

``derived_generator`` does the same for one draw whose columns must not depend on the
sequence length (Linformer's Gaussian projections): it draws fixed-size chunks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SEED_HIGH = 2**62


def derived_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A fresh generator on ``device`` seeded by one draw of ``generator``
    (the default generator when ``None``)."""
    seed = torch.randint(0, _SEED_HIGH, (1,), generator=generator, device=device)
    return torch.Generator(device=device).manual_seed(int(seed.item()))


def sequence_generators(
    batch: int, generator: torch.Generator | None, device: torch.device
) -> list[torch.Generator]:
    """One generator per batch element, seeded by one ``[batch]`` draw of ``generator``."""
    seeds = torch.randint(0, _SEED_HIGH, (batch,), generator=generator, device=device)
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]


def gaussian_columns(
    rows: tuple[int, ...],
    n: int,
    generator: torch.Generator | None,
    device: torch.device,
    *,
    chunk: int = 256,
) -> Tensor:
    """Standard normal matrix ``[*rows, n]`` whose first ``n'`` columns are the same
    for every ``n >= n'`` (float32).

    Columns are drawn in chunks of ``chunk`` positions, each chunk with the same shape,
    from a generator derived from ``generator``; ``torch.randn`` of different sizes
    does not share a prefix, equal-shaped draws in sequence do.
    """
    g = derived_generator(generator, device)
    chunks = [
        torch.randn((chunk, *rows), generator=g, device=device, dtype=torch.float32)
        for _ in range(max(1, math.ceil(n / chunk)))
    ]
    return torch.cat(chunks, dim=0)[:n].movedim(0, -1)
