"""Top singular subspace: exact path = SVD; randomized path close to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyformer.linalg import top_singular_subspace
from tests.conftest import gen


def decaying(n: int, m: int, batch: int = 2, decay: float = 0.9, seed: int = 0) -> torch.Tensor:
    """Random [batch, n, m] matrices with singular values decay^i."""
    g = gen(seed)
    u = torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(batch, m, m, generator=g, dtype=torch.float64)).Q
    r = min(n, m)
    s = decay ** torch.arange(r, dtype=torch.float64)
    return u[..., :r] * s @ v[..., :r].transpose(-1, -2)


def projector_gap(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """||U1 U1^T - U2 U2^T||_2 per batch element."""
    p = u1 @ u1.transpose(-1, -2) - u2 @ u2.transpose(-1, -2)
    return torch.linalg.matrix_norm(p, ord=2)


def test_exact_path_matches_numpy_svd():
    a = decaying(40, 30)
    sub = top_singular_subspace(a, 7, exact_below=64)
    assert sub.exact and sub.u.shape == (2, 40, 7) and sub.s.shape == (2, 7)
    for i in range(2):
        u, s, _ = np.linalg.svd(a[i].numpy())
        np.testing.assert_allclose(sub.s[i].numpy(), s[:7], rtol=1e-10)
        gap = projector_gap(sub.u[i], torch.from_numpy(u[:, :7]))
        assert gap < 1e-8


def test_randomized_path_finds_the_top_subspace():
    a = decaying(200, 150, decay=0.9)
    exact = top_singular_subspace(a, 10, exact_below=1000)
    approx = top_singular_subspace(a, 10, generator=gen(1), oversample=20, power_iterations=3,
                                   exact_below=0)
    assert not approx.exact
    torch.testing.assert_close(approx.s, exact.s, rtol=1e-8, atol=0)
    # sigma_31 / sigma_10 = 0.9^20 = 0.12 and 7 products: the subspaces agree to ~1e-10
    assert (projector_gap(approx.u, exact.u) < 1e-6).all()
    u = approx.u
    eye = torch.eye(10, dtype=u.dtype).expand(2, -1, -1)
    torch.testing.assert_close(u.transpose(-1, -2) @ u, eye)


def test_randomized_path_is_deterministic_given_a_generator():
    a = decaying(300, 300).float()
    one = top_singular_subspace(a, 10, generator=gen(3), exact_below=0)
    two = top_singular_subspace(a, 10, generator=gen(3), exact_below=0)
    assert torch.equal(one.u, two.u)


def test_wide_blocks_fall_back_to_the_full_svd():
    a = decaying(100, 100)
    assert top_singular_subspace(a, 40, oversample=20, exact_below=0).exact  # 2 (40+20) >= 100


def test_bad_rank():
    with pytest.raises(ValueError, match=r"k must be in 1..30"):
        top_singular_subspace(torch.zeros(40, 30), 31)
