"""KDEformer (Algorithm 3) against its materialised reference, limits, sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import skyformer
from skyformer import softmax_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.ops.kdeformer import KDEformerConfig, kdeformer_attention
from skyformer.ops.kdeformer.kdeformer import (
    draw_columns,
    draw_kdeformer,
    row_estimate_probabilities,
    sampling_log_probabilities,
    uniform_rows,
    value_norm_probabilities,
)
from skyformer.ops.kdeformer.naive import reference_kdeformer_attention
from skyformer.registry import get_method
from tests.conftest import gen, make_qkv

OPTIONS = [
    {"num_features": 8},
    {"num_features": 8, "block_size": 0},
    {"num_features": 6, "block_size": 5, "kde_rows": 7, "mix": 0.3, "num_hyperplanes": 3},
    {"num_features": 8, "sampler": "iid", "mix": 1.0},
    {"num_features": 8, "mix": 0.0},
    # the earlier estimator (Algorithm 3 line 3 with uniform KDE samples)
    {"num_features": 8, "estimator": "uniform", "sampler": "iid"},
    {"num_features": 8, "estimator": "uniform", "normalizer": "kde"},
    {"num_features": 8, "estimator": "uniform", "block_size": 0},
    {"num_features": 6, "block_size": 5, "kde_samples": 9, "num_hyperplanes": 3,
     "estimator": "uniform"},
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


@pytest.mark.parametrize("options", OPTIONS)
def test_the_reference_gives_an_element_of_padding_only_zero_rows(options):
    """The fast path gives such an element zero rows; the reference raised an
    IndexError picking among its real keys (none)."""
    q, k, v = make_qkv(2, 1, 8, 3, seed=3)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1] = False
    fast = kdeformer_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    ref = reference_kdeformer_attention(q, k, v, draws_for(q, 2, **options),
                                        key_padding_mask=mask, **options)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    assert not ref[1].any()


LEGACY_KDE = {"estimator": "uniform", "normalizer": "kde"}


@pytest.mark.parametrize("options", [{}, {"sampler": "iid"}, LEGACY_KDE])
def test_one_block_holding_every_column_is_exact_softmax(options):
    """All columns in the exact sparse part: A_res = 0, alpha = D."""
    q, k, v = make_qkv(2, 2, 20, 8, seed=3)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 14:] = False
    out = kdeformer_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8,
                              block_size=20, **options)
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"sampler": "iid"}, {**LEGACY_KDE, "kde_samples": 96}])
def test_error_falls_as_samples_grow(options):
    """More sampled columns (fixed blocks) approximate better, averaged over draws."""
    q, k, v = make_qkv(1, 2, 96, 16, seed=4, scale=0.8)
    exact = softmax_attention(q, k, v)
    means = []
    for m in (8, 64, 512):
        errs = [relative_error(kdeformer_attention(q, k, v, generator=gen(s), num_features=m,
                                                   block_size=16, **options), exact).mean()
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


def test_value_norm_distribution_is_the_released_codes():
    """p_v_j ∝ ||[v_j 1]|| / ||[V 1]||_op^2 + 1/n over the real keys, 0 on padded ones."""
    g = gen(8)
    v = torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False
    p = value_norm_probabilities(v, valid)
    for b, real in ((0, slice(0, 10)), (1, slice(4, 10))):
        y = torch.cat([v[b, :, real], torch.ones_like(v[b, :, real, :1])], -1)
        op2 = torch.linalg.matrix_norm(y, ord=2) ** 2
        expected = y.norm(dim=-1) / op2[:, None] + 1.0 / y.shape[1]
        torch.testing.assert_close(p[b, :, real], expected / expected.sum(-1, keepdim=True))
    assert torch.all(p[1, :, :4] == 0)


def test_systematic_draws_are_unbiased_and_take_heavy_columns():
    """Each column's count, averaged over the offset u, is m p_j (so the 1/(m p) weights
    are unbiased); a column with m p_j >= 1 is taken at least floor(m p_j) times for
    every u; padded keys (p = 0) never."""
    g = gen(9)
    nk, m = 13, 5
    p = torch.rand(1, 1, nk, generator=g, dtype=torch.float64)
    p[..., 3] = 6.0  # heavy: m p > 1 after normalising
    key_ok = torch.ones(1, nk, dtype=torch.bool)
    key_ok[0, 10:] = False
    p = torch.where(key_ok[:, None], p, 0.0)
    p = p / p.sum()
    order = torch.randperm(nk, generator=g)[None, None]
    cfg = KDEformerConfig(num_features=m)
    grid = 4000
    counts = torch.zeros(nk, dtype=torch.float64)
    for i in range(grid):
        u = torch.full((1, 1, m), (i + 0.5) / grid)
        index, live, weight = draw_columns(p, order, key_ok, cfg, u)
        assert live.all()
        c = torch.bincount(index.flatten(), minlength=nk).double()
        assert c[3] >= math.floor(m * p[0, 0, 3])
        torch.testing.assert_close(weight, 1.0 / (m * p.gather(-1, index)))
        counts += c
    torch.testing.assert_close(counts / grid, m * p[0, 0], atol=2e-3, rtol=0)
    assert counts[10:].sum() == 0


def test_rows_estimator_finds_the_heavy_column():
    """With one key that every query attends to, the estimated column norms put most of
    p on it (mix=1), where the value-norm distribution (mix=0) does not."""
    q, k, v = make_qkv(1, 1, 64, 8, seed=10)
    direction = torch.zeros(8, dtype=q.dtype)
    direction[0] = 1.0
    k[0, 0, 17] = 10.0 * direction
    q = q + 3.0 * direction
    key_ok = torch.ones(1, 64, dtype=torch.bool)
    blocks = torch.full((1, 1, 64), -1), torch.full((1, 1, 64), -2)
    for mix, heavy in ((1.0, True), (0.0, False)):
        cfg = KDEformerConfig(num_features=16, block_size=0, mix=mix)
        p = row_estimate_probabilities(q / math.sqrt(8), k, v, *blocks, key_ok, key_ok, cfg,
                                       torch.rand(1, 1, cfg.rows, generator=gen(0)))
        torch.testing.assert_close(p.sum(-1), torch.ones(1, 1, dtype=p.dtype))
        assert bool(p[0, 0, 17] > 0.5) is heavy, p[0, 0, 17]


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


@pytest.mark.parametrize("options", [{"block_size": 0}, {"block_size": 0, "estimator": "uniform"},
                                     {"block_size": 0, "estimator": "uniform",
                                      "normalizer": "kde"}])
def test_lowering_every_logit_of_a_row_alike_changes_nothing(options):
    """Softmax ignores a shift common to a row's logits. Without blocks, the default
    estimator's sampled terms were taken in units of exp(0): with every logit below
    about -44 they underflowed in float32, and each row fell back to mean(V) with no
    gradient ("uniform" took its sampled keys' largest logit, and kept its result)."""
    q, k, v = make_qkv(1, 2, 32, 4, dtype=torch.float32, seed=8)
    key = skyformer.random_key(1)

    def lowered(c):  # a coordinate that takes exactly c off every scaled logit
        extra = torch.full((*q.shape[:-1], 1), c * 5 ** 0.5)
        return (torch.cat([q, extra], -1).requires_grad_(True),
                torch.cat([k, -torch.ones_like(extra)], -1))

    outs, grads = [], []
    for c in (0.0, 50.0):
        q_c, k_c = lowered(c)
        out = skyformer.attention(q_c, k_c, v, "kdeformer", num_features=64, generator=key,
                                  **options)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(q_c.grad[..., :-1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-3)
    assert grads[0].abs().sum() > 0


def test_defaults_follow_the_paper():
    cfg = get_method("kdeformer").make_config()
    assert (cfg.num_features, cfg.blocks, cfg.num_hyperplanes, cfg.normalizer) == (
        128, 64, 7, "sampled")
    assert (cfg.estimator, cfg.rows, cfg.mix_weight, cfg.sampler) == (
        "rows", 32, 0.5, "systematic")
    # mix's default (None, so that a value set with estimator="uniform" is told apart)
    # computes what mix=0.5 does
    q, k, v = make_qkv(1, 2, 40, 8, seed=3)
    key = skyformer.random_key(0)
    torch.testing.assert_close(
        skyformer.attention(q, k, v, "kdeformer", num_features=16, generator=key),
        skyformer.attention(q, k, v, "kdeformer", num_features=16, mix=0.5, generator=key),
        rtol=0, atol=0)


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"block_size": -1}, "block_size"),
        ({"num_hyperplanes": 0}, "num_hyperplanes"),
        ({"num_hyperplanes": 40}, "num_hyperplanes"),
        ({"num_hyperplanes": 3, "block_size": 0}, "block_size=0 leaves no sparse part"),
        ({"kde_samples": 0, "estimator": "uniform"}, "kde_samples"),
        ({"kde_samples": 8}, r"kde_samples=8 has no effect with estimator='rows' .*pass "
         r"estimator='uniform' or leave kde_samples out"),
        ({"kde_rows": 4, "mix": 0.5, "estimator": "uniform"}, r"kde_rows=4, mix=0.5 has no "
         r"effect with estimator='uniform' .*leave kde_rows and mix out"),
        ({"mix": 0.2, "estimator": "uniform"}, "mix=0.2 has no effect"),
        ({"normalizer": "exact"}, "normalizer"),
        ({"normalizer": "kde"}, "estimator='uniform'"),
        ({"estimator": "kde"}, "estimator"),
        ({"kde_rows": 0}, "kde_rows"),
        ({"mix": 1.5}, "mix"),
        ({"mix": -0.1}, "mix"),
        ({"sampler": "stratified"}, "sampler"),
        ({"scale": -2.0}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            kdeformer_attention(q, k, v, **options)
