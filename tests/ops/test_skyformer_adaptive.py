"""skyformer_adaptive against a naive Nystrom reference, its leverage scores and limits."""

from __future__ import annotations

import pytest
import torch

from skyformer import attention, kernelized_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.ops.shared.inputs import check_attention_inputs
from skyformer.ops.skyformer_adaptive import SkyformerAdaptiveConfig, skyformer_adaptive_attention
from skyformer.ops.skyformer_adaptive.naive import reference_skyformer_adaptive_attention
from skyformer.ops.skyformer_adaptive.skyformer_adaptive import adaptive_landmarks
from skyformer.sketch.kmeans import kmeans_clusters
from skyformer.sketch.leverage import sketched_ridge_leverage
from tests.conftest import gen, make_qkv


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("pinv", ["iterative", "exact"])
def test_fast_matches_naive_reference(masked, pinv):
    q, k, v = make_qkv(2, 2, 30, 8, seed=3)
    mask = None
    if masked:
        mask = torch.ones(2, 30, dtype=torch.bool)
        mask[0, 22:] = False
        mask[1, :4] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    options = {"num_features": 12, "query_fraction": 0.25, "pinv": pinv}
    fast = skyformer_adaptive_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    info = check_attention_inputs(q, k, v, mask, method="test")
    scale = q.shape[-1] ** -0.25
    lm = adaptive_landmarks(q.detach() * scale, k.detach() * scale, info,
                            SkyformerAdaptiveConfig(**options), gen(2))
    assignment = kmeans_clusters(q.detach() * scale, lm.centres, valid=info.query_valid,
                                 generator=gen(2), sample=2048).assignment
    ref = reference_skyformer_adaptive_attention(
        q, k, v, assignment, lm.key_index, lm.key_live, mask, 0.1, pinv, 6
    )
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    if pinv == "iterative":  # eigh's gradient is not a fair target for exact pinv
        for a, b in zip(
            torch.autograd.grad(fast.sum(), (q, k, v)),
            torch.autograd.grad(ref.sum(), (q, k, v)),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_sketched_leverage_matches_the_explicit_formula():
    g = gen(0)
    p = torch.rand(2, 3, 5, 40, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    scores = sketched_ridge_leverage(p, 1e-2, mask)
    for b in range(2):
        for h in range(3):
            cols = p[b, h][:, mask[b]]
            gram = cols @ cols.T
            lam = 1e-2 * gram.diagonal().mean()
            inv = torch.linalg.inv(gram + lam * torch.eye(5, dtype=torch.float64))
            expected = torch.einsum("sj,st,tj->j", cols, inv, cols)
            torch.testing.assert_close(scores[b, h][mask[b]], expected)
            assert torch.isinf(scores[b, h][~mask[b]]).all()


@pytest.mark.parametrize("masked", [False, True])
def test_every_query_and_key_as_landmark_is_exact(masked):
    """Exactness limit: each query its own centre, every key chosen, gamma = 0 and an
    exact inverse reproduce kernelized attention."""
    q, k, v = make_qkv(2, 2, 10, 8, seed=4)
    mask = None
    if masked:
        mask = torch.ones(2, 10, dtype=torch.bool)
        mask[1, 7:] = False
    out = skyformer_adaptive_attention(
        q,
        k,
        v,
        key_padding_mask=mask,
        generator=gen(0),
        num_features=20,
        query_fraction=0.5,
        gamma=0.0,
        pinv="exact",
    )
    torch.testing.assert_close(
        out, kernelized_attention(q, k, v, key_padding_mask=mask), rtol=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("nk, query_fraction", [(40, 0.25), (24, 1.0)])
def test_few_real_queries_spend_the_budget_as_their_truncation(nk, query_fraction):
    """A sequence with fewer real queries than centre slots gives the slots no query holds
    to keys, as its truncation does: padding equals truncation in cross-attention and
    with query_fraction > 1/2 (there the padded width left keys fewer slots)."""
    q, k, v = make_qkv(2, 2, 24, 8, nk=nk, seed=6)
    real = torch.zeros(2, 24, dtype=torch.bool)
    real[0, [1, 4, 9]] = True  # 3 real queries, holes anywhere
    real[1, 2:] = True  # enough real queries for every centre slot
    masks = {"query_padding_mask": real} if nk != 24 else {"key_padding_mask": real}
    options = {"num_features": 16, "query_fraction": query_fraction}
    padded = skyformer_adaptive_attention(q, k, v, generator=gen(1), **masks, **options)
    rows = real[0].nonzero()[:, 0]
    keys = rows if nk == 24 else torch.arange(nk)
    # the draws are indexed by the batch element: the first agrees with a batch of one
    alone = skyformer_adaptive_attention(q[:1, :, rows], k[:1, :, keys], v[:1, :, keys],
                                         generator=gen(1), **options)
    torch.testing.assert_close(padded[:1, :, rows], alone, rtol=1e-9, atol=1e-11)
    assert torch.all(padded[0][:, ~real[0]] == 0)


def test_beats_uniform_landmarks_when_a_few_keys_carry_the_mass():
    """A few 'sink' keys near every query (as [CLS]/[SEP] in BERT): leverage finds them,
    a uniform sample of [Q; K] mostly misses them."""
    g = gen(5)
    n, d = 256, 16
    q = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) * 2.5
    k[:, :, :4] = q.mean(2, keepdim=True) + 0.3 * torch.randn(
        1, 2, 4, d, generator=g, dtype=torch.float64
    )
    v = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64)
    exact = kernelized_attention(q, k, v)

    def error(method):
        return (
            torch.stack(
                [
                    relative_error(
                        attention(q, k, v, method, generator=gen(s), num_features=16), exact
                    ).mean()
                    for s in range(3)
                ]
            )
            .mean()
            .item()
        )

    assert error("skyformer_adaptive") < 0.5 * error("skyformer")


def test_bad_options_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"query_fraction": 0.0}, "query_fraction"),
        ({"query_fraction": 1.5}, "query_fraction"),
        ({"ridge": 0.0}, "ridge"),
        ({"kmeans_iterations": -1}, "kmeans_iterations"),
        ({"kmeans_sample": 0}, "kmeans_sample"),
        ({"gamma": -1.0}, "gamma"),
        ({"num_features": 0}, "num_features"),
    ):
        with pytest.raises(ValueError, match=word):
            skyformer_adaptive_attention(q, k, v, **options)


def test_query_fraction_takes_numpy_scalars_as_every_float_option_does():
    """query_fraction=np.float32(0.5) was refused as out of (0, 1]."""
    import numpy as np

    q, k, v = make_qkv(1, 1, 8, 4)
    torch.testing.assert_close(
        skyformer_adaptive_attention(q, k, v, num_features=4, query_fraction=np.float32(0.5),
                                     generator=gen(0)),
        skyformer_adaptive_attention(q, k, v, num_features=4, query_fraction=0.5,
                                     generator=gen(0)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"query_fraction must be a number in \(0, 1\], got "
                                         r"'0\.5'\."):
        skyformer_adaptive_attention(q, k, v, query_fraction="0.5")
