"""k-means clusters: against a naive Lloyd loop, padding, budgets and gradients."""

from __future__ import annotations

import pytest
import torch

from skyformer.sketch.kmeans import _means_index_add, _means_one_hot, kmeans_clusters
from skyformer.sketch.landmarks import selection_keys
from skyformer.sketch.rng import random_key, row_uniform, stream
from tests.conftest import gen


def naive_kmeans(x, init, iterations):
    """Plain Lloyd iterations on the rows of x ``[n, D]`` from ``init`` ``[c, D]``."""
    centres = init.clone()
    for _ in range(iterations):
        assign = torch.cdist(x, centres).argmin(1)
        for c in range(len(centres)):
            if (assign == c).any():
                centres[c] = x[assign == c].mean(0)
    return torch.cdist(x, centres).argmin(1)


def test_matches_naive_lloyd_from_the_same_start():
    x = torch.randn(2, 3, 50, 4, generator=gen(0), dtype=torch.float64)
    out = kmeans_clusters(x, 6, generator=gen(1), iterations=5)
    scores = row_uniform(stream(random_key(gen(1)), "kmeans"), None, 2, 50)
    for b in range(2):
        init_rows = scores[b].argsort()[:6]
        for h in range(3):
            expected = naive_kmeans(x[b, h], x[b, h, init_rows], 5)
            assert torch.equal(out.assignment[b, h], expected)
            for c in range(6):
                members = x[b, h][expected == c]
                torch.testing.assert_close(out.centres[b, h, c], members.mean(0))
                assert out.sizes[b, h, c] == len(members)


def test_right_padding_equals_truncation_and_padded_rows_take_no_part():
    x = torch.randn(1, 2, 30, 4, generator=gen(2), dtype=torch.float64)
    mask = torch.zeros(1, 30, dtype=torch.bool)
    mask[:, :21] = True
    junk = x.clone()
    junk[:, :, 21:] = 100.0
    padded = kmeans_clusters(junk, 5, valid=mask, generator=gen(3), iterations=4, sample=12)
    truncated = kmeans_clusters(x[:, :, :21], 5, generator=gen(3), iterations=4, sample=12)
    assert torch.equal(padded.assignment[..., :21], truncated.assignment)
    torch.testing.assert_close(padded.centres, truncated.centres, rtol=1e-12, atol=1e-12)
    assert torch.equal(padded.sizes, truncated.sizes)


def test_tied_scores_break_by_rank_so_padding_still_equals_truncation():
    # a key whose 24-bit scores for these 64 rows hold a tie among the initial centres:
    # the order of the tied rows must not depend on the padded width
    key = torch.tensor([109758, 12345])
    scores = row_uniform(stream(key, "kmeans"), None, 1, 64)
    assert scores.unique().numel() < 64
    x = torch.randn(1, 1, 104, 4, generator=gen(0), dtype=torch.float64)
    mask = torch.zeros(1, 104, dtype=torch.bool)
    mask[:, :64] = True
    padded = kmeans_clusters(x, 8, valid=mask, generator=key, iterations=3)
    truncated = kmeans_clusters(x[:, :, :64], 8, generator=key, iterations=3)
    assert torch.equal(padded.assignment[..., :64], truncated.assignment)
    keys = selection_keys(stream(key, "kmeans"), None, 1, 64)
    assert keys.unique().numel() == 64


def test_per_head_budgets_and_more_clusters_than_rows():
    x = torch.randn(1, 2, 9, 3, generator=gen(4), dtype=torch.float64)
    out = kmeans_clusters(x, 12, generator=gen(0), live_clusters=torch.tensor([[12, 2]]))
    assert out.live[0, 0].sum() == 9  # every row its own centre
    torch.testing.assert_close(out.centres[0, 0][out.assignment[0, 0]], x[0, 0])
    assert out.live[0, 1].sum() <= 2 and out.live[0, 1, 2:].sum() == 0


def test_centres_are_differentiable_member_means():
    x = torch.randn(1, 1, 20, 3, generator=gen(5), dtype=torch.float64, requires_grad=True)
    out = kmeans_clusters(x, 4, generator=gen(0))
    out.centres.sum().backward()
    sizes = out.sizes[0, 0][out.assignment[0, 0]]
    torch.testing.assert_close(x.grad[0, 0], (1.0 / sizes)[:, None].expand(20, 3))


def test_fully_padded_rows_keep_one_live_centre():
    x = torch.randn(2, 1, 6, 3, generator=gen(6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1] = False
    out = kmeans_clusters(x, 3, valid=mask, generator=gen(0))
    assert out.live[1, 0].any() and torch.isfinite(out.centres).all()
    assert out.sizes[1].sum() == 0


def test_index_add_means_equal_one_hot_means_with_gradients():
    """The CPU path of the member means (index-add) against the CUDA one (one-hot
    product): weights with zeros, an empty cluster, values and gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assignment = torch.randint(0, 6, (2, 3, 40), generator=g)
    assignment[assignment == 4] = 5  # cluster 4 stays empty
    weight = (torch.rand(2, 3, 40, generator=g) > 0.2).to(torch.float64)
    fast, fast_sizes = _means_index_add(x, assignment, weight, 6)
    ref, ref_sizes = _means_one_hot(x, assignment, weight, 6)
    torch.testing.assert_close(fast, ref)
    torch.testing.assert_close(fast_sizes, ref_sizes)
    assert torch.all(fast_sizes[..., 4] == 0) and torch.all(fast[..., 4, :] == 0)
    up = torch.randn(fast.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((fast * up).sum(), x)[0],
                               torch.autograd.grad((ref * up).sum(), x)[0])


def test_kmeans_refuses_zero_clusters():
    """An IndexError from argmin over no centres, now a sentence."""
    x = torch.randn(1, 2, 10, 4, generator=gen(0))
    with pytest.raises(ValueError, match="num_clusters must be a positive integer, got 0"):
        kmeans_clusters(x, 0, generator=gen(1))
