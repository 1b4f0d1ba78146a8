"""Skyformer's landmarks are uniform without replacement among the valid rows of each
side (``sketch.landmarks.uniform_landmarks``): the naive reference takes the landmarks
as given, so their distribution is checked here, by frequencies over many draws."""

from __future__ import annotations

import itertools

import pytest
import torch

from skyformer.sketch.landmarks import uniform_landmarks

DRAWS = 4000  # batch elements draw independently: one call, many draws


def _draw(m, query_valid, key_len, seed=0):
    return uniform_landmarks(m, batch=DRAWS, query_len=query_valid.shape[1], key_len=key_len,
                             query_valid=query_valid, key_valid=None,
                             device=torch.device("cpu"),
                             generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("padded", [False, True])
def test_each_valid_row_and_pair_of_rows_is_drawn_as_often(padded):
    valid = torch.ones(DRAWS, 12, dtype=torch.bool)
    if padded:
        valid[:, ::3] = False  # 8 valid rows, in the middle too
    landmarks = _draw(7, valid, key_len=10)
    q, k = landmarks.query_index, landmarks.key_index
    assert q.shape == (DRAWS, 4) and k.shape == (DRAWS, 3)  # ceil(m/2) of Q, floor of K
    for index, rows, n in ((q, valid[0].nonzero().flatten().tolist(), int(valid[0].sum())),
                           (k, list(range(10)), 10)):
        count = index.shape[1]
        assert all(len(set(r)) == count for r in index.tolist())  # without replacement
        assert set(index.flatten().tolist()) == set(rows)  # padded rows never
        chosen = torch.zeros(DRAWS, index.max() + 1).scatter_(1, index, 1.0)
        frequency = chosen.mean(0)[rows]
        # P(row) = c/n; P(both of two rows) = c(c-1)/(n(n-1)); 5 standard errors
        p_one = count / n
        assert (frequency - p_one).abs().max() < 5 * (p_one * (1 - p_one) / DRAWS) ** 0.5
        p_two = count * (count - 1) / (n * (n - 1))
        pairs = torch.stack([chosen[:, a] * chosen[:, b]
                             for a, b in itertools.combinations(rows, 2)]).mean(1)
        assert (pairs - p_two).abs().max() < 5 * (p_two * (1 - p_two) / DRAWS) ** 0.5


def test_another_seed_draws_other_rows_and_the_same_seed_the_same():
    valid = torch.ones(DRAWS, 12, dtype=torch.bool)
    a, b, c = (_draw(6, valid, 12, seed) for seed in (0, 0, 1))
    assert torch.equal(a.query_index, b.query_index) and torch.equal(a.key_index, b.key_index)
    assert not torch.equal(a.query_index, c.query_index)
