"""Error metrics, rank-m floors, baselines and stable rank against numpy/scipy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from skyformer.eval.measure.metrics import (
    constant_row_error,
    rank_m_floor,
    relative_error,
    singular_values,
    spectral_norm,
    stable_rank,
    trivial_error,
)
from tests.conftest import gen


def batch(shape=(2, 3, 50, 8), seed=0):
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def test_spectral_norm_per_head_matches_scipy():
    x = batch()
    got = spectral_norm(x)
    assert got.shape == (2, 3)
    for b in range(2):
        for h in range(3):
            expected = scipy.linalg.svdvals(x[b, h].numpy())[0]
            assert got[b, h].item() == pytest.approx(expected, rel=1e-12)
            assert got[b, h].item() == pytest.approx(np.linalg.norm(x[b, h].numpy(), 2), rel=1e-12)


def test_relative_error_per_head_matches_numpy():
    exact = batch(seed=1)
    approx = exact + 0.1 * batch(seed=2)
    for ord_, np_ord in ((2, 2), ("fro", "fro")):
        got = relative_error(approx.float(), exact.float(), ord=ord_)
        for b in range(2):
            for h in range(3):
                e, a = exact[b, h].float().double().numpy(), approx[b, h].float().double().numpy()
                ref = np.linalg.norm(a - e, np_ord) / np.linalg.norm(e, np_ord)
                assert got[b, h].item() == pytest.approx(ref, rel=1e-10)
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(approx[..., :4], exact)


def test_singular_values_and_stable_rank():
    x = batch((4, 30, 12), seed=3)
    s = singular_values(x)
    for i in range(4):
        np.testing.assert_allclose(s[i].numpy(), scipy.linalg.svdvals(x[i].numpy()), rtol=1e-12)
        ref = np.linalg.norm(x[i].numpy(), "fro") ** 2 / np.linalg.norm(x[i].numpy(), 2) ** 2
        assert stable_rank(x)[i].item() == pytest.approx(ref, rel=1e-12)
    assert (stable_rank(x) >= 1).all() and (stable_rank(x) <= 12).all()
    rank_one = torch.ones(5, 1, dtype=torch.float64) * torch.tensor([[1.0, 2.0, 3.0]])
    assert stable_rank(rank_one).item() == pytest.approx(1.0)
    assert stable_rank(torch.zeros(3, 3)).item() == 0.0


def test_rank_m_floor_is_truncated_svd_times_v():
    g = gen(4)
    a = torch.softmax(torch.randn(2, 40, 40, generator=g, dtype=torch.float64) * 2, dim=-1)
    v = torch.randn(2, 40, 6, generator=g, dtype=torch.float64)
    exact = a @ v
    u, _, _ = torch.linalg.svd(a)
    ranks = [1, 5, 20, 40]
    got = rank_m_floor(u[..., :40], exact, ranks)
    got_f = rank_m_floor(u[..., :40], exact, ranks, ord="fro")
    assert got.shape == (4, 2)
    for i in range(2):
        uu, s, vt = scipy.linalg.svd(a[i].numpy())
        for j, m in enumerate(ranks):
            a_m = (uu[:, :m] * s[:m]) @ vt[:m]
            o, o_m = exact[i].numpy(), a_m @ v[i].numpy()
            ref = np.linalg.norm(o_m - o, 2) / np.linalg.norm(o, 2)
            ref_f = np.linalg.norm(o_m - o, "fro") / np.linalg.norm(o, "fro")
            assert got[j, i].item() == pytest.approx(ref, rel=1e-8, abs=1e-13)
            assert got_f[j, i].item() == pytest.approx(ref_f, rel=1e-8, abs=1e-13)
    assert (got[-1] < 1e-12).all()  # rank N: exact
    with pytest.raises(ValueError, match="basis has 5 vectors"):
        rank_m_floor(u[..., :5], exact, [6])


def test_constant_row_baselines():
    g = gen(5)
    o = torch.randn(3, 20, 4, generator=g, dtype=torch.float64)
    best = constant_row_error(o, ord="fro")
    for i in range(3):
        # the mean row is the Frobenius-optimal constant row: any other row does worse
        for _ in range(5):
            other = o[i].mean(0) + 0.1 * torch.randn(4, generator=g, dtype=torch.float64)
            assert constant_row_error(o[i], other, ord="fro") > best[i]
    constant = torch.ones(20, 1, dtype=torch.float64) * torch.tensor([[1.0, 2.0, 3.0]])
    assert constant_row_error(constant).item() == pytest.approx(0.0, abs=1e-15)
    assert constant_row_error(o, torch.zeros(3, 4)).allclose(torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("ord", [2, "fro"])
def test_a_matrix_with_a_non_finite_entry_has_error_nan_and_the_others_theirs(ord):
    """The spectral norm's SVD refuses a non-finite matrix (it stopped approx, bench and
    compare); that matrix's error is NaN and every other matrix keeps its own."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=g)
    approx = exact + 0.1 * torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=g)
    want = relative_error(approx, exact, ord=ord)
    approx[1, 2, 0, 0] = float("nan")
    exact[0, 1, 3, 2] = float("inf")
    got = relative_error(approx, exact, ord=ord)
    bad = torch.zeros(2, 3, dtype=torch.bool)
    bad[1, 2] = bad[0, 1] = True
    assert got[bad].isnan().all()
    torch.testing.assert_close(got[~bad], want[~bad], rtol=0, atol=0)


@pytest.mark.parametrize("ord", [2, "fro"])
def test_the_error_against_an_output_of_tiny_entries_is_scale_free_and_nan_against_zero(ord):
    """The Gaussian target's output on queries far from every key has entries of 1e-200
    or less: its Frobenius norm underflowed to 0 (an answer of zeros scored 0, not 1), and
    an output that is zero (every kernel entry underflows) divided by the smallest float.
    The error is that of the scaled matrices; against a zero output it is NaN."""
    exact = batch(seed=1)
    approx = exact + 0.1 * batch(seed=2)
    want = relative_error(approx, exact, ord=ord)
    tiny = relative_error(approx * 1e-200, exact * 1e-200, ord=ord)
    torch.testing.assert_close(tiny, want, rtol=1e-12, atol=0)
    zeros = relative_error(torch.zeros_like(exact), exact * 1e-200, ord=ord)
    torch.testing.assert_close(zeros, torch.ones_like(want), rtol=1e-12, atol=0)
    exact[0, 1] = 0.0
    exact[1, 2] = 1e-320  # subnormal: no significant digits left
    got = relative_error(approx, exact, ord=ord)
    bad = torch.zeros(2, 3, dtype=torch.bool)
    bad[0, 1] = bad[1, 2] = True
    assert got[bad].isnan().all()
    torch.testing.assert_close(got[~bad], want[~bad], rtol=0, atol=0)


def test_the_trivial_error_against_a_head_with_no_relative_error_is_nan():
    """A head whose exact output is all zero has no relative error (NaN, as the methods'
    errors there): the trivial answer's mean read min(1.0, nan) = 1.0 beside them."""
    v = torch.randn(1, 2, 6, 3, generator=gen(0), dtype=torch.float64)
    exact = torch.randn(1, 2, 6, 3, generator=gen(1), dtype=torch.float64)
    assert 0 < trivial_error(v, exact) <= 1.0
    exact[:, 1] = 0.0
    assert np.isnan(trivial_error(v, exact))
