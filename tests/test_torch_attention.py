"""TorchMultiheadAttention against torch.nn.MultiheadAttention (float64, tiny shapes), its
mask routing for the approximate methods, and replace_attention inside torch's
Transformer layers (fast paths included)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from skyformer import attention, kernelized_attention, random_key
from skyformer.registry import CapabilityError
from skyformer.registry.binding import BoundMethod
from skyformer.torch_attention import TorchMultiheadAttention, replace_attention

E, H, B, L, S = 8, 2, 3, 6, 5
F64 = torch.float64
EXACT = {"rtol": 0.0, "atol": 1e-12}


def pair(method="softmax", options=None, **kwargs):
    """torch's layer (``kwargs``) and ours running ``method`` (``options``) with its
    weights, float64."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    ours = TorchMultiheadAttention(E, H, dtype=F64, method=method, **kwargs, **(options or {}))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def padding(b=B, n=S):
    """torch's key_padding_mask: True = padding (the last keys of element 1)."""
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[1, n - 2:] = True
    return mask


def causal(n=L):
    """torch's bool causal mask: True = not allowed."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_parameters_initialisation_and_state_dict_match_torch():
    for kwargs in ({}, {"kdim": 4, "vdim": 6}, {"bias": False},
                   {"add_bias_kv": True, "add_zero_attn": True}):
        torch.manual_seed(3)
        ref = nn.MultiheadAttention(E, H, **kwargs)
        torch.manual_seed(3)
        ours = TorchMultiheadAttention(E, H, **kwargs)
        assert list(ours.state_dict()) == list(ref.state_dict())
        for name, t in ref.state_dict().items():  # same draws in the same order
            torch.testing.assert_close(ours.state_dict()[name], t, rtol=0, atol=0)
        for name in ("embed_dim", "num_heads", "head_dim", "dropout", "batch_first", "kdim",
                     "vdim", "_qkv_same_embed_dim", "add_zero_attn"):
            assert getattr(ours, name) == getattr(ref, name), name
        assert (ours.bias_k is None) == (ref.bias_k is None) == (ours.bias_v is None)
        ref.load_state_dict(ours.state_dict())  # and back


def test_torch_state_dict_loads_strictly_into_a_stateful_method():
    ref = nn.MultiheadAttention(E, H)
    ours = TorchMultiheadAttention(E, H, method="performer", num_features=8)
    own = {k: t.clone() for k, t in ours.state_dict().items() if k.startswith("method_state")}
    assert own  # Performer keeps its features
    ours.load_state_dict(ref.state_dict())
    for k, t in own.items():
        torch.testing.assert_close(ours.state_dict()[k], t, rtol=0, atol=0)
    torch.testing.assert_close(ours.in_proj_weight, ref.in_proj_weight, rtol=0, atol=0)


def _case(name):
    """(constructor kwargs, query, key, value, call kwargs) of each case."""
    x = rand(L, B, E)
    kv = rand(S, B, E, seed=2)
    float_pad = torch.zeros(B, S, dtype=F64).masked_fill(padding(), float("-inf"))
    cases = {
        "plain": ({}, x, x, x, {}),
        "cross": ({}, x, kv, kv, {}),
        "padding_bool": ({}, x, kv, kv, {"key_padding_mask": padding()}),
        "padding_float": ({}, x, kv, kv, {"key_padding_mask": float_pad}),
        "self_padding": ({}, x, x, x, {"key_padding_mask": padding(n=L)}),
        "attn_bool": ({}, x, kv, kv, {"attn_mask": rand(L, S) > 0.5}),
        "attn_float": ({}, x, kv, kv, {"attn_mask": rand(L, S)}),
        "attn_per_head": ({}, x, kv, kv, {"attn_mask": rand(B * H, L, S) > 0.8}),
        "attn_and_padding": ({}, x, kv, kv, {"attn_mask": rand(L, S),
                                             "key_padding_mask": float_pad}),
        "causal": ({}, x, x, x, {"attn_mask": causal(), "is_causal": True}),
        "causal_padding": ({}, x, x, x, {"attn_mask": causal(), "is_causal": True,
                                         "key_padding_mask": padding(n=L)}),
        "batch_first": ({"batch_first": True}, x.transpose(0, 1), kv.transpose(0, 1),
                        kv.transpose(0, 1), {"key_padding_mask": padding()}),
        "unbatched": ({}, x[:, 0], kv[:, 0], kv[:, 0],
                      {"key_padding_mask": padding()[1], "attn_mask": causal()[:, :S]}),
        "kdim_vdim": ({"kdim": 4, "vdim": 6}, x, rand(S, B, 4), rand(S, B, 6),
                      {"key_padding_mask": padding()}),
        "dropout_eval": ({"dropout": 0.5}, x, x, x, {}),
    }
    return cases[name]


@pytest.mark.parametrize("name", [
    "plain", "cross", "padding_bool", "padding_float", "self_padding", "attn_bool",
    "attn_float", "attn_per_head", "attn_and_padding", "causal", "causal_padding",
    "batch_first", "unbatched", "kdim_vdim", "dropout_eval"])
def test_softmax_equals_torch(name):
    kwargs, query, key, value, call = _case(name)
    ref, ours = pair(**kwargs)
    ref.eval(), ours.eval()
    expected = ref(query, key, value, need_weights=False, **call)[0]
    out, weights = ours(query, key, value, need_weights=False, **call)
    assert weights is None and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **EXACT)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_padding", [False, True])
def test_softmax_follows_torch_for_a_wrong_is_causal_hint(need_weights, with_padding):
    """is_causal=True with a mask that is not causal: torch's SDPA path runs the hint
    alone (no key_padding_mask, need_weights=False), else the mask; softmax does the
    same (torch's inference fast path, not taken here in training, applies the mask)."""
    ref, ours = pair()
    x = rand(L, B, E)
    call = {"attn_mask": torch.zeros(L, L, dtype=torch.bool), "is_causal": True,
            "need_weights": need_weights,
            "key_padding_mask": padding(n=L) if with_padding else None}
    expected = ref(x, x, x, **call)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # need_weights=True: no weights, a warning
        out = ours(x, x, x, **call)[0]
    torch.testing.assert_close(out, expected, **EXACT)
    unmasked = ref(x, x, x, need_weights=False, key_padding_mask=call["key_padding_mask"])[0]
    hint_alone = not need_weights and not with_padding
    assert torch.allclose(out, unmasked) != hint_alone  # the case tells the two apart


@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_a_causal_hint_in_cross_attention_is_sdpas_top_left_mask(method):
    """L != S with is_causal=True alone: torch's SDPA aligns the causal mask top left (a
    TransformerDecoderLayer's memory_is_causal); the exact methods used to refuse it."""
    ref, ours = pair(method)
    x, memory = rand(L, B, E), rand(S, B, E)
    wrong = torch.zeros(L, S, dtype=torch.bool)  # the hint wins over the mask, as in torch
    out = ours(x, memory, memory, attn_mask=wrong, is_causal=True, need_weights=False)[0]
    top_left = torch.ones(L, S, dtype=torch.bool).triu(1)
    expected = ours(x, memory, memory, attn_mask=top_left, need_weights=False)[0]
    torch.testing.assert_close(out, expected, **EXACT)
    if method == "softmax":
        hinted = ref(x, memory, memory, attn_mask=wrong, is_causal=True, need_weights=False)
        torch.testing.assert_close(out, hinted[0], **EXACT)


def _heads(layer, x, kv):
    """Batch-first input projections as [B, H, N, Dh]."""
    w_q, w_k, w_v = layer.in_proj_weight.chunk(3)
    b_q, b_k, b_v = layer.in_proj_bias.chunk(3)
    return [nn.functional.linear(t, w, b).unflatten(-1, (H, E // H)).transpose(1, 2)
            for t, w, b in ((x, w_q, b_q), (kv, w_k, b_k), (kv, w_v, b_v))]


def test_kernelized_equals_the_function_on_projected_heads():
    _, ours = pair("kernelized", batch_first=True)
    x, kv, pad = rand(B, L, E), rand(B, S, E, seed=2), padding()
    q, k, v = _heads(ours, x, kv)
    heads = kernelized_attention(q, k, v, key_padding_mask=~pad)
    expected = ours.out_proj(heads.transpose(1, 2).reshape(B, L, E))
    out = ours(x, kv, kv, key_padding_mask=pad, need_weights=False)[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_skyformer_is_reproducible_and_kernelized_at_its_exactness_limit():
    x, pad = rand(B, L, E), padding(n=L)
    _, exact = pair("kernelized", batch_first=True)
    # every row of [Q; K] a landmark, no ridge, exact inverse: C~ = C (test_skyformer.py)
    _, limit = pair("skyformer", {"num_features": 2 * L, "gamma": 0.0, "pinv": "exact"},
                    batch_first=True)
    _, sky = pair("skyformer", {"num_features": 4}, batch_first=True)
    call = {"key_padding_mask": pad, "need_weights": False}
    real = ~pad
    expected = exact(x, x, x, **call)[0]
    torch.testing.assert_close(limit(x, x, x, **call, generator=gen())[0][real],
                               expected[real], rtol=1e-7, atol=1e-9)
    first = sky(x, x, x, **call, generator=gen(0))[0]
    torch.testing.assert_close(sky(x, x, x, **call, generator=gen(0))[0], first, rtol=0,
                               atol=0)
    assert not torch.allclose(sky(x, x, x, **call, generator=gen(1))[0], first)
    assert (first[1, L - 2:] == sky.out_proj.bias).all()  # padded queries: output row 0


def test_approximate_methods_read_torch_masks_as_key_padding_and_causal():
    _, sky = pair("skyformer", {"num_features": 4}, batch_first=True)
    x, pad = rand(B, L, E), padding(n=L)
    float_pad = torch.zeros(B, L, dtype=F64).masked_fill(pad, float("-inf"))

    def run(**call):
        return sky(x, x, x, need_weights=False, generator=gen(), **call)[0]

    by_bool = run(key_padding_mask=pad)
    torch.testing.assert_close(run(key_padding_mask=float_pad), by_bool, rtol=0, atol=0)
    torch.testing.assert_close(run(attn_mask=pad[:, None, :].expand(B, L, L)
                                   .repeat_interleave(H, 0)), by_bool, rtol=0, atol=0)
    hinted = run(attn_mask=causal(), is_causal=True, key_padding_mask=pad)
    read = run(attn_mask=causal().double().masked_fill(causal(), float("-inf")),
               key_padding_mask=float_pad)  # the same mask, read without the hint
    torch.testing.assert_close(read, hinted, rtol=0, atol=0)
    assert not torch.allclose(hinted, by_bool)


@pytest.mark.parametrize("method, call, match", [
    ("skyformer", {"attn_mask": torch.ones(L, L, dtype=torch.bool).triu(2) |
                   torch.ones(L, L, dtype=torch.bool).tril(-2)},
     "neither key padding nor causal.*softmax' or 'kernelized'"),
    ("skyformer", {"attn_mask": rand(L, L)}, "carries a bias"),
    ("skyformer", {"attn_mask": torch.eye(L, dtype=torch.bool).repeat(B * H, 1, 1)
                   .index_fill(0, torch.tensor([1]), False)}, "differs between heads"),
    ("softmax", {"attn_mask": causal()[:, :3]}, r"attn_mask must have shape \[6, 6\]"),
    ("softmax", {"attn_mask": torch.zeros(L, L, dtype=torch.int64)}, "bool tensor"),
    ("softmax", {"is_causal": True}, "needs the mask with it"),
    ("linear", {"key_padding_mask": padding(n=L).long()}, "bool tensor"),
])
def test_refused_calls_get_sentences(method, call, match):
    _, layer = pair(method)
    x = rand(L, B, E)
    with pytest.raises((ValueError, TypeError), match=match):
        layer(x, x, x, need_weights=False, **call)


def test_an_unbatched_calls_padding_mask_of_the_wrong_length_gets_its_own_shape():
    """The sentence asked for [1, S], which an unbatched call then refused as 2-D."""
    _, layer = pair("softmax")
    x = rand(L, E)
    with pytest.raises(ValueError, match=rf"key_padding_mask must have shape \[{L}\], got "
                                         rf"\[{L + 1}\]"):
        layer(x, x, x, key_padding_mask=torch.zeros(L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"attn_mask must have shape \[{L}, {L}\] or "
                                         rf"\[{H}, {L}, {L}\]"):
        layer(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=torch.bool))


def test_refused_configurations_get_sentences():
    with pytest.raises(CapabilityError, match=r"add_zero_attn appends keys.*bigbird cannot "
                                              r"attend \(self-attention only\).*softmax"):
        TorchMultiheadAttention(E, H, add_zero_attn=True, method="bigbird")
    with pytest.raises(ValueError, match=r"embed_dim \(8\) must be divisible by num_heads"):
        TorchMultiheadAttention(E, 3)
    _, sky = pair("skyformer")
    with pytest.raises(ValueError, match="is_causal with 6 queries and 5 keys"):
        sky(rand(L, B, E), rand(S, B, E), rand(S, B, E), attn_mask=causal()[:, :S],
            is_causal=True, need_weights=False)
    _, reformer = pair("reformer")  # self-attention only
    with pytest.raises(CapabilityError, match="reformer cannot attend with a different"):
        reformer(rand(L, B, E), rand(S, B, E), rand(S, B, E), need_weights=False)


def test_numpy_sizes_and_a_truthy_bias_are_taken_as_torch_takes_them():
    """torch's layer stores np.int64 sizes (a random search's) or 0-d integer tensors, and
    takes any truthy bias:
    replace_attention refused such a model with advice its user could not follow (pass
    int(value), for a value inside torch's layer), and the drop-in refused bias=1."""
    import numpy as np

    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(np.int64(E), np.int64(H), 0.0, 1, batch_first=True,
                                   dtype=F64)
    model = nn.Sequential(theirs)
    replace_attention(model, "softmax")
    ours = model[0]
    assert isinstance(ours, TorchMultiheadAttention) and type(ours.embed_dim) is int
    x = rand(B, L, E)
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0],
                               theirs(x, x, x, need_weights=False)[0])
    built = TorchMultiheadAttention(np.int64(E), np.int64(H), 0.0, 1)
    assert built.in_proj_bias is not None and built.num_heads == H
    built = TorchMultiheadAttention(torch.tensor(E), torch.tensor(H), kdim=torch.tensor(4))
    assert (built.embed_dim, built.num_heads, built.kdim) == (E, H, 4)
    with pytest.raises(ValueError, match=r"embed_dim must be a positive integer"):
        TorchMultiheadAttention(torch.tensor([E]), H)


APPENDED = [{"add_bias_kv": True}, {"add_zero_attn": True},
            {"add_bias_kv": True, "add_zero_attn": True}]


@pytest.mark.parametrize("appended", APPENDED, ids=["bias", "zero", "both"])
@pytest.mark.parametrize("name", ["plain", "padding_bool", "padding_float", "attn_per_head",
                                  "attn_and_padding", "causal", "causal_padding",
                                  "batch_first", "unbatched", "kdim_vdim"])
def test_softmax_with_appended_keys_equals_torch(name, appended):
    """``add_bias_kv`` and ``add_zero_attn``: torch's keys and mask columns, the hint
    alone included (SDPA's top-left causal mask over ``S + n`` keys), outputs and
    weights."""
    kwargs, query, key, value, call = _case(name)
    ref, ours = pair(**kwargs, **appended)
    ours.return_weights = True
    for need_weights in (False, True):
        expected = ref(query, key, value, need_weights=need_weights,
                       average_attn_weights=False, **call)
        got = ours(query, key, value, need_weights=need_weights, average_attn_weights=False,
                   **call)
        torch.testing.assert_close(got[0], expected[0], **EXACT)
        if need_weights:
            torch.testing.assert_close(got[1], expected[1], **EXACT)
    (got[0].square().sum() + expected[0].square().sum()).backward()
    for name in ("bias_k", "bias_v", "in_proj_bias"):
        if getattr(ref, name) is not None:
            torch.testing.assert_close(getattr(ours, name).grad, getattr(ref, name).grad,
                                       rtol=1e-10, atol=1e-12)


def test_from_torch_takes_the_appended_keys_and_their_parameters():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True, dtype=F64)
    layer = TorchMultiheadAttention.from_torch(mha, "softmax")
    assert layer.bias_k is mha.bias_k and layer.bias_v is mha.bias_v and layer.add_zero_attn
    assert "add_bias_kv=True, add_zero_attn=True" in repr(layer)
    x = rand(L, B, E)
    torch.testing.assert_close(layer(x, x, x, need_weights=False)[0],
                               mha(x, x, x, need_weights=False)[0], **EXACT)


def test_approximate_methods_attend_the_appended_keys():
    """skyformer with ``add_bias_kv`` and ``add_zero_attn`` is the method over the
    projected keys with torch's two appended, every query attending them; in
    self-attention the padded queries stay padding (output rows 0); with ``is_causal``
    a sentence."""
    layer = TorchMultiheadAttention(E, H, dtype=F64, method="skyformer", num_features=4,
                                    add_bias_kv=True, add_zero_attn=True).eval()
    x, pad = rand(L, B, E), padding(n=L)
    out = layer(x, x, x, key_padding_mask=pad, need_weights=False, generator=random_key(3))[0]
    q, k, v = _heads(layer, x.transpose(0, 1), x.transpose(0, 1))
    appended = [torch.cat([t, bias.reshape(1, H, 1, E // H).expand(B, H, 1, E // H),
                           torch.zeros(B, H, 1, E // H, dtype=F64)], dim=2)
                for t, bias in ((k, layer.bias_k), (v, layer.bias_v))]
    heads = attention(q, *appended, "skyformer", num_features=4,
                      key_padding_mask=torch.cat([~pad, torch.ones(B, 2, dtype=torch.bool)], 1),
                      query_padding_mask=~pad, generator=random_key(3))
    expected = layer.out_proj(heads.permute(2, 0, 1, 3).reshape(L, B, E))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert (out[L - 2:, 1] == layer.out_proj.bias).all()
    for hint in (True, False):  # the hint, or a causal mask read as one
        with pytest.raises(ValueError, match=r"add_bias_kv and add_zero_attn append keys that "
                                             r"every query attends.*drop is_causal=True"):
            layer(x, x, x, attn_mask=causal(), is_causal=hint, need_weights=False)
    # padding given as an attn_mask: the same padded queries, the same output
    by_mask = layer(x, x, x, attn_mask=pad[1].expand(L, L), need_weights=False,
                    generator=random_key(3))[0][:, 1]
    by_padding = layer(x, x, x, key_padding_mask=pad[1:2].expand(B, L), need_weights=False,
                       generator=random_key(3))[0][:, 1]
    torch.testing.assert_close(by_mask, by_padding, rtol=1e-10, atol=1e-12)
    assert (by_mask[L - 2:] == layer.out_proj.bias).all()
    no_causal = TorchMultiheadAttention(E, H, dtype=F64, method="nystromformer",
                                        num_features=4, add_zero_attn=True)
    with pytest.raises(CapabilityError, match="nystromformer cannot"):
        no_causal(x, x, x, attn_mask=causal(), is_causal=True, need_weights=False)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("name", ["cross", "padding_float", "attn_per_head", "causal_padding",
                                  "batch_first", "unbatched", "kdim_vdim"])
def test_softmax_built_to_return_weights_gives_torchs(name, average):
    """``return_weights=True``: ``need_weights=True`` gives torch's weights (and output),
    averaged over the heads or not, batched or not."""
    kwargs, query, key, value, call = _case(name)
    ref, _ = pair(**kwargs)
    ours = TorchMultiheadAttention(E, H, dtype=F64, method="softmax", return_weights=True,
                                   **kwargs)
    ours.load_state_dict(ref.state_dict())
    expected = ref(query, key, value, average_attn_weights=average, **call)
    got = ours(query, key, value, average_attn_weights=average, **call)
    torch.testing.assert_close(got[1], expected[1], **EXACT)
    torch.testing.assert_close(got[0], expected[0], **EXACT)
    assert ours(query, key, value, need_weights=False, **call)[1] is None


def test_an_approximate_layers_weights_give_its_output():
    """skyformer's weights (``skyformer.attention_weights``'s, from the same call) applied
    to the projected values, through the output projection, are its output; padded
    queries (self-attention) get zero rows, padded keys no weight."""
    layer = TorchMultiheadAttention(E, H, dtype=F64, method="skyformer", num_features=3,
                                    return_weights=True).eval()
    x, pad = rand(L, B, E), padding(n=L)
    out, weights = layer(x, x, x, key_padding_mask=pad, average_attn_weights=False,
                         generator=random_key(2))
    assert weights.shape == (B, H, L, L)
    values = nn.functional.linear(x, *(t.chunk(3)[2] for t in (layer.in_proj_weight,
                                                               layer.in_proj_bias)))
    heads = values.unflatten(-1, (H, E // H)).permute(1, 2, 0, 3)  # [B, H, L, Dh]
    attended = (weights @ heads).permute(2, 0, 1, 3).reshape(L, B, E)
    torch.testing.assert_close(out, layer.out_proj(attended), rtol=1e-9, atol=1e-10)
    assert torch.all(weights[1, :, :, -2:] == 0) and torch.all(weights[1, :, -2:] == 0)
    _, averaged = layer(x, x, x, key_padding_mask=pad, generator=random_key(2))
    torch.testing.assert_close(averaged, weights.mean(1), **EXACT)


def test_return_weights_is_refused_where_the_method_has_no_weights():
    with pytest.raises(CapabilityError, match=r"^TorchMultiheadAttention: return_weights=True, "
                       r"but kdeformer cannot give attention weights .*; methods that can: "
                       r"softmax, kernelized, skyformer"):
        TorchMultiheadAttention(E, H, method="kdeformer", return_weights=True)
    with pytest.raises(TypeError, match="return_weights must be True or False, got 1"):
        TorchMultiheadAttention(E, H, method="skyformer", return_weights=1)
    model = nn.Sequential(nn.MultiheadAttention(E, H))
    with pytest.raises(CapabilityError, match="return_weights=True, but softmax_multipole"):
        replace_attention(model, "softmax_multipole", return_weights=True)
    assert isinstance(model[0], nn.MultiheadAttention)  # left as it was
    swapped = replace_attention(model, "performer", return_weights=True, num_features=4)
    assert swapped[0].return_weights and "return_weights=True" in repr(swapped[0])
    assert replace_attention(swapped, "skyformer")[0].return_weights  # kept unless given
    with pytest.warns(UserWarning, match=r"model.0 was built with return_weights=True, but "
                      r"kdeformer has no attention matrix") as said:
        assert not replace_attention(swapped, "kdeformer")[0].return_weights
    assert said[0].filename == __file__  # the caller's line
    assert not replace_attention(swapped, "performer", return_weights=False)[0].return_weights
    swapped = replace_attention(swapped, "performer", return_weights=True, num_features=4)
    x = torch.randn(L, B, E)
    assert swapped[0](x, x, x)[1].shape == (B, L, L)
    with pytest.warns(UserWarning, match="need_weights=False to silence this, or keep"):
        TorchMultiheadAttention(E, H, method="kdeformer")(x, x, x)  # no return_weights hint


def test_need_weights_warns_once_per_layer():
    _, ours = pair()
    x = rand(L, B, E)
    with pytest.warns(UserWarning, match="need_weights=False to silence this, build the layer "
                      "with return_weights=True") as said:
        assert ours(x, x, x)[1] is None
    assert said[0].filename == __file__  # the caller's line, for a filter by module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, x, x)  # warned once already
        pair()[1](x, x, x, need_weights=False)


def test_the_warning_reaches_code_without_a_source_file():
    """Code run by ``python -c`` (or from stdin) has a module whose loader cannot read
    its source: the warning raised ImportError there, so the call failed."""
    import subprocess
    import sys

    code = ("import torch; from skyformer import TorchMultiheadAttention as T; "
            "x = torch.randn(2, 3, 8); print(T(8, 2, batch_first=True)(x, x, x)[1])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert "<string>:1: UserWarning: TorchMultiheadAttention (skyformer) returns" in \
        done.stderr


def test_masks_and_nested_inputs_as_torch_takes_them():
    """A float mask neither float32 nor of the query's dtype is refused, as torch's
    layer refuses it (it was taken); a jagged nested batch comes back jagged (it came
    back strided); ``merge_masks`` is torch's."""
    ref, ours = pair()
    x = rand(L, B, E)
    for name, shape in (("key_padding_mask", (B, L)), ("attn_mask", (L, L))):
        mask = torch.zeros(shape, dtype=torch.float16)
        with pytest.raises(TypeError, match=f"{name} is torch.float16 but the query is "
                                            f"torch.float64; .* pass {name}.to"):
            ours(x, x, x, need_weights=False, **{name: mask})
        with pytest.raises(RuntimeError):  # torch's own refusal
            ref(x, x, x, need_weights=False, **{name: mask})
        taken = torch.zeros(shape, dtype=torch.float32)  # as torch's SDPA takes it
        torch.testing.assert_close(ours(x, x, x, need_weights=False, **{name: taken})[0],
                                   ref(x, x, x, need_weights=False, **{name: taken})[0])
    first = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64).eval()
    layer = TorchMultiheadAttention.from_torch(first, "softmax").eval()
    rows = [rand(3, E), rand(5, E)]
    jagged = torch.nested.nested_tensor(rows, layout=torch.jagged)
    strided = torch.nested.nested_tensor(rows)
    out, strided_out = layer(jagged, jagged, jagged, need_weights=False)[0], \
        layer(strided, strided, strided, need_weights=False)[0]
    assert out.layout == torch.jagged and strided_out.layout == torch.strided
    for a, b in zip(out.unbind(), strided_out.unbind(), strict=True):
        torch.testing.assert_close(a, b)
    y = rand(B, L, E)
    attn = torch.rand(L, L) > 0.7
    pad = padding(n=L)
    for masks in ((attn, None), (None, pad), (attn, pad), (None, None)):
        got, want = layer.merge_masks(*masks, y), first.merge_masks(*masks, y)
        assert got[1] == want[1]
        assert (got[0] is None and want[0] is None) or torch.equal(got[0], want[0])


def encoder(layers=2, **kwargs):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True, dtype=F64,
                                       **kwargs)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=True)


@pytest.mark.parametrize("train", [True, False])
def test_encoder_with_softmax_equals_torch_with_padding_and_causal_masks(train):
    ref = encoder()
    model = replace_attention(copy.deepcopy(ref), "softmax")
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    x, pad = rand(B, L, E), padding(n=L)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    for call in ({"src_key_padding_mask": pad}, {"mask": mask, "src_key_padding_mask": pad},
                 {"mask": mask, "is_causal": True}):
        ref.train(train), model.train(train)
        with torch.set_grad_enabled(train):
            expected, out = ref(x, **call), model(x, **call)
        real = ~pad if "src_key_padding_mask" in call else slice(None)
        torch.testing.assert_close(out[real], expected[real], rtol=1e-12, atol=1e-12)
    if train:
        model(x, src_key_padding_mask=pad).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_no_fast_path_bypasses_the_method_in_eval_under_no_grad(monkeypatch):
    calls = []
    original = BoundMethod.__call__

    def spy(self, *args, **kwargs):
        calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BoundMethod, "__call__", spy)
    ref = encoder(layers=2)
    model = replace_attention(copy.deepcopy(ref), "skyformer", num_features=4).eval()
    ref.eval()
    x, pad = rand(B, L, E), padding(n=L)
    with torch.no_grad():
        for call in ({}, {"src_key_padding_mask": pad}):  # the layers' path, the nested one
            calls.clear()
            out = model(x, **call)
            assert calls == ["skyformer"] * 2
            assert not torch.allclose(out, ref(x, **call))  # not torch's exact softmax
        layer = model.layers[0]  # the fused layer path alone
        calls.clear()
        layer(x)
        assert calls == ["skyformer"]


def test_decoder_and_transformer_run_replaced_attention():
    torch.manual_seed(0)
    ref = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 16, dropout=0.0, dtype=F64), 2)
    model = replace_attention(copy.deepcopy(ref), "softmax")
    tgt, memory = rand(L, B, E), rand(S, B, E, seed=2)
    call = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(L, dtype=F64),
            "tgt_is_causal": True, "tgt_key_padding_mask": padding(n=L),
            "memory_key_padding_mask": padding()}
    for train in (True, False):
        ref.train(train), model.train(train)
        torch.testing.assert_close(model(tgt, memory, **call), ref(tgt, memory, **call),
                                   rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    transformer = nn.Transformer(E, H, 1, 1, 16, dropout=0.1, batch_first=True)
    with pytest.warns(UserWarning, match=r"model\.decoder\.layers\.0\.multihead_attn is "
                                         r"the cross-attention of nn\.TransformerDecoderLayer"):
        replace_attention(transformer, "skyformer", num_features=4)
    assert sum(isinstance(m, TorchMultiheadAttention) for m in transformer.modules()) == 3
    src, tgt = torch.randn(B, S, E), torch.randn(B, L, E)
    transformer(src, tgt, tgt_mask=transformer.generate_square_subsequent_mask(L),
                tgt_is_causal=True).sum().backward()
    with torch.no_grad():
        transformer.eval()(src, tgt, src_key_padding_mask=padding(),
                           memory_key_padding_mask=padding())


def test_a_process_group_is_said_to_be_multiheadattentions():
    """process_group was refused as a misspelt option of the method ('skyformer has no
    option process_group'); sequence parallelism is the other layer's."""
    with pytest.raises(TypeError, match=r"takes no process_group; sequence parallelism is "
                                        r"skyformer\.MultiHeadAttention's"):
        TorchMultiheadAttention(E, H, method="skyformer", process_group=None)
    with pytest.raises(TypeError, match="takes no process_group"):
        replace_attention(nn.TransformerEncoderLayer(E, H, 16), "skyformer", process_group=None)


def test_a_causal_mask_in_sdpas_convention_is_named_as_such():
    """torch's layer takes True = not allowed: an SDPA-style tril mask reaches an
    approximate method as the complement of a causal one, and the sentence says so."""
    _, ours = pair("skyformer", {"num_features": 4})
    x = rand(L, B, E)
    with pytest.raises(ValueError, match=r"complement of a causal mask .* pass ~mask"):
        ours(x, x, x, attn_mask=~causal(), need_weights=False)


def test_a_decoders_cross_attention_warns_of_methods_mixing_queries():
    """In nn.TransformerDecoderLayer's cross-attention the queries are the target tokens
    in order: skyformer (landmarks drawn from them) lets an earlier position's output
    move with a later token, and replace_attention says so naming the layers and the
    way out; performer (each output from its own query) swaps in without a word."""
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 16, dropout=0.0,
                                                               dtype=F64), 2)
    tgt, memory = rand(12, 1, E), rand(S, 1, E, seed=2)
    later = tgt.clone()
    later[6:] += 1.0
    mask = nn.Transformer.generate_square_subsequent_mask(12, dtype=F64)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.multihead_attn, "
                                         r"model\.layers\.1\.multihead_attn are the cross-"
                                         r"attention .* self_attn alone .*\(softmax, "
                                         r"kernelized, linformer, linear, performer\)"):
        mixed = replace_attention(copy.deepcopy(decoder), "skyformer", num_features=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = replace_attention(copy.deepcopy(decoder), "performer", num_features=4)
    for model, leaks in ((mixed, True), (own, False)):
        outputs = []
        for target in (tgt, later):  # the same draws for both calls: only the tokens differ
            torch.manual_seed(3)
            with torch.no_grad():
                outputs.append(model(target, memory, tgt_mask=mask, tgt_is_causal=True)[:6])
        a, b = outputs
        assert (a - b).abs().max() > 1e-6 if leaks else torch.equal(a, b)


def test_replace_attention_keeps_weights_mode_dtype_and_sharing():
    shared = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    shared.in_proj_bias.requires_grad_(False)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared), "c": nn.Linear(E, E)})
    model.eval()
    state = copy.deepcopy(shared.state_dict())
    assert replace_attention(model, "kernelized") is model
    new = model["a"]
    assert isinstance(new, TorchMultiheadAttention) and model["b"][0] is new
    assert new.method == "kernelized" and new.batch_first and not new.training
    assert new.in_proj_weight.dtype == F64 and not new.in_proj_bias.requires_grad
    for name, t in state.items():
        torch.testing.assert_close(new.state_dict()[name], t, rtol=0, atol=0)
    assert isinstance(replace_attention(nn.MultiheadAttention(E, H)), TorchMultiheadAttention)


def test_replace_attention_keeps_the_parameter_objects_an_optimizer_holds():
    """An optimizer built before the swap trains the new layer, and a weight tied to
    another module stays tied (fresh parameters left both behind without a word)."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    head = nn.Linear(E, E, dtype=F64)
    head.weight = mha.out_proj.weight
    model = nn.ModuleDict({"mha": mha, "head": head})
    before = dict(mha.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replace_attention(model, "softmax")
    new = model["mha"]
    assert all(p is before[name] for name, p in new.named_parameters()
               if not name.startswith("method_state."))
    assert model["head"].weight is new.out_proj.weight
    start = new.in_proj_weight.detach().clone()
    x = rand(B, L, E)
    model["head"](new(x, x, x, need_weights=False)[0]).square().sum().backward()
    optimizer.step()
    assert not torch.equal(new.in_proj_weight, start)
    rebuilt = TorchMultiheadAttention.from_torch(new, "kernelized")
    assert rebuilt.in_proj_weight is new.in_proj_weight


def test_replace_attention_refuses_in_a_sentence_and_changes_nothing():
    class Mine(nn.MultiheadAttention):
        pass

    model = nn.Sequential(nn.MultiheadAttention(E, H), nn.ModuleList([Mine(E, H)]))
    with pytest.raises(TypeError, match=r"model\.1\.0: .*Mine is a subclass"):
        replace_attention(model)
    assert type(model[0]) is nn.MultiheadAttention
    model = nn.Sequential(nn.MultiheadAttention(E, H),
                          nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(CapabilityError, match=r"model\.1: add_bias_kv appends keys.*reformer "
                                              r"cannot attend \(self-attention only\)"):
        replace_attention(model, "reformer")
    assert type(model[0]) is nn.MultiheadAttention

    with pytest.raises(TypeError, match=r"model\.0: .*Mine is a subclass") as refused:
        replace_attention(nn.Sequential(Mine(E, H, bias=False)))
    fix = re.search(r"new = (.*); new\.load_state_dict\(mha\.state_dict\(\)\)",
                    str(refused.value))
    mha = Mine(E, H, bias=False)  # the swap the sentence gives works for such a layer
    new = eval(fix.group(1).replace("method=...", "method='softmax'"),
               {"TorchMultiheadAttention": TorchMultiheadAttention, "mha": mha})
    new.load_state_dict(mha.state_dict())
    with pytest.raises(ValueError, match=r"no option 'num_featres' \(did you mean"):
        replace_attention(nn.Sequential(nn.MultiheadAttention(E, H)), num_featres=4)


def test_a_dropout_after_the_layer_draws_torchs_mask():
    """The output is torch's [L, B, E] in memory (batch-first a view of it), so a
    decoder in training with dropout equals torch's under one seed; laid out [B, L, E]
    the dropout after the layer drew another mask (outputs 1.46 apart)."""
    for batch_first in (False, True):
        torch.manual_seed(0)
        ref = nn.TransformerDecoder(nn.TransformerDecoderLayer(
            E, H, 16, dropout=0.1, batch_first=batch_first, dtype=F64), 2)
        ours = replace_attention(copy.deepcopy(ref), "softmax")
        tgt, memory = rand(B, L, E), rand(B, S, E, seed=2)
        if not batch_first:
            tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
        outs = []
        for model in (ref, ours):
            torch.manual_seed(5)
            outs.append(model.train()(tgt, memory, tgt_mask=causal()))
        torch.testing.assert_close(outs[1], outs[0], **EXACT)


def test_no_keys_give_the_output_projection_of_zeros_as_torch():
    for method in ("softmax", "skyformer"):
        ref, ours = pair(method, {"num_features": 4} if method == "skyformer" else None)
        nn.init.normal_(ref.out_proj.bias)
        ours.load_state_dict(ref.state_dict())
        q, kv = rand(L, B, E), rand(0, B, E, seed=2)
        torch.testing.assert_close(ours(q, kv, kv, need_weights=False)[0],
                                   ref(q, kv, kv, need_weights=False)[0], **EXACT)


def test_compiled_with_torchs_float_padding_mask():
    """torch's layers hand the padding mask on as 0 / -inf floats; under torch.compile
    an approximate method could not read them ("the values of a float attn_mask cannot
    be read"), so a padded model did not compile. There 0 is a real key, anything else
    padding; the default need_weights=True does not break the graph either."""
    torch.manual_seed(0)
    layer = TorchMultiheadAttention(E, H, method="skyformer", num_features=4,
                                    batch_first=True)
    key = __import__("skyformer").random_key(0)
    x, pad = torch.randn(B, L, E), padding(n=L)
    additive = torch.zeros(B, L).masked_fill(pad, float("-inf"))
    eager = layer(x, x, x, key_padding_mask=pad, generator=key)[0]

    def call(x, additive):
        return layer(x, x, x, key_padding_mask=additive, generator=key)[0]

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(x, additive)
    torch.testing.assert_close(compiled, eager)


def test_replace_attention_goes_from_method_to_method_and_says_when_it_did_nothing():
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, dropout=0.0,
                                                           dtype=F64), 2)
    model = replace_attention(copy.deepcopy(ref), "linear")
    model = replace_attention(model, "softmax")  # the linear layers rebuilt, weights kept
    assert all(m.method == "softmax" for m in model.modules()
               if isinstance(m, TorchMultiheadAttention))
    x = rand(L, B, E)
    torch.testing.assert_close(model(x), ref(x), **EXACT)
    with pytest.warns(UserWarning, match="holds no torch.nn.MultiheadAttention; nothing"):
        replace_attention(nn.Linear(2, 2), "skyformer")
    with pytest.raises(ValueError, match="skyfromer"):
        replace_attention(nn.Linear(2, 2), "skyfromer")
    hooked = nn.Sequential(nn.MultiheadAttention(E, H))
    hooked[0].register_forward_hook(lambda *args: None)
    with pytest.warns(UserWarning, match=r"model\.0 has hooks registered on it; they stay"):
        replace_attention(hooked, "softmax")


def test_swapping_to_the_same_method_keeps_its_learned_state():
    """Switching return_weights by a second swap drew Linformer's learned projections
    anew (outside the optimizer built on the first); the same method with the same
    options keeps the state module itself, other options draw it anew with a warning."""
    model = nn.Sequential(nn.MultiheadAttention(E, H, dtype=F64))
    replace_attention(model, "linformer", seq_len=L, num_features=4)
    state = model[0].method_state
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = rand(L, B, E)
    model[0](x, x, x, need_weights=False)[0].square().sum().backward()
    optimizer.step()
    before = model[0](x, x, x, need_weights=False)[0]
    replace_attention(model, "linformer", seq_len=L, num_features=4, return_weights=True)
    assert model[0].method_state is state and model[0].return_weights
    torch.testing.assert_close(model[0](x, x, x, need_weights=False)[0], before, **EXACT)
    replace_attention(model, "linformer[num_features=4]", seq_len=L)  # the same, written so
    assert model[0].method_state is state
    with pytest.warns(UserWarning, match=r"model\.0 ran linformer\[num_features=4\] with "
                                         r"other options: its learned per-layer parameters "
                                         r"are left behind") as said:
        replace_attention(model, "linformer", seq_len=L, num_features=3)
    assert said[0].filename == __file__
    assert model[0].method_state is not state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replace_attention(model, "performer", num_features=4)  # another method: no word
    features = model[0].method_state
    with pytest.warns(UserWarning, match=r"model\.0 ran performer with other options: "
                                         r"its per-layer random draws are left behind"):
        replace_attention(model, "performer", num_features=6)  # Performer's features
    assert model[0].method_state is not features


def test_a_subclass_keeps_its_class_and_the_output_projection_its_hooks():
    """A subclass of the layer was rebuilt as the base class (its forward lost), and a
    hook or parametrization on out_proj was dropped (a new out_proj module)."""
    class Doubled(TorchMultiheadAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return 2 * out, weights

    model = nn.Sequential(Doubled(E, H, dtype=F64, method="softmax"))
    fired = []
    model[0].out_proj.register_forward_hook(lambda *args: fired.append(1))
    torch.nn.utils.parametrizations.weight_norm(model[0].out_proj)
    x = rand(L, B, E)
    want = model[0](x, x, x, need_weights=False)[0]
    replace_attention(model, "kernelized")
    assert type(model[0]) is Doubled and len(fired) == 1
    got = model[0](x, x, x, need_weights=False)[0]
    assert len(fired) == 2
    assert not torch.allclose(got, want)  # another method, the same projections
    replace_attention(model, "softmax")
    torch.testing.assert_close(model[0](x, x, x, need_weights=False)[0], want, **EXACT)

    class Sub(TorchMultiheadAttention):
        pass

    assert type(Sub.from_torch(model[0], "linear")) is Sub  # the class asked for
    assert type(TorchMultiheadAttention.from_torch(model[0], "linear")) is Doubled
    with pytest.raises(TypeError, match=r"^replace_attention: model\.0: return_weights must "
                                        r"be True or False"):
        replace_attention(model, "softmax", return_weights="yes")

    class Odd(TorchMultiheadAttention):
        def __init__(self, *args, scale, **kwargs):
            super().__init__(*args, **kwargs)

    odd = nn.Sequential(Odd(E, H, method="softmax", scale=2.0))
    with pytest.raises(TypeError, match=r"model\.0: .*Odd could not be rebuilt with "
                                        r"TorchMultiheadAttention's arguments"):
        replace_attention(odd, "linear")
    assert type(odd[0]) is Odd


def test_appended_keys_with_options_attending_as_many_queries_as_keys_are_refused():
    """nystromformer's conv_kernel adds a position's convolved value to its query: with
    add_bias_kv the layer was built, then every call failed in the method."""
    with pytest.raises(CapabilityError, match=r"^TorchMultiheadAttention: add_bias_kv appends "
                                              r"keys.*nystromformer cannot attend with these "
                                              r"options \(conv_kernel=3 adds"):
        TorchMultiheadAttention(E, H, add_bias_kv=True, method="nystromformer", conv_kernel=3)
    model = nn.Sequential(nn.MultiheadAttention(E, H, add_zero_attn=True))
    with pytest.raises(CapabilityError, match=r"^replace_attention: model\.0: add_zero_attn "
                                              r"appends keys"):
        replace_attention(model, "nystromformer", conv_kernel=3)
    assert isinstance(model[0], nn.MultiheadAttention)


def test_key_and_value_of_other_lengths_are_named_as_passed():
    _, ours = pair()
    q, k, v = rand(L, B, E), rand(S, B, E), rand(S - 1, B, E)
    with pytest.raises(ValueError, match=r"got query \(6, 3, 8\), key \(5, 3, 8\) and value "
                                         r"\(4, 3, 8\), laid out \[L, B, E\]\.$"):
        ours(q, k, v, need_weights=False)


def test_built_on_meta_and_initialised_by_reset_parameters():
    """PyTorch's recipe: build on meta, to_empty, reset_parameters() of every module: the
    projections get torch's initialisation (Xavier-uniform), the method's state its own
    draw, not uninitialised memory."""
    with torch.device("meta"):
        layer = TorchMultiheadAttention(E, H, method="performer", num_features=4)
    layer = layer.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    bound = (6 / (E + 3 * E)) ** 0.5  # xavier_uniform_ of [3E, E]
    assert 0 < layer.in_proj_weight.abs().max() <= bound
    assert not layer.in_proj_bias.any()
    fresh = TorchMultiheadAttention(E, H, method="performer", num_features=4)
    for state in (layer.method_state, fresh.method_state):
        torch.manual_seed(1)
        state.reset_parameters()
    for name, value in fresh.method_state.state_dict().items():
        assert torch.equal(layer.method_state.state_dict()[name], value), name


def test_a_float_padding_mask_with_a_bias_is_named_for_an_approximate_method():
    """A float key_padding_mask of 0 / -inf is padding; other values are a bias the
    approximate methods would leave out: refused naming key_padding_mask (it was called
    'the additive attention mask'). Large negatives count as padding, as -inf."""
    _, approx = pair("nystromformer", {"num_features": 4})
    q, kv = rand(L, B, E), rand(S, B, E, seed=2)
    additive = torch.zeros(B, S, dtype=F64).masked_fill(padding(), float("-inf"))
    large = torch.zeros(B, S, dtype=F64).masked_fill(padding(), -1e9)
    torch.testing.assert_close(approx(q, kv, kv, key_padding_mask=large, need_weights=False)[0],
                               approx(q, kv, kv, key_padding_mask=padding(),
                                      need_weights=False)[0], **EXACT)
    with pytest.raises(ValueError, match=r"nystromformer\): key_padding_mask holds additive "
                                         r"values other than 0"):
        approx(q, kv, kv, key_padding_mask=additive - 1.0, need_weights=False)
    ref, ours = pair("softmax")  # an exact method takes the bias, as torch's layer
    biased = additive - 1.0
    torch.testing.assert_close(ours(q, kv, kv, key_padding_mask=biased, need_weights=False)[0],
                               ref(q, kv, kv, key_padding_mask=biased, need_weights=False)[0],
                               **EXACT)


def test_a_float_padding_mask_with_a_bias_is_refused_under_torch_func_and_compile():
    """Under torch.func and torch.compile the mask's values cannot be read as in eager
    code: it was read as 0 = real and anything else padding without a word (under vmap a
    random mask made every key padding). torch.func's wrapped values are read for the
    check; a compiled graph checks them on the device when it runs."""
    _, approx = pair("nystromformer", {"num_features": 4})
    q, kv = rand(L, B, E), rand(S, B, E, seed=2)
    padded = torch.zeros(B, S, dtype=F64).masked_fill(padding(), float("-inf"))
    biased = padded - 1.0

    def attend(q, kv, mask):
        return approx(q, kv, kv, key_padding_mask=mask, need_weights=False)[0]

    def under_grad(mask):
        return torch.func.grad(lambda q: attend(q, kv, mask).square().sum())(q)

    def under_vmap(mask):  # one mask row per mapped batch element
        return torch.func.vmap(lambda qb, kvb, mb: attend(qb[:, None], kvb[:, None], mb[None]),
                               in_dims=(1, 1, 0), randomness="same")(q, kv, mask)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    refusals = {under_grad: ValueError, under_vmap: ValueError, lambda m: compiled(q, kv, m):
                RuntimeError}
    for run, error in refusals.items():
        run(padded)  # 0 / -inf: padding, taken
        with pytest.raises(error, match=r"nystromformer\): key_padding_mask holds additive "
                                        r"values other than 0"):
            run(biased)


def test_an_attn_mask_that_cannot_be_read_is_refused_with_this_layers_arguments():
    """Under a transform the refusal named the SDPA entry's mask [B, 1, 1, S] (True =
    attend), which this layer refuses: it names this layer's arguments, torch's
    convention."""
    _, approx = pair("skyformer", {"num_features": 4})
    blocked = torch.zeros(L, L, dtype=torch.bool)
    blocked[:, 4:] = True  # torch's convention: True = not allowed
    x = rand(L, 1, E)
    approx(x, x, x, attn_mask=blocked, need_weights=False)  # eager: read as padding
    with pytest.raises(CapabilityError, match=r"pass a bool key_padding_mask \[B, S\] \(True "
                                              r"= padding\) for padding, or is_causal=True "
                                              r"beside a causal attn_mask\.$"):
        torch.func.vmap(lambda x, mask: approx(x[:, None], x[:, None], x[:, None],
                                               attn_mask=mask, need_weights=False)[0],
                        in_dims=(1, 0), randomness="same")(rand(L, 2, E),
                                                           torch.stack([blocked, blocked]))


def test_linformer_without_a_length_is_told_replace_attentions_argument():
    """Linformer's missing max_seq_len named MultiHeadAttention's and set_attention's
    arguments, neither of which a torch model's swap calls."""
    with pytest.raises(ValueError, match=r"replace_attention\(model, 'linformer', "
                                         r"seq_len=4096\) for a model built on torch"):
        replace_attention(nn.Sequential(nn.MultiheadAttention(E, H)), "linformer")
    replace_attention(nn.Sequential(nn.MultiheadAttention(E, H)), "linformer", seq_len=16)
    # seq_len counts the keys passed; the method's length adds the appended ones
    appended = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True)
    layer = replace_attention(appended, "linformer", seq_len=L)
    assert layer.bound.options()["max_seq_len"] == L + 2
    x = torch.randn(L, B, E)
    assert layer(x, x, x, need_weights=False)[0].shape == (L, B, E)
    given = TorchMultiheadAttention(E, H, method="linformer", max_seq_len=L, add_bias_kv=True)
    with pytest.raises(CapabilityError, match=r"6 keys and the 1 that add_bias_kv appends "
                                              r"make 7, but max_seq_len=6; build the layer "
                                              r"with seq_len=6"):
        given(x, x, x, need_weights=False)


def test_scripting_is_refused_with_the_ways_that_work():
    """torch.jit.script of a model holding the layer failed with TorchScript's "Unknown
    type annotation: 'BoundMethod'"; it names the tracers and compilers that work."""
    model = replace_attention(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, batch_first=True), 1, enable_nested_tensor=False),
        "skyformer", num_features=4)
    with pytest.raises(RuntimeError, match=r"^TorchMultiheadAttention \(skyformer\) cannot be "
                                           r"scripted with torch.jit.script .* use "
                                           r"torch.jit.trace, torch.export or torch.compile"):
        torch.jit.script(model)


def test_a_dropout_layer_compiled_by_aot_autograd_differentiates_as_eager():
    """Skyformer's output dropped before the merge of the heads failed in the backward
    AOTAutograd compiles (a view of mismatched strides): nn.TransformerEncoderLayer's
    default dropout of 0.1 with Skyformer swapped in could not train compiled. The
    output is dropped on the merged heads."""
    torch.manual_seed(0)
    layer = TorchMultiheadAttention(16, 2, dropout=0.1, method="skyformer[num_features=8]",
                                    batch_first=True)
    x = torch.randn(2, 20, 16, requires_grad=True)
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[1, 12:] = True

    def call(x, key):
        return layer(x, x, x, key_padding_mask=padding, need_weights=False, generator=key)[0]

    def gradient(run):
        torch.manual_seed(1)  # the same dropout mask
        return torch.autograd.grad(run(x, random_key(3)).square().sum(), x)[0]

    eager = gradient(call)
    compiled = gradient(torch.compile(call, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(compiled, eager)


def test_the_no_weights_warning_flag_is_no_guard_of_a_compiled_call():
    """need_weights=True (torch's default) read the layer's warned-once flag while
    compiling: an eager call that then warned recompiled the next compiled call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = TorchMultiheadAttention(16, 2, method="softmax", batch_first=True)
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(lambda x: layer(x, x, x)[0], fullgraph=True, backend="eager")
    compiled(x)
    with pytest.warns(UserWarning, match=r"returns \(output, None\)"):
        layer(x, x, x)
    compiled(x)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_mask_padding_every_key_is_warned_of_at_the_callers_line():
    """True everywhere (skyformer's convention, True = real, given to torch's layer):
    every key was padding and every output row 0, without a word, where the same
    mistake through skyformer's own calls is warned of."""
    mha = TorchMultiheadAttention(16, 2, method="skyformer", batch_first=True)
    x = torch.randn(2, 10, 16)
    with pytest.warns(UserWarning, match=r"^TorchMultiheadAttention \(skyformer\): "
                                         r"key_padding_mask pads every key .* pass None "
                                         r"where nothing is padded, or ~mask") as said:
        out, _ = mha(x, x, x, key_padding_mask=torch.ones(2, 10, dtype=torch.bool),
                     need_weights=False)
    assert said[0].filename == __file__ and out.eq(mha.out_proj.bias).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mha(x, x, x, key_padding_mask=torch.zeros(2, 10, dtype=torch.bool), need_weights=False)
        mha(x, x, x, key_padding_mask=torch.eye(2, 10, dtype=torch.bool), need_weights=False)
    # torch's encoder layer passes a bool mask on as a float one, -inf where True
    encoder = replace_attention(nn.TransformerEncoder(nn.TransformerEncoderLayer(
        16, 2, batch_first=True), 1, enable_nested_tensor=False), "skyformer")
    with pytest.warns(UserWarning, match=r"key_padding_mask pads every key"):
        encoder(x, src_key_padding_mask=torch.ones(2, 10, dtype=torch.bool))
