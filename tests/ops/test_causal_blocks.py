"""Causal Skyformer, nystrom_softmax, Performer and linear attention without a gradient
to record run by blocks of rows, each from the state of the keys before it
(``ops/shared/causal_prefix.py``, ``by_blocks``): the outputs of the call that records
gradients, whole, to rounding."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.ops.linear import linear as linear_module
from skyformer.ops.performer import performer, performer_attention
from skyformer.ops.shared import causal_prefix
from skyformer.ops.skyformer import causal
from tests.conftest import make_qkv


def _call(q, k, v, mask, **options):
    return skyformer.attention(q, k, v, "skyformer", causal=True, num_features=12,
                               key_padding_mask=mask, generator=torch.Generator().manual_seed(4),
                               **options)


def _assert_blocks_give_the_whole_rows(monkeypatch, call, q, module, name: str) -> None:
    """``call(q)`` recording a gradient (one pass) against ``call(q)`` without one, which
    runs ``module.name`` (spied on) once per block: blocks of 128, 128 and 44 rows, the
    same rows to rounding."""
    whole = call(q.clone().requires_grad_()).detach()
    seen = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: seen.append(a[0].shape[2])
                        or original(*a, **kw))
    with torch.no_grad():
        blocks = call(q)
    assert seen == [128, 128, 44]
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("options", [{}, {"causal_local": False}, {"landmark_stride": 9}],
                         ids=["local", "landmarks only", "stride"])
def test_blocks_give_the_whole_calls_rows(monkeypatch, options):
    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)  # blocks of 2 chunks: 3 blocks here
    q, k, v = make_qkv(2, 2, 300, 8, seed=1)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, :150] = False  # left padding: the first block all padding, once packed
    mask[1, 100:140] = False  # a hole across a block boundary
    _assert_blocks_give_the_whole_rows(
        monkeypatch, lambda q: _call(q, k, v, mask, **options), q, causal, "_whole")


def test_a_non_finite_key_reaches_the_later_blocks_as_in_the_whole_call(monkeypatch):
    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)
    q, k, v = make_qkv(1, 2, 300, 8, seed=2)
    k[0, 1, 70, 3] = float("nan")
    whole = _call(q.clone().requires_grad_(), k, v, None).detach()
    with torch.no_grad():
        blocks = _call(q, k, v, None)
    assert torch.equal(blocks.isnan(), whole.isnan())
    assert blocks[0, 1, 70:].isnan().all() and not blocks[0, 0].isnan().any()
    torch.testing.assert_close(blocks[~whole.isnan()], whole[~whole.isnan()], rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_performer_blocks_give_the_whole_calls_rows(monkeypatch, eps):
    """The running sums carried from block to block, keys of large norm in the first
    block (their scales far above the later keys'), padding across a boundary."""
    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)
    q, k, v = make_qkv(2, 2, 300, 8, seed=3)
    k[:, :, :40] *= 6
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, 120:135] = False
    mask[1, :200] = False
    projection = torch.randn(16, 8, generator=torch.Generator().manual_seed(5),
                             dtype=torch.float64)

    def call(q):
        return performer_attention(q, k, v, causal=True, num_features=16, eps=eps,
                                   projection=projection, key_padding_mask=mask)

    _assert_blocks_give_the_whole_rows(monkeypatch, call, q, performer, "_causal_rows")


@pytest.mark.parametrize("options", [{}, {"causal_local": False}, {"landmark_stride": 9}],
                         ids=["local", "landmarks only", "stride"])
def test_nystrom_softmax_blocks_give_the_whole_calls_rows(monkeypatch, options):
    """Each block starts from the keys before it at their running maximum: keys of large
    norm in the first block (the shift the later blocks start from), a later key of
    larger norm still, rows whose normaliser is lost (the mean of every earlier value),
    left padding and a hole across a block boundary."""
    from skyformer.ops.nystrom_softmax import causal as causal_ns

    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)
    q, k, v = make_qkv(2, 2, 300, 8, seed=6)
    k[:, :, :40] *= 4
    k[:, :, 250] *= 6  # in the last chunk of a block (of both sequences, once packed)
    q[:, :, [150, 290]] *= 40
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, :150] = False
    mask[1, 100:140] = False

    def call(q):
        return skyformer.attention(q, k, v, "nystrom_softmax", causal=True, num_features=12,
                                   key_padding_mask=mask, generator=skyformer.random_key(4),
                                   **options)

    _assert_blocks_give_the_whole_rows(monkeypatch, call, q, causal_ns, "_whole")


def test_blocks_hold_whole_chunks_of_any_chunk_length(monkeypatch):
    """The exact local part follows the chunk grid: blocks of 128 rows would cut chunks of
    48 (the internal ``chunk`` argument), so they hold 96."""
    from skyformer.ops.shared.inputs import check_attention_inputs
    from skyformer.ops.skyformer.causal import causal_skyformer, draw_causal_landmarks

    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)
    q, k, v = make_qkv(1, 1, 300, 8, seed=4)
    info = check_attention_inputs(q, k, v, None, method="skyformer")
    landmarks = draw_causal_landmarks(info, 16, None, q.device, skyformer.random_key(3))
    whole, _ = causal_skyformer(q.clone().requires_grad_(), k, v, info, 8 ** -0.25, 0.1,
                                True, landmarks, chunk=48)
    with torch.no_grad():
        blocks, _ = causal_skyformer(q, k, v, info, 8 ** -0.25, 0.1, True, landmarks, chunk=48)
    torch.testing.assert_close(blocks, whole.detach(), rtol=1e-12, atol=1e-13)


def test_linear_blocks_give_the_whole_calls_rows(monkeypatch):
    monkeypatch.setattr(causal_prefix, "STREAM_ROWS", 128)
    q, k, v = make_qkv(2, 2, 300, 8, seed=5)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, 100:140] = False
    _assert_blocks_give_the_whole_rows(
        monkeypatch, lambda q: skyformer.attention(q, k, v, "linear", causal=True,
                                                   key_padding_mask=mask),
        q, linear_module, "causal_feature_sums")
