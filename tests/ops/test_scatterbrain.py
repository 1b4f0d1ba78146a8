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
from tests.conftest import gen, holes_mask, make_qkv

SUPPORT_DEFAULT = "local"

OPTIONS = [
    {"num_features": 8, "support": "lsh"},
    {"num_features": 6, "block_size": 5, "num_hyperplanes": 3, "orthogonal": False,
     "support": "lsh"},
    {"num_features": 8, "block_size": 0, "support": "lsh"},
    {"num_features": 7, "antithetic": False, "support": "lsh"},
    {"num_features": 8, "support": "local"},
    {"num_features": 5, "block_size": 4, "support": "local", "orthogonal": False},
    {"num_features": 6, "block_size": 1, "support": "local", "antithetic": False},
    {"num_features": 6, "block_size": 9, "support": "local"},
    {"num_features": 6, "block_size": 41, "support": "local"},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("nq", [21, 12])
def test_fast_matches_reference_outputs_and_gradients(options, nq):
    q, k, v = make_qkv(2, 2, nq, 6, nk=21, dv=5, seed=1)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, 16:] = False
    mask[0, [4, 9]] = False  # holes
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


@pytest.mark.parametrize("support", ["lsh", "local"])
def test_the_reference_gives_an_element_without_a_real_key_zero_rows(support):
    """Cross-attention (no query padding) to an element whose keys are all padding: the
    fast path's zeros, as softmax's, where the reference divided 0 by 0."""
    q, k, v = make_qkv(2, 2, 5, 6, nk=7, dv=3, seed=4)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    options = {"num_features": 6, "block_size": 2, "support": support}
    w, planes = draw_scatterbrain(2, 2, 6, ScatterbrainConfig(**options), generator=gen(2))
    ref = reference_scatterbrain_attention(q, k, v, w.double(), planes, key_padding_mask=mask,
                                           **options)
    fast = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    torch.testing.assert_close(ref, fast, rtol=1e-10, atol=1e-12)
    assert (ref[1] == 0).all()


def test_one_bucket_holding_every_key_is_exact_softmax():
    """The support covers A: the low-rank part cancels exactly."""
    q, k, v = make_qkv(2, 2, 20, 8, seed=3)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    out = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8,
                                 block_size=20, support="lsh")
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("support", ["lsh", "local"])
def test_no_sparse_part_is_performer_with_the_same_features(support):
    q, k, v = make_qkv(1, 2, 18, 8, seed=4)
    a = scatterbrain_attention(q, k, v, generator=gen(5), num_features=16, block_size=0,
                               antithetic=False, support=support)
    b = performer_attention(q, k, v, generator=gen(5), num_features=16)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_low_rank_row_of_small_float32_sums_keeps_its_estimate():
    """Without a sparse part, a query whose features are large where the keys' are
    small has sums far below the normaliser's float32 threshold (~1e-19) that still
    hold every digit (|q| = |k| = 30, D = 8, N = 4): such rows returned the mean of the
    values, 0.26 from the float64 estimate. Each row is scaled by a power of two first."""
    g = gen(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    q, k = (x / x.norm(dim=-1, keepdim=True) * 30 for x in (q, k))
    q, k, v = (x.float().double() for x in (q, k, v))
    ref = scatterbrain_attention(q, k, v, generator=gen(0), block_size=0)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    out = scatterbrain_attention(q32, k32, v32, generator=gen(0), block_size=0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q32, k32, v32))
    assert all(torch.isfinite(g).all() for g in grads)


def test_antithetic_features_are_a_direction_and_its_negation():
    cfg = ScatterbrainConfig(num_features=7, support="lsh")
    w, planes = draw_scatterbrain(1, 1, 5, cfg, generator=gen(3))
    assert w.shape == (8, 5) and planes is not None
    torch.testing.assert_close(w[4:], -w[:4])
    w, planes = draw_scatterbrain(1, 1, 5, ScatterbrainConfig(num_features=7, support="local"),
                                  generator=gen(3))
    assert w.shape == (8, 5) and planes is None


def test_local_window_covering_every_key_is_exact_softmax():
    """A window of 2 N - 1 keys holds every key of every query."""
    q, k, v = make_qkv(2, 2, 20, 8, seed=3)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    out = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8,
                                 block_size=39, support="local")
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)
    cfg = ScatterbrainConfig(support="local", block_size=500)
    assert cfg.budget_caps(20, 20) == {"block_size": 39}
    lsh = ScatterbrainConfig(block_size=500, support="lsh")
    assert lsh.budget_caps(20, 20) == {"block_size": 20}


def test_local_window_positions():
    """Query i's window is keys i - w // 2 ... i + (w + 1) // 2 - 1."""
    from skyformer.ops.scatterbrain.naive import reference_local_pattern

    rank = torch.arange(6)
    band = reference_local_pattern(rank, rank, 4)
    assert band[3].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert band[0].nonzero().flatten().tolist() == [0, 1]
    assert reference_local_pattern(rank, rank, 3)[3].nonzero().flatten().tolist() == [2, 3, 4]


@pytest.mark.parametrize("support", ["lsh", "local"])
def test_padding_equals_truncation_and_batches_are_independent(support):
    """Right-padded keys change nothing for the real queries; each batch element's output
    depends on its own inputs only (local: no random hash, so exactly)."""
    q, k, v = make_qkv(2, 2, 16, 6, seed=9)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 11:] = False
    opts = {"num_features": 6, "block_size": 4, "support": support}
    both = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(1), **opts)
    short = scatterbrain_attention(q[1:, :, :11], k[1:, :, :11], v[1:, :, :11], generator=gen(1),
                                   **opts)
    first = scatterbrain_attention(q[:1], k[:1], v[:1], generator=gen(1), **opts)
    if support == "local":
        torch.testing.assert_close(both[1:, :, :11], short, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(both[:1], first, rtol=1e-10, atol=1e-12)
    assert torch.all(both[1, :, 11:] == 0)


def real(x: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    """Element i's rows at its real positions, packed: ``[1, H, n_i, F]``."""
    return x[i : i + 1, :, mask[i]]


@pytest.mark.parametrize("block_size", [2, 4, 5, 7])
def test_local_windows_follow_ranks_so_holes_equal_truncation(block_size):
    """Windows that neither hold one key nor every key: a query's window is over the
    real tokens around it in order, so holes and left padding change nothing, in the
    fast path and in the reference."""
    q, k, v = make_qkv(2, 2, 20, 6, seed=11)
    mask = holes_mask(2, 20)
    opts = {"num_features": 6, "block_size": block_size, "support": "local"}
    fast = scatterbrain_attention(q, k, v, key_padding_mask=mask, generator=gen(1), **opts)
    w, _ = draw_scatterbrain(2, 2, 6, ScatterbrainConfig(**opts), generator=gen(1))
    ref = reference_scatterbrain_attention(q, k, v, w.double(), None, key_padding_mask=mask,
                                           **opts)
    for i in range(2):
        short = scatterbrain_attention(real(q, mask, i), real(k, mask, i), real(v, mask, i),
                                       generator=gen(1), **opts)
        torch.testing.assert_close(real(fast, mask, i), short, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(real(ref, mask, i), short, rtol=1e-10, atol=1e-12)
    assert torch.all(fast[~mask[:, None, :].expand(-1, 2, -1)] == 0)


def test_cross_attention_windows_follow_query_and_key_ranks():
    """Holes among the keys and among the queries: query rank r sees key ranks around r."""
    q, k, v = make_qkv(2, 2, 14, 6, nk=20, seed=12)
    k_mask, q_mask = holes_mask(2, 20), holes_mask(2, 14)
    opts = {"num_features": 6, "block_size": 4, "support": "local"}
    fast = scatterbrain_attention(q, k, v, key_padding_mask=k_mask, query_padding_mask=q_mask,
                                  generator=gen(1), **opts)
    for i in range(2):
        short = scatterbrain_attention(real(q, q_mask, i), real(k, k_mask, i),
                                       real(v, k_mask, i), generator=gen(1), **opts)
        torch.testing.assert_close(real(fast, q_mask, i), short, rtol=1e-10, atol=1e-12)


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
    assert (cfg.support, cfg.antithetic) == (SUPPORT_DEFAULT, True)


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"block_size": -3}, "block_size"),
        ({"num_hyperplanes": 0}, "num_hyperplanes"),
        ({"num_hyperplanes": 3}, r"num_hyperplanes=3 .* support='local' .* changes nothing"),
        ({"num_hyperplanes": 3, "support": "lsh", "block_size": 0},
         "block_size=0 leaves no sparse part"),
        ({"orthogonal": None}, "orthogonal"),
        ({"scale": float("nan")}, "scale"),
        ({"support": "window"}, "support"),
        ({"antithetic": 1}, "antithetic"),
    ):
        with pytest.raises(ValueError, match=word):
            scatterbrain_attention(q, k, v, **options)
