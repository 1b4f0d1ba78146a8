"""Random features for the softmax kernel (Performer Lemma 1, Section 2.4) and the
random-rotation LSH of Reformer."""

from __future__ import annotations

import math

import pytest
import torch

from skyformer.sketch import (
    draw_rotations,
    gaussian_projection,
    rotation_hash,
    softmax_log_features,
)
from tests.conftest import gen


def test_orthogonal_blocks_have_orthogonal_rows_and_chi_norms():
    d, m = 8, 20
    w = gaussian_projection(m, d, generator=gen(0)).double()
    assert w.shape == (m, d)
    for start in (0, 8):  # two full blocks of d rows
        block = w[start : start + d]
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-5
    # Row norms are chi_d: over many rows their mean square is d.
    many = gaussian_projection(4096, d, generator=gen(1)).double()
    sq = (many * many).sum(-1)
    assert abs(sq.mean().item() - d) < 4 * math.sqrt(2 * d / 4096)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_rows_are_marginally_standard_gaussian(orthogonal):
    """E[w] = 0 and E[w w^T] = I: what makes phi(x).phi(y) unbiased for exp(x.y)."""
    d, m = 4, 8192
    w = gaussian_projection(m, d, orthogonal=orthogonal, generator=gen(2)).double()
    assert w.mean(0).abs().max() < 4 / math.sqrt(m)
    cov = w.T @ w / m
    assert (cov - torch.eye(d, dtype=cov.dtype)).abs().max() < 6 * math.sqrt(2 / m)


def test_draw_shape_depends_only_on_features_and_dim():
    a = gaussian_projection(10, 4, generator=gen(3))
    b = gaussian_projection(10, 4, generator=gen(3))
    assert torch.equal(a, b)
    assert a.dtype == torch.float32


def test_log_features_formula():
    x = torch.randn(3, 5, dtype=torch.float64)
    w = torch.randn(7, 5, dtype=torch.float64)
    expected = x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)
    torch.testing.assert_close(softmax_log_features(x, w), expected)


def test_rotation_columns_are_a_prefix_of_longer_draws():
    short = draw_rotations(2, 3, 4, 5, generator=gen(4))
    long = draw_rotations(2, 3, 4, 9, generator=gen(4))
    assert short.shape == (2, 3, 4, 5)
    assert torch.equal(long[..., :5], short)


def test_rotation_hash_is_argmax_of_plus_minus_projection():
    x = torch.randn(2, 2, 10, 4, generator=gen(5))
    rot = draw_rotations(2, 2, 4, 4, generator=gen(6))
    n_buckets = torch.tensor([8, 4])
    buckets = rotation_hash(x, rot, n_buckets)  # [B, R, H, N]
    assert buckets.shape == (2, 2, 2, 10)
    for b in range(2):
        cols = int(n_buckets[b]) // 2
        for r in range(2):
            for h in range(2):
                proj = x[b, h] @ rot[h, r, :, :cols]
                expected = torch.cat([proj, -proj], -1).argmax(-1)
                assert torch.equal(buckets[b, r, h], expected)
    assert torch.all(rotation_hash(x, rot, torch.tensor([1, 1])) == 0)
