"""Selections among tied scores (``linalg.top_k``) do not depend on the padded width:
Informer's active queries, the multipole methods' near keys and the adaptive method's
top keys, on inputs with repeated rows, integer values and k = q, where ``torch.topk``
kept another tied entry when the batch was padded (outputs moved by up to 0.5)."""

from __future__ import annotations

import pytest
import torch

import skyformer
from tests.conftest import gen


def _repeated_rows(seed):
    """Each query and key row twice (equal centre logits), values all different."""
    g = gen(seed)
    q, k = (torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    return q[:, :, rows], k[:, :, rows], torch.randn(1, 2, 8, 2, generator=g,
                                                      dtype=torch.float64)


def _integers(seed):
    g = gen(seed)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    return q.round(), k.round(), v


def _keys_as_queries(seed):
    g = gen(seed)
    q, v = (torch.randn(1, 1, 2, 2, generator=g, dtype=torch.float64) for _ in range(2))
    return q, q.clone(), v


CASES = [("skyformer_multipole", _repeated_rows), ("softmax_multipole", _repeated_rows),
         ("informer", _integers), ("skyformer_adaptive", _keys_as_queries)]


@pytest.mark.parametrize(("method", "data"), CASES, ids=[m for m, _ in CASES])
@pytest.mark.parametrize("seed", [1, 2])
def test_tied_scores_choose_the_same_entries_whatever_the_padding(method, data, seed):
    q, k, v = data(seed)
    key = skyformer.random_key(seed)
    alone = skyformer.attention(q, k, v, method, generator=key, num_features=2)
    n = q.shape[2]
    for extra in (1, 7, 30):
        padded = [torch.cat([t, torch.zeros(*t.shape[:2], extra, t.shape[3],
                                            dtype=t.dtype)], dim=2) for t in (q, k, v)]
        mask = torch.arange(n + extra) < n
        out = skyformer.attention(*padded, method, key_padding_mask=mask[None],
                                  generator=key, num_features=2)
        torch.testing.assert_close(out[:, :, :n], alone, rtol=1e-12, atol=1e-12,
                                   msg=f"padded by {extra}")
