"""Nystromformer against its naive reference, its exactness limit, and its padding rules."""

from __future__ import annotations

import pytest
import torch

from skyformer import MultiHeadAttention, softmax_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.ops.nystromformer import nystromformer_attention
from skyformer.ops.nystromformer.naive import reference_nystromformer_attention
from skyformer.ops.nystromformer.nystromformer import segment_means, segments
from tests.conftest import holes_mask, make_qkv


def grads(out, inputs):
    return torch.autograd.grad(out.square().sum(), inputs)


@pytest.mark.parametrize("n, m", [(40, 8), (37, 8), (50, 7)])  # N divisible or not by m
@pytest.mark.parametrize("masked", [False, True])
def test_fast_matches_naive_reference_outputs_and_gradients(n, m, masked):
    q, k, v = make_qkv(2, 2, n, 8)
    mask = None
    if masked:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, :5] = False  # left padding
        mask[1, n - 9:] = False  # right padding
        mask[1, 3] = False  # and a hole
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=m)
    ref = reference_nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=m)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_cross_attention_matches_reference():
    q, k, v = make_qkv(2, 2, 30, 8, nk=45)
    fast = nystromformer_attention(q, k, v, num_features=6)
    ref = reference_nystromformer_attention(q, k, v, num_features=6)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("nq, nk", [(4, 30), (4, 6), (30, 4), (6, 4)])
def test_cross_attention_with_more_landmarks_than_tokens_on_one_side(nq, nk):
    """m = 8 > min(Nq, Nk): each side keeps its min(m, N) live segments, so the middle
    kernel is min(m, Nq) x min(m, Nk), and its pseudo-inverse is taken as that rectangle's.
    When every key is its own landmark (Nk <= m), with more queries than keys or fewer
    (then Q~ = Q and S^ = S S^+ S), the fast path returns exact attention, which the
    literal formula reaches with more iterations (with Nq = 4 < Nk = 6 the fast path ran
    the literal formula's 6 pseudo-inverse iterations, 0.03 off softmax)."""
    q, k, v = make_qkv(1, 2, nq, 8, nk=nk)
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = nystromformer_attention(q, k, v, num_features=8)
    if nk <= 8:
        exact = softmax_attention(q, k, v)
        torch.testing.assert_close(fast, exact, rtol=1e-9, atol=1e-11)
        literal = reference_nystromformer_attention(q, k, v, num_features=8,
                                                    pinv_iterations=60)
        torch.testing.assert_close(literal, exact, rtol=1e-7, atol=1e-9)
        return
    ref = reference_nystromformer_attention(q, k, v, num_features=8)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("masked", [False, True])
def test_every_token_its_own_landmark_is_exact_softmax(masked):
    """n <= m: S^ = S S^+ S = S. The fast path returns exact attention; the literal
    formula converges to it as the pseudo-inverse iterations grow."""
    q, k, v = make_qkv(2, 2, 16, 8, scale=0.5)
    mask = None
    if masked:
        mask = torch.ones(2, 16, dtype=torch.bool)
        mask[1, 11:] = False
    exact = softmax_attention(q, k, v, key_padding_mask=mask)
    for m in (16, 128):
        fast = nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=m)
        torch.testing.assert_close(fast, exact, rtol=1e-9, atol=1e-11)
    literal = reference_nystromformer_attention(
        q, k, v, key_padding_mask=mask, num_features=16, pinv_iterations=60
    )
    torch.testing.assert_close(literal, exact, rtol=1e-7, atol=1e-9)


def test_error_falls_as_landmarks_grow():
    q, k, v = make_qkv(1, 2, 128, 16, seed=4, scale=0.8)
    exact = softmax_attention(q, k, v)
    errors = [
        relative_error(nystromformer_attention(q, k, v, num_features=m), exact).mean().item()
        for m in (4, 16, 64)
    ]
    assert errors[0] > errors[1] > errors[2], errors


def test_segments_partition_real_tokens_in_runs():
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 20:] = False
    seg = segments(mask, 2, 23, 6, torch.device("cpu"), torch.float64)
    assert seg.n_valid.tolist() == [20, 20]
    for b in range(2):
        idx = seg.index[b][mask[b]]
        assert torch.all(idx[1:] >= idx[:-1]), "segments are runs of consecutive real tokens"
        sizes = seg.count[b]
        assert sizes.sum() == 20 and set(sizes.tolist()) <= {3.0, 4.0}  # floor/ceil of 20/6
    torch.testing.assert_close(seg.count[0], seg.count[1])


def test_padded_tokens_never_enter_landmarks():
    q, _, _ = make_qkv(1, 2, 20, 4)
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, 15:] = False
    seg = segments(mask, 1, 20, 5, q.device, q.dtype)
    junk = q.clone()
    junk[:, :, 15:] = 1e6
    torch.testing.assert_close(segment_means(junk, seg), segment_means(q, seg))
    trunc = segments(None, 1, 15, 5, q.device, q.dtype)
    torch.testing.assert_close(segment_means(q, seg), segment_means(q[:, :, :15], trunc))
    # three tokens per segment: the first landmark is the mean of rows 0..2
    torch.testing.assert_close(segment_means(q, seg)[:, :, 0], q[:, :, :3].mean(dim=2))


def test_pinv_start_is_per_matrix_not_per_batch():
    """Scaling another sequence (which would move a batch-wide max) changes nothing."""
    q, k, v = make_qkv(2, 2, 40, 8)
    base = nystromformer_attention(q, k, v, num_features=8)
    q2, k2 = q.clone(), k.clone()
    q2[1] *= 20
    k2[1] *= 20
    out = nystromformer_attention(q2, k2, v, num_features=8)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=0)


def test_conv_skip_matches_naive_convolution_and_padding_rule():
    q, k, v = make_qkv(2, 2, 30, 8)
    weight = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :6] = False
    fast = nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=6, conv_kernel=5,
                                   conv_weight=weight)
    ref = reference_nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=6,
                                            conv_weight=weight)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    plain = nystromformer_attention(q, k, v, key_padding_mask=mask, num_features=6)
    assert not torch.allclose(fast, plain)
    # left padding of sequence 1 gives the output of its truncation, convolution included
    trunc = nystromformer_attention(q[1:, :, 6:], k[1:, :, 6:], v[1:, :, 6:], num_features=6,
                                    conv_kernel=5, conv_weight=weight)
    torch.testing.assert_close(fast[1:, :, 6:], trunc, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kernel", [3, 5])
def test_conv_follows_ranks_so_holes_equal_truncation(kernel):
    """The convolution runs over the real values in order: a hole is skipped, not read
    as a zero, in the fast path (outputs and gradients) and in the reference."""
    q, k, v = make_qkv(2, 2, 20, 6, seed=3)
    weight = torch.randn(2, kernel, dtype=torch.float64)
    mask = holes_mask(2, 20)
    for t in (q, k, v):
        t.requires_grad_(True)
    opts = {"num_features": 4, "conv_weight": weight}
    fast = nystromformer_attention(q, k, v, key_padding_mask=mask, conv_kernel=kernel, **opts)
    ref = reference_nystromformer_attention(q, k, v, key_padding_mask=mask, **opts)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    for i in range(2):
        rows = [t[i : i + 1, :, mask[i]] for t in (q, k, v)]
        short = nystromformer_attention(*rows, conv_kernel=kernel, **opts)
        torch.testing.assert_close(fast[i : i + 1, :, mask[i]], short, rtol=1e-9, atol=1e-11)


def test_layer_with_conv_gives_holes_the_outputs_of_truncation():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="nystromformer", num_features=4,
                               conv_kernel=5).double()
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    mask = holes_mask(2, 20)
    out = layer(x, key_padding_mask=mask)
    for i in range(2):
        short = layer(x[i : i + 1, mask[i]])
        torch.testing.assert_close(out[i : i + 1, mask[i]], short, rtol=1e-9, atol=1e-11)


def test_conv_with_cross_attention_is_refused_with_a_sentence():
    q, k, v = make_qkv(1, 2, 6, 4, nk=9)
    with pytest.raises(ValueError, match="as many queries as keys"):
        nystromformer_attention(q, k, v, num_features=3, conv_kernel=3,
                                conv_weight=torch.randn(2, 3, dtype=torch.float64))


def test_a_conv_without_weights_names_where_weights_go():
    """The generic entry points take options only: the sentence names the function
    that takes conv_weight (it said 'pass conv_weight', which they refuse)."""
    import skyformer

    q, k, v = make_qkv(1, 2, 20, 4)
    with pytest.raises(ValueError, match=r"pass conv_weight to skyformer\.ops\.nystromformer"
                                         r"\.nystromformer_attention"):
        skyformer.attention(q, k, v, "nystromformer", conv_kernel=5)
    weight = torch.randn(2, 5, dtype=q.dtype)
    nystromformer_attention(q, k, v, conv_kernel=5, conv_weight=weight)


def test_module_owns_learned_conv_weights():
    layer = MultiHeadAttention(16, 2, method="nystromformer", num_features=4, conv_kernel=3)
    assert layer.method_state.weight.shape == (2, 3)
    x = torch.randn(2, 12, 16)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False
    layer(x, key_padding_mask=mask).sum().backward()
    assert layer.method_state.weight.grad is not None
    assert layer.method_state.weight.grad.abs().sum() > 0
    plain = MultiHeadAttention(16, 2, method="nystromformer")
    assert not any("method_state" in name for name, _ in plain.named_parameters())


def test_conv_weights_are_those_of_the_reference_conv_layer():
    """Drawn as nn.Conv2d(H, H, (K, 1), groups=H, bias=False) draws its weight, from the
    global generator or (seeded) from a generator of the state's own."""
    from skyformer.registry import get_method

    bound = get_method("nystromformer").bind(2, 8, conv_kernel=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        conv = torch.nn.Conv2d(2, 2, (3, 1), groups=2, bias=False).weight.detach()
        torch.manual_seed(7)
        unseeded = bound.new_state().weight.detach()
    assert torch.equal(unseeded, conv.view(2, 3))
    assert torch.equal(bound.new_state(seed=7).weight.detach(), conv.view(2, 3))


def test_half_precision_is_computed_in_float32():
    q, k, v = make_qkv(1, 2, 40, 16, dtype=torch.float32)
    out = nystromformer_attention(q.half(), k.half(), v.half(), num_features=8)
    ref = nystromformer_attention(q.half().float(), k.half().float(), v.half().float(),
                                  num_features=8)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_bad_options_and_inputs_name_the_problem():
    q, k, v = make_qkv(1, 2, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"pinv_iterations": -1}, "pinv_iterations"),
        ({"conv_kernel": 4, "conv_weight": torch.ones(2, 4)}, "odd"),
        ({"scale": -1.0}, "scale"),
        ({"conv_kernel": 3}, "conv_weight"),
        ({"conv_kernel": 3, "conv_weight": torch.ones(3, 3)}, r"\[H, conv_kernel\] = \[2, 3\]"),
        ({"conv_weight": torch.ones(2, 3)}, "conv_kernel is None"),
        # the output was read from a weight of no data before
        ({"conv_kernel": 3, "conv_weight": torch.ones(2, 3, device="meta")},
         r"conv_weight is on meta but the inputs are on cpu; pass conv_weight.to\('cpu'\)"),
    ):
        with pytest.raises(ValueError, match=word):
            nystromformer_attention(q, k, v, **options)
