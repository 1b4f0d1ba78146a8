"""``skyformer.attention_weights``: the matrix a method applies to the values, for the
methods that declare ``Capabilities.weights``, on each device of ``tests/devices.py``."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer import CapabilityError, attention_weights, get_method, list_methods, random_key
from tests.conftest import lacks, make_qkv, mask_for
from tests.devices import devices

METHODS = list_methods()
# the methods without weights, and why: their draws or their result follow the values
# (a new method whose output is not linear in V joins them; CONTRIBUTING.md, step 3)
WITHOUT = {"kdeformer": "it samples keys by the values' norms",
           "skyformer_multipole": "its far field is clamped to the values' range",
           "softmax_multipole": "its far field is clamped to the values' range"}


def _options(method, causal=False):
    spec = get_method(method)
    options = {} if spec.capabilities.exact else {"num_features": 8}
    options.update({"max_seq_len": 40} if "max_seq_len" in spec.option_names() else {})
    return {**options, **({"causal": True} if causal else {})}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", [m for m in METHODS if m not in WITHOUT])
def test_the_weights_applied_to_the_values_give_the_output(method, device):
    """With one key for both calls, padded keys and queries, and causal where the
    method can be: ``attention_weights(q, k) @ v == attention(q, k, v)``; padded keys
    get weight 0, padded queries zero rows, a causal query no later key."""
    q, k, v = (t.to(device) for t in make_qkv(2, 2, 32, 8, dv=5, seed=3))
    mask = torch.ones(2, 32, dtype=torch.bool, device=device)
    mask[1, 25:] = False
    mask = mask_for(method, mask)
    for causal in (False, True) if get_method(method).capabilities.causal else (False,):
        options = {"key_padding_mask": mask, "generator": random_key(7, device),
                   **_options(method, causal)}
        weights = attention_weights(q, k, method, **options)
        assert weights.shape == (2, 2, 32, 32) and weights.dtype == q.dtype
        out = skyformer.attention(q, k, v, method, **options)
        torch.testing.assert_close(weights @ v, out, rtol=1e-9, atol=1e-10)
        if mask is not None:
            assert torch.all(weights[1, :, :, 25:] == 0) and torch.all(weights[1, :, 25:] == 0)
        if causal:
            assert torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize("device", devices())
def test_the_exact_methods_give_their_targets(device):
    """softmax: softmax(Q K^T / sqrt(D)) over the real keys; kernelized: the Gaussian
    kernel matrix exp(-|q_i - k_j|^2 / (2 sqrt(D))) of Skyformer's eq. (3), not normalised."""
    q, k, _ = (t.to(device) for t in make_qkv(1, 2, 12, 8, nk=10, seed=4))
    mask = torch.tensor([[True] * 7 + [False] * 3], device=device)
    logits = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask[:, None, None], -torch.inf)
    torch.testing.assert_close(attention_weights(q, k, "softmax", key_padding_mask=mask),
                               logits.softmax(-1))
    gaussian = (-torch.cdist(q, k) ** 2 / (2 * 8 ** 0.5)).exp() * mask[:, None, None]
    torch.testing.assert_close(attention_weights(q, k, "kernelized", key_padding_mask=mask),
                               gaussian)


@pytest.mark.parametrize("method", list(WITHOUT))
def test_methods_without_weights_follow_the_values_and_are_refused(method):
    """More value columns move their output, or the appended identity's columns applied
    to the values do not give it: no matrix of the queries and keys is their output, so
    ``attention_weights`` refuses them in the capability's sentence."""
    assert not get_method(method).capabilities.weights
    q, k, v = make_qkv(2, 2, 32, 8, dv=5, seed=3)
    key = random_key(7)
    out = skyformer.attention(q, k, v, method, generator=key, num_features=8)
    both = skyformer.attention(q, k, torch.cat([v, torch.eye(32, dtype=v.dtype).expand(
        2, 2, 32, 32)], -1), method, generator=key, num_features=8)
    moved = max((both[..., :5] - out).abs().max(), (both[..., 5:] @ v - out).abs().max())
    assert moved > 1e-6, WITHOUT[method]
    assert lacks(method, "weights", lambda: attention_weights(q, k, method))


def test_every_method_is_classed_by_weights():
    for method in METHODS:
        assert get_method(method).capabilities.weights != (method in WITHOUT), method


def test_the_call_is_checked_as_attention_is():
    q, k, _ = make_qkv(1, 2, 12, 8)
    with pytest.raises(CapabilityError, match="nystromformer cannot do causal masking"):
        attention_weights(q, k, "nystromformer", causal=True)
    with pytest.raises(ValueError, match="did you mean 'key_padding_mask'"):
        attention_weights(q, k, "skyformer", key_padding_mak=None)
    with pytest.raises(TypeError, match=r"k must be a tensor \[B, H, Nk, D\], got NoneType"):
        attention_weights(q, None, "softmax")
    with pytest.raises(TypeError, match=r"takes \(q, k, method\): no v"):
        attention_weights(q, k, k)
    with pytest.raises(ValueError, match=r"k holds no key \(Nk = 0\)"):
        attention_weights(q, k[:, :, :0], "skyformer")
    with pytest.raises(ValueError, match=r"q has 2 heads and k 1; .*k.repeat_interleave\(2, "
                                         r"dim=1\)"):
        attention_weights(q, k[:, :1], "softmax")


def _exact_case(name):
    """(options, q, k, v, call arguments) of one mask form of an exact method."""
    q, k, v = make_qkv(2, 2, 10, 8, dv=3, seed=6)
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[1, 6:] = False
    g = torch.Generator().manual_seed(2)
    cases = {
        "padding": ({}, {"key_padding_mask": padding}),
        "causal": ({"causal": True}, {"key_padding_mask": padding}),
        "query_padding": ({}, {"key_padding_mask": padding,
                               "query_padding_mask": padding}),
        "bool_per_head": ({}, {"attn_mask": torch.rand(2, 2, 10, 10, generator=g) > 0.4}),
        "additive": ({"scale": 0.3}, {"attn_mask": torch.randn(10, 10, generator=g,
                                                               dtype=torch.float64)}),
        "a_row_without_keys": ({}, {"attn_mask": torch.ones(10, 10, dtype=torch.bool)
                                    .index_fill(0, torch.tensor([4]), False)}),
    }
    options, call = cases[name]
    return options, q, k, v, call


@pytest.mark.parametrize("name", ["padding", "causal", "query_padding", "bool_per_head",
                                  "additive", "a_row_without_keys"])
@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_exact_weights_from_their_scores_equal_the_identity_appended(method, name,
                                                                     monkeypatch):
    """The exact methods' weights are formed from their scores and masks (O(Nq Nk D));
    they equal the columns of the identity appended to the values, mask form by mask
    form, and the output is the method's own."""
    from skyformer.registry import BoundMethod
    from skyformer.weights import call_with_weights

    options, q, k, v, call = _exact_case(name)
    bound = get_method(method).bind(**options)
    widths = []
    run = BoundMethod.__call__
    monkeypatch.setattr(BoundMethod, "__call__",
                        lambda self, q, k, v, **kw: widths.append(v.shape[-1]) or run(
                            self, q, k, v, **kw))
    out, weights = call_with_weights(bound, q, k, v, **call)
    monkeypatch.undo()
    assert widths == [3]  # the method ran on the values alone: no identity appended
    appended = bound(q, k, torch.cat([v, torch.eye(10, dtype=v.dtype).expand(2, 2, 10, 10)],
                                     -1), **call)[..., 3:]
    torch.testing.assert_close(weights, appended, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, bound(q, k, v, **call), rtol=0, atol=0)
    torch.testing.assert_close(weights @ v, out, rtol=1e-9, atol=1e-12)


def test_kernelized_weights_keep_their_accuracy_at_large_offsets():
    """float32 inputs far from the origin: the keys' mean is taken out before the
    inputs are scaled and the distances formed (the kernel does not change), which the
    expansion |q|^2 + |k|^2 - 2 q.k would otherwise lose to cancellation."""
    q, k, _ = make_qkv(1, 2, 12, 8, seed=8)
    q, k = (q + 1e4).float(), (k + 1e4).float()
    exact = (-torch.cdist(q.double(), k.double()) ** 2 / (2 * 8 ** 0.5)).exp()
    got = attention_weights(q, k, "kernelized")
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-6)


def test_kernelized_weights_of_padded_keys_are_zero_whatever_they_hold():
    """A NaN or infinite padded key (junk the method's guard zeroes) gets weight 0, as
    in the method's output; any ``kernel`` runs the PyTorch path (module doc)."""
    q, k, _ = make_qkv(1, 1, 4, 4, seed=9)
    k[0, 0, 3] = float("nan")
    k[0, 0, 2] = float("inf")
    valid = torch.tensor([[True, True, False, False]])
    weights = attention_weights(q, k, "kernelized", key_padding_mask=valid, kernel="triton")
    assert torch.isfinite(weights).all() and (weights[..., 2:] == 0).all()


def test_softmax_weights_with_dropout_are_those_of_the_call():
    """With dropout only the call knows its mask: the identity appended gives the
    weights that call dropped."""
    from skyformer.weights import call_with_weights

    q, k, v = make_qkv(1, 2, 12, 8, dv=3, seed=7)
    torch.manual_seed(0)
    out, weights = call_with_weights(get_method("softmax").bind(), q, k, v, dropout_p=0.5)
    torch.testing.assert_close(weights @ v, out, rtol=1e-9, atol=1e-12)
    assert (weights == 0).float().mean() > 0.3  # dropped entries
