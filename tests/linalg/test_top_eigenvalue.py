"""The largest eigenvalue by repeated squaring against torch.linalg.eigvalsh."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg.top_eigenvalue import top_eigenvalue_psd


def _psd(n: int, rank: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(3, rank, n, generator=g, dtype=torch.float64) * scale
    return y.transpose(-1, -2) @ y


@pytest.mark.parametrize("n, rank, scale", [(65, 200, 1.0), (17, 3, 1e-120), (9, 9, 1e100),
                                            (1, 1, 2.0), (33, 1, 0.5)])
def test_it_is_eigvalsh_top(n, rank, scale):
    g = _psd(n, rank, scale, seed=n)
    want = torch.linalg.eigvalsh(g)[..., -1]
    torch.testing.assert_close(top_eigenvalue_psd(g), want, rtol=1e-10, atol=0.0)


def test_a_repeated_top_eigenvalue_and_a_zero_matrix():
    q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(1)))
    g = q @ torch.diag(torch.tensor([4.0, 4.0, 4.0, 1.0, 0.0, 0.0], dtype=torch.float64)) @ q.T
    batch = torch.stack([g, torch.zeros_like(g)])
    torch.testing.assert_close(top_eigenvalue_psd(batch),
                               torch.tensor([4.0, 0.0], dtype=torch.float64), rtol=1e-10,
                               atol=0.0)


def test_few_squarings_overestimate_by_at_most_the_bound():
    """tr(G^(2^K))^(1/2^K) lies in [lambda_max, n^(1/2^K) lambda_max]."""
    g = torch.eye(8, dtype=torch.float64)  # every eigenvalue the top one: the bound exactly
    for k in (0, 1, 3):
        torch.testing.assert_close(top_eigenvalue_psd(g, squarings=k),
                                   torch.tensor(8.0 ** (1 / 2 ** k), dtype=torch.float64))
