"""Spectra of the softmax matrix, its sparse residual and the outputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from skyformer.eval.spectra import attention_spectra, oracle_mask, sorted_block_mask, topk_mask
from skyformer.ops.softmax import softmax_scores
from tests.conftest import gen, make_qkv


def test_topk_mask_keeps_the_largest_entries():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.9], [4.0, 3.0, 2.0, 1.0]]])
    mask = topk_mask(scores, 2)
    assert mask.tolist() == [[[False, True, False, True], [True, True, False, False]]]
    assert topk_mask(scores, 10).all()


def test_sorted_block_mask_is_equal_sized_buckets():
    keys = torch.tensor([3, 0, 2, 1, 5, 4])
    mask = sorted_block_mask(keys, keys, 2)
    # sorted order: positions 1 (0), 3 (1) | 2 (2), 0 (3) | 5 (4), 4 (5)
    expected = {(1, 3), (2, 0), (5, 4)}
    for i in range(6):
        for j in range(6):
            same = i == j or (i, j) in expected or (j, i) in expected
            assert mask[i, j].item() == same
    assert mask.sum(-1).tolist() == [2] * 6  # every bucket holds `block` keys
    q = torch.tensor([[0.1, 0.9, 0.5]])
    k = torch.tensor([[0.8, 0.2, 0.4, 0.6]])
    m = sorted_block_mask(q, k, 2)  # [1, 3, 4]
    assert m.shape == (1, 3, 4)
    assert m[0, 0].tolist() == [False, True, True, False]  # q0 sorts first, with k1, k2
    with pytest.raises(ValueError, match="block must be at least 1"):
        sorted_block_mask(q, k, 0)


def test_spectra_match_numpy_and_limits():
    q, k, v = (t[0] for t in make_qkv(1, 2, 40, 8, seed=1, scale=1.5))
    s = attention_spectra(q, k, v, oracle_mask(5), mask_name="oracle")
    probs = softmax_scores(q[None], k[None])[0]
    for h in range(2):
        p = probs[h].numpy()
        np.testing.assert_allclose(s.softmax[h].numpy(), scipy.linalg.svdvals(p), rtol=1e-10,
                                   atol=1e-14)
        res = p.copy()
        for i in range(40):
            res[i, np.argsort(-p[i])[:5]] = 0.0
        np.testing.assert_allclose(s.residual[h].numpy(), scipy.linalg.svdvals(res), rtol=1e-10,
                                   atol=1e-14)
        out = p @ v[h].numpy()
        np.testing.assert_allclose(s.output[h].numpy(), scipy.linalg.svdvals(out), rtol=1e-10)
        assert s.softmax_srank[h].item() == pytest.approx(
            (scipy.linalg.svdvals(p) ** 2).sum() / scipy.linalg.svdvals(p)[0] ** 2)
    layer = np.concatenate([(probs[h] @ v[h]).numpy() for h in range(2)], axis=1)
    np.testing.assert_allclose(s.layer_output.numpy(), scipy.linalg.svdvals(layer), rtol=1e-10)
    assert s.softmax[:, 0].min() >= 1 - 1e-12  # a row-stochastic matrix has ||P||_2 >= 1
    assert s.mask_density.allclose(torch.full((2,), 5 / 40, dtype=torch.float64))
    # removing nothing leaves the softmax matrix, removing everything leaves zero
    none = attention_spectra(q, k, v, lambda q, k, p: torch.zeros_like(p, dtype=torch.bool))
    torch.testing.assert_close(none.residual, none.softmax)
    every = attention_spectra(q, k, v, lambda q, k, p: torch.ones_like(p, dtype=torch.bool))
    assert every.residual.abs().max() == 0 and (every.residual_srank == 0).all()
    with pytest.raises(ValueError, match="mask_fn must return a bool tensor"):
        attention_spectra(q, k, v, lambda q, k, p: p)  # a float mask


def test_residual_of_the_largest_entries_has_smaller_frobenius_norm():
    g = gen(2)
    x = torch.randn(2, 64, 16, generator=g, dtype=torch.float64) * 2.0
    s = attention_spectra(x, x, x, oracle_mask(8))
    assert ((s.residual ** 2).sum(-1) < (s.softmax ** 2).sum(-1)).all()
