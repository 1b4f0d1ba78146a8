"""Informer ProbSparse attention against its naive reference, its exact limit, its sampler."""

from __future__ import annotations

import math

import pytest
import torch

from skyformer import softmax_attention
from skyformer.ops.informer import informer as informer_module
from skyformer.ops.informer import informer_attention
from skyformer.ops.informer.informer import log_budget, sample_keys, sparsity_measurement
from skyformer.ops.informer.naive import reference_informer_attention
from skyformer.ops.shared.inputs import check_attention_inputs, mean_values
from tests.conftest import gen, make_qkv


def samples_for(q, k, v, mask, seed, factor=5):
    info = check_attention_inputs(q, k, v, mask, method="test")
    return sample_keys(info, factor, q.device, gen(seed))


@pytest.mark.parametrize("num_features", [None, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_matches_naive_reference_outputs_and_gradients(num_features, masked):
    q, k, v = make_qkv(2, 2, 40, 8)
    mask = None
    if masked:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[0, :7] = False
        mask[1, 29:] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = informer_attention(
        q, k, v, key_padding_mask=mask, generator=gen(1), num_features=num_features
    )
    ref = reference_informer_attention(
        q, k, v, samples_for(q, k, v, mask, 1), key_padding_mask=mask, num_features=num_features
    )
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(
        torch.autograd.grad(fast.square().sum(), (q, k, v)),
        torch.autograd.grad(ref.square().sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_cross_attention_matches_reference():
    q, k, v = make_qkv(1, 2, 25, 8, nk=60)
    fast = informer_attention(q, k, v, generator=gen(2), num_features=6)
    ref = reference_informer_attention(q, k, v, samples_for(q, k, v, None, 2), num_features=6)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("masked", [False, True])
def test_all_queries_active_is_exact_softmax(masked):
    q, k, v = make_qkv(2, 2, 24, 8)
    mask = None
    if masked:
        mask = torch.ones(2, 24, dtype=torch.bool)
        mask[1, 15:] = False
    out = informer_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=24)
    torch.testing.assert_close(
        out, softmax_attention(q, k, v, key_padding_mask=mask), rtol=1e-9, atol=1e-11
    )


def test_lazy_queries_output_the_mean_of_real_values():
    q, k, v = make_qkv(1, 2, 60, 8)
    mask = torch.ones(1, 60, dtype=torch.bool)
    mask[0, 50:] = False
    out = informer_attention(q, k, v, key_padding_mask=mask, generator=gen(0))
    lazy = mean_values(v, mask)  # [1, H, 1, Dv]
    is_lazy = torch.isclose(out, lazy.expand_as(out), rtol=0, atol=1e-12).all(dim=-1)  # [1, H, N]
    # u = 5 ceil(ln 50) = 20 active real queries per head; the 10 padded rows are zero
    assert (~is_lazy[..., :50]).sum(dim=-1).tolist() == [[20, 20]]
    assert torch.all(out[..., 50:, :] == 0)


def test_peaked_query_is_selected():
    """A query aligned with one key has a large max-minus-mean measurement: it attends."""
    q, k, v = make_qkv(1, 1, 200, 16, scale=0.3)
    q = q.clone()
    q[0, 0, 7] = k[0, 0, 42] * 20
    out = informer_attention(q, k, v, generator=gen(0), num_features=1)
    torch.testing.assert_close(
        out[0, 0, 7], softmax_attention(q, k, v)[0, 0, 7], rtol=1e-9, atol=1e-11
    )
    lazy = mean_values(v, None)[0, 0, 0]
    assert torch.equal(torch.cat([out[0, 0, :7], out[0, 0, 8:]]), lazy.expand(199, -1))


def test_budgets_follow_informer():
    assert log_budget(5, 1) == 1  # ln 1 = 0, at least one
    assert log_budget(5, 17) == 15
    assert log_budget(5, 1024) == 35
    assert log_budget(5, 4) == 4  # capped at n
    q, k, v = make_qkv(2, 1, 30, 4)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 8:] = False
    s = samples_for(q, k, v, mask, 0)
    assert s.live[0].sum(dim=-1).unique().tolist() == [log_budget(5, 30)]
    assert s.live[1, :8].sum(dim=-1).unique().tolist() == [log_budget(5, 8)]
    assert not s.live[1, 8:].any()
    assert mask[1][s.index[1][s.live[1]]].all(), "only real keys are sampled"


def test_samples_of_a_padded_sequence_are_those_of_its_truncation():
    q, k, v = make_qkv(2, 1, 30, 4)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :6] = False  # left padding of the first sequence
    padded = samples_for(q, k, v, mask, 3)
    trunc = samples_for(q[:1, :, 6:], k[:1, :, 6:], v[:1, :, 6:], None, 3)
    w = trunc.index.shape[-1]
    assert torch.equal(padded.index[0, 6:, :w] - 6, trunc.index[0])
    # the second sequence's mask does not change the first one's samples
    mask2 = mask.clone()
    mask2[1, 10:] = False
    other = samples_for(q, k, v, mask2, 3)
    assert torch.equal(other.index[0, :, :w], padded.index[0, :, :w])


def test_samples_are_uniform_over_real_keys():
    q, k, v = make_qkv(1, 1, 400, 4)
    s = samples_for(q, k, v, None, 0)
    counts = torch.bincount(s.index[s.live], minlength=400).double()
    expected = s.live.sum() / 400  # 400 * 30 / 400 = 30 per key
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # chi-square with 399 degrees of freedom: mean 399, sd ~28; 550 is > 5 sd away
    assert chi2 < 550, chi2


def test_chunked_measurement_equals_unchunked(monkeypatch):
    q, k, v = make_qkv(2, 2, 50, 8)
    s = samples_for(q, k, v, None, 0)
    whole = sparsity_measurement(q, k, s, 0.3, None)
    monkeypatch.setattr(informer_module, "_CHUNK_ELEMENTS", 1000)
    torch.testing.assert_close(sparsity_measurement(q, k, s, 0.3, None), whole, rtol=0, atol=0)
    scores = 0.3 * (q[0, 0, 3] @ k[0, 0, s.index[0, 3]].T)
    # eq. (4) with the pairs not sampled counted as 0 (Informer Section 3.1): sum / n_k
    assert math.isclose(
        whole[0, 0, 3].item(), (scores.max() - scores.sum() / 50).item(), rel_tol=1e-12
    )


def test_bad_options():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"factor": 0}, "factor"),
        ({"scale": float("-inf")}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            informer_attention(q, k, v, **options)


@pytest.mark.parametrize("options", [{"num_features": 2**63}, {"num_features": 2**70},
                                     {"factor": 2**70}, {"factor": 2**1100}])
def test_budgets_past_int64_are_capped_by_the_sequence(options):
    """u = min(num_features or c ceil(ln n), n): a budget past int64 failed inside torch
    (RuntimeError, OverflowError) instead of being capped by the length, as the docs
    say it is."""
    q, k, v = make_qkv(b=1, h=2, n=16, d=4)
    capped = dict.fromkeys(options, 16)
    torch.testing.assert_close(informer_attention(q, k, v, generator=gen(0), **options),
                               informer_attention(q, k, v, generator=gen(0), **capped),
                               rtol=0, atol=0)


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_a_scale_of_zero_or_below_matches_the_reference(scale):
    """Any finite scale, as softmax and torch's SDPA take (0 weighs the keys alike, a
    negative one favours the farthest); it was refused."""
    q, k, v = make_qkv(2, 2, 40, 8)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :7] = False
    fast = informer_attention(q, k, v, key_padding_mask=mask, generator=gen(1), scale=scale)
    ref = reference_informer_attention(q, k, v, samples_for(q, k, v, mask, 1),
                                       key_padding_mask=mask, scale=scale)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
