"""Linformer against its naive reference, its identity-projection limit, its length rules."""

from __future__ import annotations

import pytest
import torch

from skyformer import MultiHeadAttention, attention, softmax_attention
from skyformer.ops.linformer import linformer_attention
from skyformer.ops.linformer.linformer import jl_projections
from skyformer.ops.linformer.naive import reference_linformer_attention
from skyformer.sketch.rng import random_key
from tests.conftest import gen, make_qkv


def mixed_mask(b, n):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[-1, n - 6:] = False  # right padding
    return mask


@pytest.mark.parametrize("shared_heads", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_matches_naive_reference_outputs_and_gradients(shared_heads, masked):
    q, k, v = make_qkv(2, 2, 20, 8)
    shape = (6, 28) if shared_heads else (2, 6, 28)  # L = 28 > N: first N columns used
    e = torch.randn(shape, generator=gen(1), dtype=torch.float64, requires_grad=True)
    f = torch.randn(shape, generator=gen(2), dtype=torch.float64, requires_grad=True)
    mask = mixed_mask(2, 20) if masked else None
    inputs = (q, k, v, e, f)
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = linformer_attention(q, k, v, key_padding_mask=mask, num_features=6, proj_k=e, proj_v=f,
                               share_heads=shared_heads)  # [k, L] is share_heads' shape
    ref = reference_linformer_attention(q, k, v, e, f, key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), inputs),
                    torch.autograd.grad(ref.square().sum(), inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("masked", [False, True])
def test_identity_projections_at_k_equal_n_are_exact_softmax(masked):
    q, k, v = make_qkv(2, 2, 18, 8)
    mask = mixed_mask(2, 18) if masked else None
    eye = torch.eye(18, dtype=torch.float64)
    out = linformer_attention(
        q, k, v, key_padding_mask=mask, num_features=18, proj_k=eye, proj_v=eye
    )
    torch.testing.assert_close(
        out, softmax_attention(q, k, v, key_padding_mask=mask), rtol=1e-9, atol=1e-11
    )


def test_cross_attention_projects_keys_only():
    q, k, v = make_qkv(1, 2, 7, 8, nk=15)
    e = torch.randn(2, 5, 15, generator=gen(0), dtype=torch.float64)
    out = linformer_attention(q, k, v, num_features=5, proj_k=e, proj_v=e)
    torch.testing.assert_close(
        out, reference_linformer_attention(q, k, v, e, e), rtol=1e-9, atol=1e-11
    )


def test_direct_call_draws_fixed_jl_projections_from_the_generator():
    q, k, v = make_qkv(1, 2, 20, 8)
    out = linformer_attention(q, k, v, generator=gen(3), num_features=16)
    e, f = jl_projections(random_key(gen(3)), 2, 16, 20, share_kv=False)
    expected = linformer_attention(q, k, v, num_features=16, proj_k=e.double(), proj_v=f.double())
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    shared = linformer_attention(q, k, v, generator=gen(3), num_features=16, share_kv=True)
    torch.testing.assert_close(
        shared, linformer_attention(q, k, v, num_features=16, proj_k=e.double(), proj_v=e.double())
    )


def test_jl_entries_have_variance_one_over_k():
    """E and F as the method draws them (``jl_projections``), N(0, 1/k) entries."""
    e, f = jl_projections(random_key(gen(0)), 4, 128, 1000, share_kv=False)
    for p in (e, f):
        # 512k draws: the sample variance is within 1% of 1/k with overwhelming probability
        assert abs(p.var().item() * 128 - 1.0) < 0.01
        assert abs(p.mean().item()) < 5e-4
    assert not torch.equal(e, f)


def test_shorter_input_uses_the_first_columns():
    q, k, v = make_qkv(1, 2, 12, 8)
    e = torch.randn(2, 5, 30, generator=gen(4), dtype=torch.float64)
    long = linformer_attention(q, k, v, num_features=5, max_seq_len=30, proj_k=e, proj_v=e)
    cut = e[..., :12].clone()
    short = linformer_attention(q, k, v, num_features=5, proj_k=cut, proj_v=cut)
    torch.testing.assert_close(long, short, rtol=0, atol=0)


def test_seeded_projections_are_the_global_generators_draws_at_that_seed():
    """N(0, 1/k) entries, E then F, as torch.randn draws them from a generator seeded alike."""
    from skyformer.registry import get_method

    state = get_method("linformer").bind(2, 8, num_features=4, max_seq_len=6).new_state(seed=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        e, f = torch.randn(2, 4, 6) / 2.0, torch.randn(2, 4, 6) / 2.0
    assert torch.equal(state.proj_k.detach(), e) and torch.equal(state.proj_v.detach(), f)


def test_module_learns_projections_and_padding_equals_truncation():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="linformer", num_features=8, max_seq_len=24).double()
    assert layer.method_state.proj_k.shape == (2, 8, 24)
    x = torch.randn(1, 24, 16, dtype=torch.float64)
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[:, :17] = True
    padded = layer(x, key_padding_mask=mask)
    truncated = layer(x[:, :17])
    torch.testing.assert_close(padded[:, :17], truncated, rtol=1e-10, atol=1e-12)
    padded.sum().backward()
    for p in (layer.method_state.proj_k, layer.method_state.proj_v):
        assert p.grad is not None
        assert torch.all(p.grad[..., 17:] == 0), "padded positions' columns get no gradient"
        assert p.grad[..., :17].abs().sum() > 0
    shared = MultiHeadAttention(16, 2, method="linformer", max_seq_len=24, share_kv=True)
    assert shared.method_state.proj_v is None
    assert sum(1 for n, _ in shared.named_parameters() if "method_state" in n) == 1


def test_fixed_length_errors_are_sentences():
    with pytest.raises(ValueError, match="linformer needs a fixed max_seq_len"):
        MultiHeadAttention(16, 2, method="linformer")
    layer = MultiHeadAttention(16, 2, method="linformer", max_seq_len=10)
    with pytest.raises(ValueError, match="max_seq_len=10"):
        layer(torch.randn(1, 12, 16))
    q, k, v = make_qkv(1, 2, 12, 8)
    with pytest.raises(ValueError, match="max_seq_len=10"):
        attention(q, k, v, "linformer", max_seq_len=10)


def test_bad_projections_and_options():
    q, k, v = make_qkv(1, 2, 10, 4)
    e = torch.randn(2, 5, 10, dtype=torch.float64)
    for options, word in (
        ({"proj_k": e}, "both proj_k and proj_v"),
        ({"proj_k": e, "proj_v": e}, r"\[H, num_features, L\]"),  # num_features 128 != 5
        (
            {"num_features": 5, "proj_k": e[:, :, :6], "proj_v": e[:, :, :6]},
            "one column per position",
        ),
        ({"num_features": 5, "proj_k": e[:1], "proj_v": e[:1]}, r"\[2, 5, L\]"),
        ({"num_features": 5, "max_seq_len": 12, "proj_k": e, "proj_v": e}, "max_seq_len=12"),
        ({"num_features": 5, "proj_k": e, "proj_v": e.to("meta")},  # torch's words, before
         r"proj_v is on meta but the inputs are on cpu; pass proj_v.to\('cpu'\)"),
        ({"num_features": 0}, "num_features"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"share_kv": 1}, "share_kv"),
        ({"scale": float("inf")}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            linformer_attention(q, k, v, **options)


def test_share_kv_projects_the_values_by_proj_k():
    """share_kv=True with a proj_v other than proj_k ran with F = proj_v (E != F) without a
    word; proj_k alone was refused."""
    q, k, v = make_qkv(1, 2, 10, 4)
    e, f = (torch.randn(2, 5, 10, dtype=torch.float64, generator=gen(s)) for s in (0, 1))
    shared = linformer_attention(q, k, v, num_features=5, share_kv=True, proj_k=e)
    torch.testing.assert_close(
        shared, linformer_attention(q, k, v, num_features=5, proj_k=e, proj_v=e), rtol=0,
        atol=0)
    assert torch.equal(shared, linformer_attention(q, k, v, num_features=5, share_kv=True,
                                                   proj_k=e, proj_v=e))
    with pytest.raises(ValueError, match=r"share_kv=True projects the values by proj_k too"):
        linformer_attention(q, k, v, num_features=5, share_kv=True, proj_k=e, proj_v=f)


def test_share_heads_is_the_papers_headwise_and_key_value_sharing():
    """Section 4's headwise sharing (one E, one F per layer) and key-value sharing (one E
    per layer, for the heads, the keys and the values); share_kv alone kept E per head."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="linformer", num_features=4, max_seq_len=400,
                               share_heads=True, share_kv=True).double()
    state = layer.method_state
    assert state.proj_k.shape == (4, 400) and state.proj_v is None
    state.reset_parameters()
    assert abs(state.proj_k.std().item() - 0.5) < 0.05, "entries N(0, 1/k)"
    heads = MultiHeadAttention(16, 2, method="linformer", num_features=4, max_seq_len=24,
                               share_heads=True)
    assert heads.method_state.proj_k.shape == heads.method_state.proj_v.shape == (4, 24)
    q, k, v = make_qkv(1, 1, 12, 4)
    q, k, v = (t.expand(1, 3, 12, 4) for t in (q, k, v))  # three equal heads
    out = linformer_attention(q, k, v, num_features=4, share_heads=True, generator=gen(0))
    torch.testing.assert_close(out[:, 1:], out[:, :1].expand(1, 2, 12, 4), rtol=0, atol=0)
    e = torch.randn(4, 12, dtype=torch.float64, generator=gen(1))
    torch.testing.assert_close(
        linformer_attention(q, k, v, num_features=4, share_heads=True, share_kv=True, proj_k=e),
        reference_linformer_attention(q, k, v, e, e), rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match=r"share_heads=True shares one projection across the "
                                         r"heads, so proj_k must have shape \[num_features, L\]"):
        linformer_attention(q, k, v, num_features=4, share_heads=True,
                            proj_k=e.expand(3, 4, 12), proj_v=e)
    with pytest.raises(ValueError, match="share_heads"):
        linformer_attention(q, k, v, share_heads=1)


@pytest.mark.parametrize(("saved", "loaded", "says"), [
    ({}, {"share_heads": True}, r"saved with share_heads=False.*\[2, 4, 24\].*this layer "
                                r"has share_heads=True"),
    ({"share_heads": True}, {}, r"saved with share_heads=True.*\[4, 24\].*this layer has "
                                r"share_heads=False"),
    ({"share_heads": True}, {"share_heads": True, "share_kv": True},
     r"saved with share_heads=True, share_kv=False.*this layer has share_heads=True, "
     r"share_kv=True"),
])
def test_projections_saved_with_other_sharing_are_refused_with_the_options(saved, loaded,
                                                                           says):
    """A state dict of a layer with other share_heads / share_kv failed with torch's
    size mismatch or unexpected key alone; the sentence names the options to build the
    layer with."""
    def layer(options):
        return MultiHeadAttention(16, 2, method="linformer", num_features=4, max_seq_len=24,
                                  **options)

    with pytest.raises(RuntimeError, match=r"linformer: the projections were " + says
                       + r".*build the layer with the options they were saved with"):
        layer(loaded).load_state_dict(layer(saved).state_dict())
    same = layer(loaded)
    same.load_state_dict(layer(loaded).state_dict())


def test_a_misshapen_projection_with_share_heads_is_told_the_shared_shape():
    """With share_heads the sentence for a projection of the wrong shape offered
    ``[H, num_features, L]``, which share_heads refuses, and told a 1-dimensional one to
    pass one head's ``proj_k[h]``; it names ``[num_features, L]`` alone."""
    q, k, v = make_qkv(1, 3, 12, 4)
    e = torch.randn(4, 12, dtype=torch.float64, generator=gen(1))
    for bad in (e[:3], e[0]):
        with pytest.raises(ValueError, match=r"^linformer: share_heads=True shares one "
                           r"projection across the heads, so proj_k must have shape "
                           r"\[num_features, L\] = \[4, L\], got \((3, 12|12,)\)\.$"):
            linformer_attention(q, k, v, num_features=4, share_heads=True, proj_k=bad,
                                proj_v=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [False, True])
def test_a_non_finite_projection_is_not_hidden(shared, dtype):
    """A head whose key projection is all NaN gave zeros (the fused softmax takes a row
    of NaN logits for one with no key); a projection that went non-finite in training
    shows as NaN in the heads it serves, the others as they were."""
    q, k, v = make_qkv(b=1, h=2, n=6, d=4, dtype=dtype)
    shape = (8, 6) if shared else (2, 8, 6)
    e = torch.randn(*shape, dtype=dtype, generator=gen(1)) / 8**0.5
    f = torch.randn(*shape, dtype=dtype, generator=gen(2)) / 8**0.5
    finite = linformer_attention(q, k, v, num_features=8, proj_k=e, proj_v=f)
    broken = e.clone()
    broken[0] = float("nan")  # head 0's projection, or every head's first row
    out = linformer_attention(q, k, v, num_features=8, proj_k=broken, proj_v=f)
    if shared:
        assert out.isnan().all()
    else:
        assert out[:, 0].isnan().all()
        torch.testing.assert_close(out[:, 1], finite[:, 1], rtol=0, atol=0)


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_a_scale_of_zero_or_below_matches_the_reference(scale):
    """Any finite scale, as softmax and torch's SDPA take; it was refused."""
    q, k, v = make_qkv(2, 2, 20, 8)
    e = torch.randn(2, 6, 20, generator=gen(1), dtype=torch.float64)
    f = torch.randn(2, 6, 20, generator=gen(2), dtype=torch.float64)
    mask = mixed_mask(2, 20)
    fast = linformer_attention(q, k, v, key_padding_mask=mask, num_features=6, proj_k=e,
                               proj_v=f, scale=scale)
    ref = reference_linformer_attention(q, k, v, e, f, key_padding_mask=mask, scale=scale)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
