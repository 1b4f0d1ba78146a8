"""Shared test helpers: random Q/K/V in the [B, H, N, D] layout."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def make_qkv(b=2, h=2, n=24, d=16, *, nk=None, dv=None, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    dv = d if dv is None else dv
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, nk, dv, generator=g, dtype=dtype)
    return q, k, v


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def qkv64():
    return make_qkv()
