"""Scatterbrain against its materialised reference, limits and unbiasedness."""

from __future__ import annotations

import math

import pytest
import torch

from skyformer import softmax_attention
from skyformer.ops.kdeformer.naive import reference_block_pattern
from skyformer.ops.performer import performer_attention
from skyformer.ops.performer.naive import performer_scores
from skyformer.ops.scatterbrain import ScatterbrainConfig, scatterbrain_attention
from skyformer.ops.scatterbrain.naive import reference_scatterbrain_attention
from skyformer.ops.scatterbrain.scatterbrain import draw_scatterbrain
from skyformer.registry import get_method
from skyformer.sketch import draw_hyperplanes, gaussian_projection, softmax_log_features
from tests.conftest import gen, make_qkv

OPTIONS = [
    {"num_features": 8},
    {"num_features": 6, "block_size": 5, "num_hyperplanes": 3, "orthogonal": False},
    {"num_features": 8, "block_size": 0},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq", [21, 12])
def test_fast_matches_reference_outputs_and_gradients(options, nq):
    q, k, v = make_qkv(2, 2, nq, 6, nk=21, dv=5, seed=1)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, 16:] = False
    mask[1, :3] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    w, planes = draw_scatterbrain(2, 2, 6, ScatterbrainConfig(**options), generator=gen(2))
    ref = reference_scatterbrain_attention(q, k, v, w.double(), planes, key_padding_mask=mask,
                                           **options)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_one_bucket_holding_every_key_is_exact_softmax():
    """The support covers A: the low-rank part cancels exactly."""
    q, k, v = make_qkv(2, 2, 20, 8, seed=3)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    out = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8,
                                 block_size=20)
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


def test_no_sparse_part_is_performer_with_the_same_features():
    q, k, v = make_qkv(1, 2, 18, 8, seed=4)
    a = scatterbrain_attention(q, k, v, generator=gen(5), num_features=16, block_size=0)
    b = performer_attention(q, k, v, generator=gen(5), num_features=16)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_estimate_is_unbiased_and_exact_on_the_support():
    """A~ = phi phi^T + S: exact on the LSH support, the Performer estimate elsewhere,
    so E[A~] = A (mean over independent feature draws within 4 standard errors)."""
    draws, m, d, n = 3000, 12, 6, 10
    q, k, _ = make_qkv(1, 1, n, d, seed=6, scale=0.8)
    exact = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(d))[0, 0]
    planes = draw_hyperplanes((1, 1), d, 2, generator=gen(7), dtype=q.dtype)
    support = reference_block_pattern(q, k, planes, 4)[0, 0]
    assert 0 < support.sum() < n * n
    w = gaussian_projection(draws * m, d, generator=gen(8)).double()  # m = 2d: one draw per 12 rows
    qs, ks = q[0, 0] * d**-0.25, k[0, 0] * d**-0.25
    fq = softmax_log_features(qs, w).exp().view(n, draws, m)
    fk = softmax_log_features(ks, w).exp().view(n, draws, m)
    low = torch.einsum("idf,jdf->dij", fq, fk) / m  # phi(Q) phi(K)^T of each draw
    torch.testing.assert_close(low[1], performer_scores(q, k, w[m : 2 * m])[0, 0])
    approx = low + (exact - low) * support
    torch.testing.assert_close(approx[:, support], exact[support].expand(draws, -1))
    mean, stderr = approx.mean(0), approx.std(0) / math.sqrt(draws)
    off = ~support
    assert torch.all((mean - exact)[off].abs() < 4 * stderr[off])


def test_defaults_follow_the_published_settings():
    cfg = get_method("scatterbrain").make_config()
    assert (cfg.num_features, cfg.blocks, cfg.num_hyperplanes, cfg.orthogonal) == (128, 64, 7, True)


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"block_size": -3}, "block_size"),
        ({"num_hyperplanes": 0}, "num_hyperplanes"),
        ({"orthogonal": None}, "orthogonal"),
        ({"scale": float("nan")}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            scatterbrain_attention(q, k, v, **options)
