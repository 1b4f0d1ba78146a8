"""Spectra of the softmax matrix, its sparse residual and the outputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from skyformer.eval.approx.spectra import attention_spectra, lsh_mask, oracle_mask, topk_mask
from skyformer.linalg import softmax_scores
from skyformer.sketch import draw_hyperplanes, hamming_blocks
from tests.conftest import gen, make_qkv


def test_topk_mask_keeps_the_largest_entries():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.9], [4.0, 3.0, 2.0, 1.0]]])
    mask = topk_mask(scores, 2)
    assert mask.tolist() == [[[False, True, False, True], [True, True, False, False]]]
    assert topk_mask(scores, 10).all()


def test_lsh_mask_is_kdeformers_equal_sized_buckets():
    q, k, _ = (t[0] for t in make_qkv(1, 2, 32, 8, seed=3))
    probs = softmax_scores(q[None], k[None])[0]
    mask = lsh_mask(8, bits=3, seed=1)(q, k, probs)
    assert mask.shape == (2, 32, 32) and mask.dtype == torch.bool
    assert (mask.sum(-1) == 8).all() and (mask.sum(-2) == 8).all()  # 4 buckets of 8 x 8
    g = gen(1)
    planes = draw_hyperplanes((1, 2), 8, 3, dtype=q.dtype, generator=g)
    blocks = hamming_blocks(q[None], k[None], planes, 8)
    same = blocks.q_block[0][..., :, None] == blocks.k_block[0][..., None, :]
    assert torch.equal(mask, same)
    assert torch.equal(mask, lsh_mask(8, bits=3, seed=1)(q, k, probs))  # seeded
    # the hash ignores scale: queries scaled by s/sqrt(d) land in the same buckets
    assert torch.equal(mask, lsh_mask(8, bits=3, seed=1)(q * 0.3, k, probs))
    with pytest.raises(ValueError, match="at least 1 key"):
        lsh_mask(0)


def test_spectra_match_numpy_and_limits():
    q, k, v = (t[0] for t in make_qkv(1, 2, 40, 8, seed=1, scale=1.5))
    def none(q, k, p):
        return torch.zeros_like(p, dtype=torch.bool)

    def every(q, k, p):
        return torch.ones_like(p, dtype=torch.bool)

    s = attention_spectra(q, k, v, {"oracle": oracle_mask(5), "none": none, "every": every})
    probs = softmax_scores(q[None], k[None])[0]
    oracle, nothing, everything = s.residuals
    for h in range(2):
        p = probs[h].numpy()
        np.testing.assert_allclose(s.softmax[h].numpy(), scipy.linalg.svdvals(p), rtol=1e-10,
                                   atol=1e-14)
        res = p.copy()
        for i in range(40):
            res[i, np.argsort(-p[i])[:5]] = 0.0
        np.testing.assert_allclose(oracle.singular_values[h].numpy(), scipy.linalg.svdvals(res),
                                   rtol=1e-10, atol=1e-14)
        out = p @ v[h].numpy()
        np.testing.assert_allclose(s.output[h].numpy(), scipy.linalg.svdvals(out), rtol=1e-10)
        assert s.softmax_srank[h].item() == pytest.approx(
            (scipy.linalg.svdvals(p) ** 2).sum() / scipy.linalg.svdvals(p)[0] ** 2)
    layer = np.concatenate([(probs[h] @ v[h]).numpy() for h in range(2)], axis=1)
    np.testing.assert_allclose(s.layer_output.numpy(), scipy.linalg.svdvals(layer), rtol=1e-10)
    assert s.softmax[:, 0].min() >= 1 - 1e-12  # a row-stochastic matrix has ||P||_2 >= 1
    assert oracle.density.allclose(torch.full((2,), 5 / 40, dtype=torch.float64))
    # removing nothing leaves the softmax matrix, removing everything leaves zero
    torch.testing.assert_close(nothing.singular_values, s.softmax)
    assert everything.singular_values.abs().max() == 0 and (everything.stable_rank == 0).all()
    with pytest.raises(ValueError, match="mask 'float' must be a bool tensor"):
        attention_spectra(q, k, v, {"float": lambda q, k, p: p})


def test_residual_of_the_largest_entries_has_smaller_frobenius_norm():
    g = gen(2)
    x = torch.randn(2, 64, 16, generator=g, dtype=torch.float64) * 2.0
    s = attention_spectra(x, x, x, {"oracle": oracle_mask(8), "lsh": lsh_mask(8)})
    for r in s.residuals:
        assert ((r.singular_values ** 2).sum(-1) < (s.softmax ** 2).sum(-1)).all()
    # no mask with 8 entries per row removes more Frobenius mass than the oracle
    oracle, lsh = s.residuals
    left_by_oracle = (oracle.singular_values ** 2).sum(-1)
    assert (left_by_oracle <= (lsh.singular_values ** 2).sum(-1) + 1e-12).all()
