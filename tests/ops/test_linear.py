"""Linear attention (elu + 1) against its materialised reference."""

from __future__ import annotations

import pytest
import torch

from skyformer.ops.linear import linear_attention
from skyformer.ops.linear.linear import elu_feature_map
from skyformer.ops.linear.naive import reference_linear_attention
from tests.conftest import make_qkv
from tests.dispatch import Recorder


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("nk", [20, 33])  # self- and cross-attention
def test_fast_matches_naive_reference_outputs_and_gradients(masked, nk):
    q, k, v = make_qkv(2, 2, 20, 8, nk=nk, dv=5)
    mask = None
    if masked:
        mask = torch.ones(2, nk, dtype=torch.bool)
        mask[0, :3] = False
        mask[1, nk - 7:] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = linear_attention(q, k, v, key_padding_mask=mask)
    ref = reference_linear_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_weights_are_a_convex_combination():
    """With eps = 0 the weights phi(q).phi(k_j) / sum_j are positive and sum to one: a
    constant value comes back unchanged and outputs stay in the values' range."""
    q, k, v = make_qkv(1, 2, 30, 8, scale=3.0)
    const = torch.full_like(v, 2.5)
    torch.testing.assert_close(
        linear_attention(q, k, const, eps=0.0), const, rtol=1e-12, atol=1e-12
    )
    out = linear_attention(q, k, v, eps=0.0)
    assert torch.all(out <= v.amax(dim=2, keepdim=True) + 1e-12)
    assert torch.all(out >= v.amin(dim=2, keepdim=True) - 1e-12)


def test_feature_map_is_elu_plus_one():
    x = torch.tensor([-2.0, 0.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(
        elu_feature_map(x), torch.tensor([torch.e**-2.0, 1.0, 4.0], dtype=torch.float64)
    )


def test_num_features_is_accepted_and_has_no_effect():
    q, k, v = make_qkv(1, 2, 12, 8)
    base = linear_attention(q, k, v)
    for m in (1, 16, 128):
        torch.testing.assert_close(linear_attention(q, k, v, num_features=m), base, rtol=0, atol=0)


def test_bad_options():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (({"num_features": 0}, "num_features"), ({"eps": -1.0}, "eps")):
        with pytest.raises(ValueError, match=word):
            linear_attention(q, k, v, **options)


@pytest.mark.parametrize("n", [1, 11, 64, 150])
def test_causal_equals_the_naive_lower_triangular_form(n):
    from skyformer.ops.linear.naive import reference_linear_attention

    q, k, v = make_qkv(2, 2, n, 8)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, max(1, n - 3):] = False
    out = linear_attention(q, k, v, key_padding_mask=mask, causal=True)
    ref = reference_linear_attention(q, k, v, key_padding_mask=mask, causal=True)
    torch.testing.assert_close(out, ref)


def test_causal_chunks_of_any_size_agree():
    from skyformer.ops.linear.linear import causal_linear, elu_feature_map

    q, k, v = make_qkv(1, 2, 11, 4)
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    whole = causal_linear(fq, fk, v, 1e-6, chunk=16)
    for chunk in (1, 3, 4, 11):
        torch.testing.assert_close(causal_linear(fq, fk, v, 1e-6, chunk=chunk), whole)


def test_causal_output_never_depends_on_the_future():
    """Gradient of output i with respect to every input after i is exactly zero, and
    changing the future leaves outputs up to i bit-identical (chunk boundaries too)."""
    n, i = 150, 70
    q, k, v = make_qkv(1, 2, n, 8)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = linear_attention(q, k, v, causal=True)
    out[:, :, i].sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad[:, :, i + 1:], torch.zeros_like(t.grad[:, :, i + 1:]))
    future = [t.detach().clone() for t in (q, k, v)]
    for t in future:
        t[:, :, i + 1:] = torch.randn_like(t[:, :, i + 1:]) * 5
    again = linear_attention(*future, causal=True)
    assert torch.equal(again[:, :, : i + 1], out.detach()[:, :, : i + 1])


def test_causal_needs_equal_lengths():
    q, k, v = make_qkv(1, 1, 6, 4, nk=8)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        linear_attention(q, k, v, causal=True)


def test_the_backward_pass_writes_no_zero_tensor_around_the_output():
    """The numerator and the denominator come from one [N, Dv + 1] product split in two:
    its gradient is one write (a slice's backward wrote a zero tensor of that size for
    each slice, then autograd added the two). (The causal path's chunks are cropped
    by a slice, whose backward pads.)"""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, 40, 8, dv=5))
    out = linear_attention(q, k, v)
    with Recorder(lambda func, args, o: func.overloadpacket.__name__) as ops:
        torch.autograd.grad(out.square().sum(), (q, k, v))
    assert "slice_backward" not in ops.items


@pytest.mark.parametrize("causal", [False, True])
def test_eps_zero_gives_zeros_not_nan_where_no_key_is_seen(causal):
    """With eps = 0 a row whose normaliser is 0 (no real key, or features that all
    underflow) is 0, as a row without keys is in every method, not 0 / 0."""
    import skyformer

    q, k, v = make_qkv(1, 2, 6, 4)
    if not causal:  # cross-attention: real queries, every key of the element padded
        none = torch.zeros(1, 6, dtype=torch.bool)
        with pytest.warns(UserWarning, match="key_padding_mask is False everywhere"):
            out = skyformer.attention(q, k, v, "linear", eps=0.0, key_padding_mask=none,
                                      query_padding_mask=None)
        assert out.eq(0).all()
    out = skyformer.attention(q - 800, k, v, "linear", eps=0.0, causal=causal)
    assert out.isfinite().all() and out.eq(0).all()  # exp(q - 800) underflows to 0
    torch.testing.assert_close(skyformer.attention(q, k, v, "linear", eps=0.0, causal=causal),
                               skyformer.attention(q, k, v, "linear", eps=1e-300,
                                                   causal=causal), rtol=1e-12, atol=0)
