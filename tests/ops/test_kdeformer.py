"""KDEformer (Algorithm 3) against its materialised reference, limits, sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from skyformer import softmax_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.ops.kdeformer import KDEformerConfig, kdeformer_attention
from skyformer.ops.kdeformer.kdeformer import (
    draw_kdeformer,
    sampling_log_probabilities,
    uniform_rows,
)
from skyformer.ops.kdeformer.naive import reference_kdeformer_attention
from skyformer.registry import get_method
from tests.conftest import gen, make_qkv

OPTIONS = [
    {"num_features": 8},
    {"num_features": 8, "normalizer": "kde"},
    {"num_features": 8, "block_size": 0},
    {"num_features": 6, "block_size": 5, "kde_samples": 9, "num_hyperplanes": 3},
]


def draws_for(q, seed, **options):
    return draw_kdeformer(q.shape[0], q.shape[1], q.shape[-1], KDEformerConfig(**options),
                          generator=gen(seed))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq", [22, 13])
def test_fast_matches_reference_outputs_and_gradients(options, nq):
    q, k, v = make_qkv(2, 2, nq, 6, nk=22, dv=5, seed=1)
    mask = torch.ones(2, 22, dtype=torch.bool)
    mask[0, 18:] = False
    mask[1, :3] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = kdeformer_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    ref = reference_kdeformer_attention(q, k, v, draws_for(q, 2, **options),
                                        key_padding_mask=mask, **options)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("normalizer", ["kde", "sampled"])
def test_one_block_holding_every_column_is_exact_softmax(normalizer):
    """All columns in the exact sparse part: A_res = 0, alpha = D."""
    q, k, v = make_qkv(2, 2, 20, 8, seed=3)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 14:] = False
    out = kdeformer_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8,
                              block_size=20, normalizer=normalizer)
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalizer", ["kde", "sampled"])
def test_error_falls_as_samples_grow(normalizer):
    """More sampled columns (fixed blocks) approximate better, averaged over draws."""
    q, k, v = make_qkv(1, 2, 96, 16, seed=4, scale=0.8)
    exact = softmax_attention(q, k, v)
    means = []
    for m in (8, 64, 512):
        errs = [relative_error(kdeformer_attention(q, k, v, generator=gen(s), num_features=m,
                                                   block_size=16, kde_samples=96,
                                                   normalizer=normalizer), exact).mean()
                for s in range(4)]
        means.append(torch.stack(errs).mean().item())
    assert all(b < a for a, b in itertools.pairwise(means)), means


def test_sampling_distribution_is_algorithm_3_line_3():
    """p_j ∝ residual column norm^2 + ||v_j||^2 / ||V||_op^2, over real keys only."""
    g = gen(5)
    v = torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64)
    norms = torch.rand(1, 2, 9, generator=g, dtype=torch.float64)
    valid = torch.ones(1, 9, dtype=torch.bool)
    valid[0, 7:] = False
    p = sampling_log_probabilities(norms.log(), v, valid).exp()
    vr = v[..., :7, :]
    gamma = torch.linalg.matrix_norm(vr, ord=2) ** -2
    expected = norms[..., :7] + gamma[..., None] * (vr * vr).sum(-1)
    torch.testing.assert_close(p[..., :7], expected / expected.sum(-1, keepdim=True))
    assert torch.all(p[..., 7:] == 0)
    # nothing to weigh: uniform over the real keys
    flat = sampling_log_probabilities(torch.full_like(norms, -math.inf), torch.zeros_like(v), valid)
    torch.testing.assert_close(
        flat.exp()[..., :7], torch.full((1, 2, 7), 1 / 7, dtype=torch.float64)
    )


def test_uniform_rows_pick_real_rows_in_sequence_order():
    valid = torch.tensor([[False, True, True, False, True], [False] * 5])
    u = torch.tensor([0.0, 0.34, 0.67, 0.9999999]).view(1, 1, 4).expand(2, 1, 4)
    index, live = uniform_rows(u, valid)
    assert index[0, 0].tolist() == [1, 2, 4, 4]
    assert live[0].all() and not live[1].any()


def test_sampled_normaliser_gives_convex_combinations():
    """normalizer="sampled" divides by the same estimate applied to 1: the weights of
    each row sum to one, so constant values come back exactly."""
    q, k, v = make_qkv(1, 2, 40, 8, seed=6)
    out = kdeformer_attention(
        q, k, torch.ones_like(v), generator=gen(1), num_features=16, normalizer="sampled"
    )
    torch.testing.assert_close(out, torch.ones_like(out), rtol=1e-12, atol=1e-12)


def test_default_normaliser_stays_bounded_on_peaked_rows():
    """Large norms make rows peaked; with few samples the default output stays a convex
    combination of values (the literal alpha normaliser does not: module docstring)."""
    q, k, v = make_qkv(2, 2, 120, 32, dtype=torch.float32, seed=7)
    q = q / q.norm(dim=-1, keepdim=True) * 30
    k = k / k.norm(dim=-1, keepdim=True) * 30
    for options in ({"num_features": 8}, {"num_features": 8, "block_size": 0}):
        out = kdeformer_attention(q, k, v, generator=gen(0), **options)
        assert torch.isfinite(out).all()
        assert out.abs().max() <= v.abs().max() * (1 + 1e-5)


def test_defaults_follow_the_paper():
    cfg = get_method("kdeformer").make_config()
    assert (cfg.num_features, cfg.blocks, cfg.samples, cfg.num_hyperplanes, cfg.normalizer) == (
        128,
        64,
        128,
        7,
        "sampled",
    )


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"block_size": -1}, "block_size"),
        ({"num_hyperplanes": 0}, "num_hyperplanes"),
        ({"num_hyperplanes": 40}, "num_hyperplanes"),
        ({"kde_samples": 0}, "kde_samples"),
        ({"normalizer": "exact"}, "normalizer"),
        ({"scale": -2.0}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            kdeformer_attention(q, k, v, **options)
