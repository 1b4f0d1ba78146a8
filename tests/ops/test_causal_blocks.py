"""Causal Skyformer without a gradient to record runs by blocks of rows, each from the
state of the keys before it (``ops/skyformer/causal.py``, ``STREAM_ROWS``): the outputs
of the call that records gradients, whole, to rounding."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.ops.skyformer import causal
from tests.conftest import make_qkv


def _call(q, k, v, mask, **options):
    return skyformer.attention(q, k, v, "skyformer", causal=True, num_features=12,
                               key_padding_mask=mask, generator=torch.Generator().manual_seed(4),
                               **options)


@pytest.mark.parametrize("options", [{}, {"causal_local": False}, {"landmark_stride": 9}],
                         ids=["local", "landmarks only", "stride"])
def test_blocks_give_the_whole_calls_rows(monkeypatch, options):
    monkeypatch.setattr(causal, "STREAM_ROWS", 128)  # blocks of 2 chunks: 3 blocks here
    q, k, v = make_qkv(2, 2, 300, 8, seed=1)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, :150] = False  # left padding: the first block all padding, once packed
    mask[1, 100:140] = False  # a hole across a block boundary
    whole = _call(q.clone().requires_grad_(), k, v, mask, **options)  # records: one pass
    seen = []
    original = causal._whole
    monkeypatch.setattr(causal, "_whole", lambda *a, **kw: seen.append(a[0].shape[2])
                        or original(*a, **kw))
    with torch.no_grad():
        blocks = _call(q, k, v, mask, **options)
    assert seen == [128, 128, 44]
    torch.testing.assert_close(blocks, whole.detach(), rtol=1e-12, atol=1e-13)


def test_a_non_finite_key_reaches_the_later_blocks_as_in_the_whole_call(monkeypatch):
    monkeypatch.setattr(causal, "STREAM_ROWS", 128)
    q, k, v = make_qkv(1, 2, 300, 8, seed=2)
    k[0, 1, 70, 3] = float("nan")
    whole = _call(q.clone().requires_grad_(), k, v, None).detach()
    with torch.no_grad():
        blocks = _call(q, k, v, None)
    assert torch.equal(blocks.isnan(), whole.isnan())
    assert blocks[0, 1, 70:].isnan().all() and not blocks[0, 0].isnan().any()
    torch.testing.assert_close(blocks[~whole.isnan()], whole[~whole.isnan()], rtol=1e-12,
                               atol=1e-13)
