"""Ridge leverage scores, statistical dimension and the Theorem 2 sample size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyformer.eval.approx.leverage import (
    THEOREM_CONSTANT,
    leverage_analysis,
    lifted_kernel,
    ridge_leverage_scores,
    theorem2_sample_sizes,
)
from skyformer.linalg import gaussian_scores
from tests.conftest import make_qkv


def test_lifted_kernel_is_psd_and_holds_c_off_the_diagonal():
    q, k, _ = make_qkv(1, 2, 30, 8, seed=0)
    cbar = lifted_kernel(q[0], k[0])
    assert cbar.shape == (2, 60, 60)
    torch.testing.assert_close(cbar, cbar.transpose(-1, -2))
    torch.testing.assert_close(cbar[:, :30, 30:], gaussian_scores(q, k)[0])
    torch.testing.assert_close(torch.diagonal(cbar, dim1=-2, dim2=-1),
                               torch.ones(2, 60, dtype=cbar.dtype))
    assert torch.linalg.eigvalsh(cbar).min() > -1e-10


def test_leverage_scores_match_the_eigen_formula():
    q, k, _ = make_qkv(1, 3, 25, 4, seed=1)
    cbar = lifted_kernel(q[0], k[0])
    lam = torch.tensor([0.5, 0.05, 0.005], dtype=torch.float64)
    scores = ridge_leverage_scores(cbar, lam)
    for h in range(3):
        w, u = np.linalg.eigh(cbar[h].numpy())
        w = np.clip(w, 0, None)
        ref = (u ** 2 * (w / (w + lam[h].item()))).sum(axis=1)  # diag(U W/(W+l) U^T)
        np.testing.assert_allclose(scores[h].numpy(), ref, rtol=1e-7, atol=1e-10)
        assert scores[h].sum().item() == pytest.approx((w / (w + lam[h].item())).sum(), rel=1e-8)
    assert ((scores >= 0) & (scores <= 1)).all()
    # d_stat grows as lambda shrinks, and tends to the rank of C_bar (full here)
    d = [ridge_leverage_scores(cbar[0], x).sum().item() for x in (1.0, 1e-2, 1e-8)]
    assert d[0] < d[1] < d[2] and d[2] == pytest.approx(50, abs=0.5)
    with pytest.raises(ValueError, match="lambda must be positive"):
        ridge_leverage_scores(cbar, 0.0)


def test_theorem2_sample_sizes():
    d_stat = torch.tensor([10.0], dtype=torch.float64)
    max_lev = torch.tensor([0.5], dtype=torch.float64)
    beta, d_theorem, d_shape = theorem2_sample_sizes(d_stat, max_lev, n=100, delta=0.1)
    assert beta.item() == pytest.approx(10 / (200 * 0.5))
    assert d_shape.item() == pytest.approx(100 * math.log(100 / 0.1))  # d_stat/beta = 2n max l
    assert d_theorem.item() == pytest.approx(56 / 3 * 100 * math.log(400 / 0.1))
    assert pytest.approx(56 / 3) == THEOREM_CONSTANT


def test_leverage_analysis_per_head():
    q, k, _ = make_qkv(1, 2, 32, 8, seed=2)
    res = leverage_analysis(q[0], k[0], 0.1, delta=0.1)
    c = gaussian_scores(q, k)[0]
    for h in range(2):
        norm = np.linalg.norm(c[h].numpy(), 2)
        assert res.norm_c[h].item() == pytest.approx(norm, rel=1e-10)
        assert res.lam[h].item() == pytest.approx(0.1 * norm, rel=1e-10)
    assert res.leverage.shape == (2, 64)
    assert (res.leverage[:, :-1] >= res.leverage[:, 1:]).all()  # sorted descending
    torch.testing.assert_close(res.d_stat, res.leverage.sum(-1))
    torch.testing.assert_close(res.max_leverage, res.leverage[:, 0])
    assert ((res.beta > 0) & (res.beta <= 1)).all()
    smaller = leverage_analysis(q[0], k[0], 0.01)
    assert (smaller.d_stat > res.d_stat).all()  # d_stat increases with 1/eps
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\)"):
        leverage_analysis(q[0], k[0], 1.5)
    with pytest.raises(ValueError, match="delta must be in"):
        leverage_analysis(q[0], k[0], 0.1, delta=0.7)
