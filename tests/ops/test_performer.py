"""Performer (FAVOR+) against its materialised reference, unbiasedness, redraw policy."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from skyformer import MultiHeadAttention, softmax_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.ops.performer import PerformerFeatures, performer_attention
from skyformer.ops.performer.naive import performer_scores, reference_performer_attention
from skyformer.registry import get_method
from skyformer.sketch import gaussian_projection, softmax_log_features
from tests.conftest import gen, make_qkv


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("orthogonal", [True, False])
def test_fast_matches_reference_outputs_and_gradients(masked, orthogonal):
    q, k, v = make_qkv(2, 2, 19, 8, dv=5, seed=1)
    mask = None
    if masked:
        mask = torch.ones(2, 19, dtype=torch.bool)
        mask[0, 15:] = False
        mask[1, :4] = False
    w = gaussian_projection(24, 8, orthogonal=orthogonal, generator=gen(2)).double()
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = performer_attention(q, k, v, key_padding_mask=mask, num_features=24, projection=w)
    ref = reference_performer_attention(q, k, v, w, key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_the_reference_gives_an_element_without_a_real_key_zero_rows(eps):
    """Cross-attention (no query padding) to an element whose keys are all padding: the
    fast path's zeros, as softmax's, where the reference divided 0 by 0."""
    q, k, v = make_qkv(2, 2, 5, 8, nk=7, dv=3, seed=4)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    w = gaussian_projection(16, 8, generator=gen(2)).double()
    ref = reference_performer_attention(q, k, v, w, key_padding_mask=mask, eps=eps)
    fast = performer_attention(q, k, v, key_padding_mask=mask, num_features=16, projection=w,
                               eps=eps)
    torch.testing.assert_close(ref, fast, rtol=1e-10, atol=1e-12)
    assert (ref[1] == 0).all()


@pytest.mark.parametrize("eps", [1e-3, 0.5])
def test_eps_matches_reference_with_performer_pytorch_features(eps):
    """eps > 0: features m^-1/2 (exp(w.x' - |x'|^2/2 - c) + eps), c = row max of w.q'
    for queries, max over real keys and features of w.k' for keys; padded keys zero."""
    q, k, v = make_qkv(2, 2, 17, 8, dv=5, seed=11)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[0, 12:] = False
    mask[1, :3] = False
    w = gaussian_projection(16, 8, generator=gen(3)).double()
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = performer_attention(q, k, v, key_padding_mask=mask, num_features=16, projection=w,
                               eps=eps)
    ref = reference_performer_attention(q, k, v, w, key_padding_mask=mask, eps=eps)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    unbiased = performer_attention(q, k, v, key_padding_mask=mask, num_features=16,
                                   projection=w)
    assert (fast - unbiased).abs().max() > 1e-6


def test_large_eps_returns_the_mean_of_the_real_values():
    q, k, v = make_qkv(2, 2, 15, 8, seed=12)
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[1, 9:] = False
    out = performer_attention(q, k, v, key_padding_mask=mask, generator=gen(0), eps=1e9)
    mean = torch.stack([v[0].mean(-2), v[1, :, :9].mean(-2)])[:, :, None]
    torch.testing.assert_close(out[0], mean[0].expand_as(out[0]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[1, :, :9], mean[1].expand(2, 9, 8), rtol=1e-6, atol=1e-7)


def test_generator_draw_equals_passing_the_same_projection():
    q, k, v = make_qkv(1, 2, 12, 8)
    w = gaussian_projection(16, 8, generator=gen(4))
    drawn = performer_attention(q, k, v, generator=gen(4), num_features=16)
    given = performer_attention(q, k, v, num_features=16, projection=w.double())
    torch.testing.assert_close(drawn, given, rtol=0, atol=0)


def test_kernel_estimate_is_unbiased():
    """Lemma 1: E[phi(q).phi(k)] = exp(s q.k), entry by entry, within 4 standard errors
    of the mean over 4000 independent draws of 12 orthogonal features."""
    draws, m, d = 4000, 12, 6
    q, k, _ = make_qkv(1, 1, 4, d, seed=5, scale=0.8)
    qs, ks = q[0, 0] * d**-0.25, k[0, 0] * d**-0.25
    exact = torch.exp(qs @ ks.T)
    # m = 2 d: every 12 consecutive rows are two orthogonal blocks, one independent draw
    w = gaussian_projection(draws * m, d, generator=gen(0)).double()
    fq = softmax_log_features(qs, w).exp().view(4, draws, m)
    fk = softmax_log_features(ks, w).exp().view(4, draws, m)
    estimates = torch.einsum("idf,jdf->dij", fq, fk) / m  # one estimate per draw
    mean, stderr = estimates.mean(0), estimates.std(0) / math.sqrt(draws)
    assert torch.all((mean - exact).abs() < 4 * stderr), ((mean - exact) / stderr).abs().max()
    # the reference's materialised estimate is the same quantity
    one = performer_scores(q, k, w[:m])[0, 0]
    torch.testing.assert_close(one, estimates[0])


def test_error_falls_as_features_grow():
    """Averaged over 8 draws, the error falls as the features grow (Monte Carlo rate)."""
    q, k, v = make_qkv(1, 2, 64, 16, seed=6, scale=0.7)
    exact = softmax_attention(q, k, v)
    means = []
    for m in (8, 64, 512, 2048):
        errs = [relative_error(performer_attention(q, k, v, generator=gen(s), num_features=m),
                               exact, ord="fro").mean() for s in range(8)]
        means.append(torch.stack(errs).mean().item())
    assert all(b < a for a, b in itertools.pairwise(means)), means
    assert means[-1] < means[0] / 3, means


def test_stable_at_large_norms_where_the_naive_features_overflow():
    q, k, v = make_qkv(1, 1, 16, 32, dtype=torch.float32, seed=7)
    q = q / q.norm(dim=-1, keepdim=True) * 40
    k = k / k.norm(dim=-1, keepdim=True) * 40
    w = gaussian_projection(64, 32, generator=gen(7))
    # the naive features underflow to 0 for every key: 0/0
    assert not torch.isfinite(reference_performer_attention(q, k, v, w)).all()
    out = performer_attention(q, k, v, num_features=64, projection=w)
    assert torch.isfinite(out).all()
    # the same computation in float64, where the naive features still fit
    ref64 = reference_performer_attention(q.double(), k.double(), v.double(), w.double())
    torch.testing.assert_close(out.double(), ref64, rtol=1e-3, atol=1e-4)


def test_a_row_of_small_float32_sums_keeps_its_estimate_not_the_mean_of_the_values():
    """A query whose features are large where the keys' are small has sums far below 1
    (3.8e-29 here, |q| = |k| = 30, D = 8: LayerNorm'd activations reach such norms),
    under the normaliser's float32 threshold (~1e-19) though they hold every digit: the
    row returned the mean of the values, 0.41 from the float64 estimate. Each row is
    scaled by a power of two first, as in causal calls."""
    g = gen(1)
    q, k, v = (torch.randn(1, 2, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    q, k = (x / x.norm(dim=-1, keepdim=True) * 30 for x in (q, k))
    w = gaussian_projection(128, 8, generator=gen(0))
    ref = performer_attention(q, k, v, projection=w, num_features=128)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    out = performer_attention(q32, k32, v32, projection=w.float(), num_features=128)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q32, k32, v32))
    assert all(torch.isfinite(g).all() for g in grads)


def test_padded_keys_contribute_nothing_even_when_huge():
    q, k, v = make_qkv(1, 2, 10, 8, seed=8)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7:] = False
    k2 = k.clone()
    k2[:, :, 7:] = 1e4  # would dominate the key max-shift if it were counted
    a = performer_attention(q, k, v, key_padding_mask=mask, generator=gen(0), num_features=8)
    b = performer_attention(q, k2, v, key_padding_mask=mask, generator=gen(0), num_features=8)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_layer_state_redraws_every_interval_in_training_only():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="performer", num_features=8, feature_redraw_interval=2)
    state = layer.method_state
    assert isinstance(state, PerformerFeatures)
    assert not any(True for _ in state.parameters())  # buffers, not learned
    buffers = {"projection", "calls_since_redraw", "seed", "redraws"}
    assert set(dict(state.named_buffers())) == buffers
    x = torch.randn(1, 6, 16)
    seen = []
    for _ in range(5):
        layer(x)
        seen.append(state.projection.clone())
    # used for 2 calls each: calls 1-2 share features, 3-4 share new ones, 5 new again
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    assert not torch.equal(seen[1], seen[2]) and not torch.equal(seen[3], seen[4])
    layer.eval()
    before = state.projection.clone()
    outs = [layer(x) for _ in range(4)]
    assert torch.equal(state.projection, before)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_held_features_are_kept_uncounted_and_the_weights_are_the_next_calls():
    """Micro-batches after the first of one step were counted as calls (one process with
    --grad-accum 2 redrew twice as often as two processes, and a redraw could fall
    between the micro-batches of one step); attention_weights counted as a call and
    could redraw, so looking at the weights changed the training run; a call refused
    for its mask had counted too."""
    from skyformer.ops.performer import features_held
    from skyformer.sketch.rng import random_key

    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="performer", num_features=8, feature_redraw_interval=1)
    state = layer.method_state
    x = torch.randn(1, 6, 16)
    layer(x)
    first = state.projection.clone()
    with features_held(layer):
        layer(x)
        layer(x)
    assert torch.equal(state.projection, first) and int(state.calls_since_redraw) == 1
    with pytest.raises(TypeError, match="must be a bool tensor"):
        layer(x, torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must have shape \[B, Nk\]"):
        layer(x, torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        layer(x, generator=1.5)
    assert torch.equal(state.projection, first) and int(state.redraws) == 0
    # inputs that autocast makes one dtype are no refused call (Llama's rotary step
    # gives float32 q, k beside a bfloat16 v)
    q = torch.randn(1, 2, 6, 8)
    with features_held(layer), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer.bound(q, q, q.bfloat16(), state=state)
    assert out.dtype == torch.bfloat16
    weights = layer.attention_weights(x, generator=random_key(1))  # a redraw is due
    assert torch.equal(state.projection, first) and int(state.redraws) == 0
    out = layer(x, generator=random_key(1))  # redraws, then applies those weights
    assert int(state.redraws) == 1 and not torch.equal(state.projection, first)
    v = layer._split(layer.v_proj(x))
    merged = (weights @ v).transpose(1, 2).reshape(1, 6, 16)
    torch.testing.assert_close(out, layer.out_proj(merged), rtol=1e-5, atol=1e-6)


def _functional_loss(layer, params, buffers, x):
    return torch.func.functional_call(layer, (params, buffers), (x,)).sum()


@pytest.mark.parametrize("transform", ["grad", "jacrev", "per-sample grad"])
def test_a_training_layer_under_torch_func_with_captured_buffers_gets_a_sentence(transform):
    """torch.func forbids writing into a tensor the transformed function captures; a
    training layer counts its calls in place, which failed with torch's message on
    ``aten::add_`` naming no buffer and no way out."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, method="performer", num_features=4).train()
    x = torch.randn(2, 5, 8)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    buffers = dict(layer.named_buffers())
    before = {n: b.clone() for n, b in buffers.items()}
    calls = {
        "grad": lambda: torch.func.grad(lambda p: _functional_loss(layer, p, buffers, x))(params),
        "jacrev": lambda: torch.func.jacrev(layer)(x),
        "per-sample grad": lambda: torch.func.vmap(torch.func.grad(
            lambda p, x: _functional_loss(layer, p, buffers, x)), in_dims=(None, 0))(
                params, x[:, None]),
    }
    with pytest.raises(RuntimeError, match=r"^performer: a layer in training mode "
                       r"\(MultiHeadAttention, TorchMultiheadAttention, .* counts its calls .* "
                       r"pass the buffers as an argument"):
        calls[transform]()
    assert all(torch.equal(b, before[n]) for n, b in buffers.items())  # nothing counted


def test_a_training_layer_under_torch_func_grad_with_the_buffers_as_arguments_counts():
    """The way the sentence gives: the buffers an argument of the transformed function,
    whose calls count and redraw as the layer's eager calls do, with their gradients."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, method="performer", num_features=4,
                               feature_redraw_interval=2).train()
    eager = copy.deepcopy(layer)
    x = torch.randn(2, 5, 8)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    buffers = {n: b.clone() for n, b in layer.named_buffers()}
    for _ in range(3):
        grads = torch.func.grad(lambda p, b: _functional_loss(layer, p, b, x))(params, buffers)
        eager.zero_grad()
        eager(x).sum().backward()
        for name, g in grads.items():
            torch.testing.assert_close(g, eager.get_parameter(name).grad)
    for name, b in eager.named_buffers():
        assert torch.equal(buffers[name], b)
    assert int(buffers["method_state.redraws"]) == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_with_the_features_the_forward_used(reentrant):
    """Activation checkpointing runs the forward again inside the backward pass: that run
    neither counts as a call nor redraws, so the gradients are those of training without
    checkpointing (redraw every call: each step's recomputation would draw anew)."""
    import copy

    from torch.utils.checkpoint import checkpoint

    layer = MultiHeadAttention(16, 2, "performer", num_features=8,
                               feature_redraw_interval=1).double().train()
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        layer.zero_grad()
        twin.zero_grad()
        layer(x).square().sum().backward()
        checkpoint(twin, x, use_reentrant=reentrant).square().sum().backward()
        for (name, a), b in zip(layer.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, msg=name)
        for a, b in zip(layer.buffers(), twin.buffers(), strict=True):
            assert torch.equal(a, b)


def test_a_redraw_between_two_calls_keeps_the_first_calls_gradient():
    """A layer called twice before one backward pass (shared weights, two views of a
    batch) with a redraw due at the second call: each call is differentiated with the
    features it used, as two copies of the layer holding them would be (the redraw
    once overwrote the features the first call had saved for its backward pass)."""
    import copy

    torch.manual_seed(3)
    layer = MultiHeadAttention(16, 2, "performer", num_features=8,
                               feature_redraw_interval=1).double().train()
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    first = layer(x)
    used_first = layer.method_state.projection.clone()
    second = layer(first)
    used_second = layer.method_state.projection.clone()
    assert not torch.equal(used_first, used_second)  # the second call redrew
    second.square().sum().backward()

    copies = []
    for used in (used_first, used_second):
        twin = copy.deepcopy(layer)
        twin.method_state.config = get_method("performer").make_config(
            num_features=8, feature_redraw_interval=None)
        with torch.no_grad():
            twin.method_state.projection.copy_(used)
        twin.zero_grad()
        copies.append(twin)
    x_twin = x.detach().clone().requires_grad_(True)
    copies[1](copies[0](x_twin)).square().sum().backward()
    torch.testing.assert_close(x.grad, x_twin.grad)
    for (name, shared), a, b in zip(layer.named_parameters(), copies[0].parameters(),
                                    copies[1].parameters(), strict=True):
        torch.testing.assert_close(shared.grad, a.grad + b.grad, msg=name)


@pytest.mark.parametrize("training", [True, False])
def test_a_redraw_asked_for_before_the_backward_pass_leaves_it_alone(training):
    """``redraw()`` between a call and its backward pass (no interval; eval mode too):
    the gradient is that of the features the call used."""
    torch.manual_seed(4)
    layer = MultiHeadAttention(16, 2, "performer", num_features=8,
                               feature_redraw_interval=None).double().train(training)
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(layer(x).square().sum(), x)
    out = layer(x)
    layer.method_state.redraw()
    (got,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_layer_without_redraw_keeps_features_and_ignores_the_generator():
    torch.manual_seed(1)
    layer = MultiHeadAttention(
        16, 2, method="performer", num_features=8, feature_redraw_interval=None
    )
    x = torch.randn(2, 5, 16)
    a = layer(x, generator=gen(1))
    b = layer(x, generator=gen(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    state = layer.state_dict()
    assert "method_state.projection" in state


def test_a_layer_built_under_a_device_context_keeps_its_features_there():
    """``with torch.device(d)`` puts the projections' weights on d, and the features and
    their seed with them (they stayed on the CPU, which a forward on d could not use);
    the numbers are those drawn on the CPU."""
    torch.manual_seed(3)
    plain = MultiHeadAttention(16, 2, method="performer", num_features=8)
    torch.manual_seed(3)
    with torch.device("meta"):
        built = MultiHeadAttention(16, 2, method="performer", num_features=8)
    assert {t.device.type for t in built.state_dict().values()} == {"meta"}
    torch.manual_seed(3)
    with torch.device("cpu"):
        again = MultiHeadAttention(16, 2, method="performer", num_features=8)
    for name, value in plain.method_state.state_dict().items():
        torch.testing.assert_close(again.method_state.state_dict()[name], value)


def test_the_features_follow_the_default_dtype_as_the_weights_do():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(3)
        built = MultiHeadAttention(16, 2, method="performer", num_features=8)
    finally:
        torch.set_default_dtype(previous)
    features = built.method_state.projection
    assert features.dtype == built.q_proj.weight.dtype == torch.float64
    assert torch.equal(features.float().double(), features)  # the float32 draws, as they were


def test_defaults_are_the_published_settings():
    cfg = get_method("performer").make_config()
    assert (cfg.num_features, cfg.orthogonal, cfg.feature_redraw_interval) == (128, True, 1000)
    assert cfg.eps == 0.0  # unbiased FAVOR+ (performer-pytorch hard-wires 1e-4)
    caps = get_method("performer").capabilities
    assert caps.randomized and caps.mask and caps.cross_attention and not caps.learned_parameters


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"feature_redraw_interval": 0}, "feature_redraw_interval"),
        ({"scale": -1.0}, "scale"),
        ({"orthogonal": "yes"}, "orthogonal"),
        ({"eps": -1e-4}, "eps"),
    ):
        with pytest.raises(ValueError, match=word):
            performer_attention(q, k, v, **options)
    with pytest.raises(ValueError, match=r"\[num_features, D\] = \[8, 4\]"):
        performer_attention(q, k, v, num_features=8, projection=torch.randn(8, 5))
    with pytest.raises(TypeError, match="projection"):
        performer_attention(q, k, v, projection=[[1.0]])
    with pytest.raises(TypeError, match="generator"):
        performer_attention(q, k, v, generator=1)


def test_redraws_are_the_same_in_every_process_whatever_the_global_stream():
    """Data-parallel processes (and resumed runs) must redraw identical features: the draw
    depends on the layer's (seed, redraw count) buffers, not on the global generator."""
    torch.manual_seed(0)
    a = MultiHeadAttention(16, 2, method="performer", num_features=8, feature_redraw_interval=1)
    b = MultiHeadAttention(16, 2, method="performer", num_features=8, feature_redraw_interval=1)
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 6, 16)
    a.train(), b.train()
    for step in range(3):
        torch.manual_seed(100 + step)  # a different global stream for each "process"
        a(x)
        torch.manual_seed(200 + step)
        b(x)
        torch.testing.assert_close(a.method_state.projection, b.method_state.projection)
    assert int(a.method_state.redraws) == 2


@pytest.mark.parametrize("n", [1, 37, 130])
def test_causal_matches_the_lower_triangular_reference(n):
    """Causal FAVOR+ equals the materialised estimate with entries j > i removed
    (outputs and gradients), with padding: left padding gives padded rows that see no
    real key (a zero normaliser, whose 0 / 0 must not reach the gradients)."""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, n, 8))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, 1:3] = False
    w = gaussian_projection(16, 8, generator=gen(3)).double()
    fast = performer_attention(q, k, v, key_padding_mask=mask, projection=w, causal=True,
                               num_features=16)
    ref = reference_performer_attention(q, k, v, w, key_padding_mask=mask, causal=True)
    torch.testing.assert_close(fast, ref)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("d", "scale"), [(64, 0.5), (128, 0.5), (128, 3.0), (256, 0.5),
                                          (256, 2.0)])
def test_causal_float32_keeps_its_normaliser_at_common_head_dims(d, scale):
    """Causal FAVOR+ in float32 equals the float64 estimate at head dims 64 to 256 (the
    keys of language models have entries of std 3 and more): a shift of the keys fixed in
    advance (a bound over every key) lowered ordinary keys' features below the
    normaliser's float32 threshold, so every row returned the prefix mean of the values
    (0.6 off at D = 64 on small inputs; 5 at D = 128, std 3)."""
    q, k, v = make_qkv(1, 2, 70, d, dv=4, dtype=torch.float32, scale=scale)
    w = gaussian_projection(128, d, generator=gen(3))
    out = performer_attention(q, k, v, projection=w, causal=True, num_features=128)
    ref = reference_performer_attention(q.double(), k.double(), v.double(), w.double(),
                                        causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_a_huge_later_key_changes_no_earlier_causal_output():
    """The keys' shift of row i is their running maximum up to i: a later key far larger
    than the others (aligned with a feature direction) leaves every earlier row
    bit-identical, in the first chunk and in later ones."""
    q, k, v = make_qkv(2, 2, 150, 8, dtype=torch.float32)
    w = gaussian_projection(16, 8, generator=gen(3))
    out = performer_attention(q, k, v, projection=w, causal=True, num_features=16)
    for j in (20, 140):
        spoiled = k.clone()
        spoiled[0, 1, j] = 40 * w[0]
        again = performer_attention(q, spoiled, v, projection=w, causal=True,
                                    num_features=16)
        assert torch.equal(again[:, :, :j], out[:, :, :j]), j
        assert not torch.equal(again[0, 1, j:], out[0, 1, j:])


def test_causal_keys_far_below_later_ones_in_log_scale_give_finite_rows():
    """Large keys in the first chunk, ordinary ones after: their log-scales lie thousands
    apart, beyond float64's exp range. The rows equal attention by the log-features in
    float64 (logsumexp over the features, softmax over the keys j <= i); one cumulative
    sum at a fixed reference made every row from the third chunk on NaN."""
    q, k, v = make_qkv(1, 2, 140, 8, dv=4, seed=5)
    k[:, :, :64] *= 60
    w = gaussian_projection(16, 8, generator=gen(3)).double()
    out = performer_attention(q, k, v, projection=w, causal=True, num_features=16)
    root = 8 ** -0.25  # the square root of the default scale 1/sqrt(D)
    log_q, log_k = ((x * root) @ w.T - (x * root).square().sum(-1, keepdim=True) / 2
                    for x in (q, k))  # [B, H, N, m]
    logits = torch.logsumexp(log_q[:, :, :, None] + log_k[:, :, None], -1)  # [B, H, N, N]
    later = torch.ones(140, 140, dtype=torch.bool).triu(1)
    want = logits.masked_fill(later, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_prefix_sums_of_ordinary_keys_take_one_cumulative_sum_equal_to_the_scan(
        monkeypatch, dtype):
    """Keys whose log-scales span less than CUMSUM_SPAN take the one-pass cumulative sum
    (the scan's log2 C passes dominated at long lengths); it equals the scan, forced by
    a span of -1, forward and backward, with padding and a start state."""
    from skyformer.ops.shared import rescaled_prefix

    q, k, v = (t.to(dtype).requires_grad_() for t in make_qkv(2, 2, 300, 8, dv=4, seed=6))
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, :37] = False
    w = gaussian_projection(16, 8, generator=gen(3)).to(dtype)

    def run():
        out = performer_attention(q, k, v, projection=w, causal=True, num_features=16,
                                  key_padding_mask=mask)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    scans = []
    by_scan = rescaled_prefix.prefix_sums_by_scan
    monkeypatch.setattr(rescaled_prefix, "prefix_sums_by_scan",
                        lambda *a: scans.append(1) or by_scan(*a))
    fast = run()
    assert scans == []
    monkeypatch.setattr(rescaled_prefix, "CUMSUM_SPAN", -1.0)
    slow = run()
    assert scans
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("eps", [1e-3, 0.5])
def test_causal_eps_shifts_each_rows_keys_by_their_maximum_up_to_it(eps):
    """eps > 0 with causal=True: row i's key features are exp(w.k' - |k'|^2/2 - c_i) +
    eps with c_i the maximum of w_f.k_j' over the real keys j <= i (the causal form of
    the non-causal keys' shift), outputs and gradients; padding included."""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, 75, 8, dv=5, seed=11))
    mask = torch.ones(2, 75, dtype=torch.bool)
    mask[1, 1:3] = False
    mask[0, 66:70] = False
    w = gaussian_projection(16, 8, generator=gen(3)).double()
    fast = performer_attention(q, k, v, key_padding_mask=mask, projection=w, causal=True,
                               num_features=16, eps=eps)
    ref = reference_performer_attention(q, k, v, w, key_padding_mask=mask, causal=True,
                                        eps=eps)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_projection_is_not_hidden(bad):
    """A non-finite feature direction spoils every feature sum: the output says so (NaN)
    instead of the mean(V) fallback of an empty normaliser; padded query rows stay 0."""
    q, k, v = make_qkv(2, 2, 7, 4)
    projection = torch.randn(6, 4, dtype=torch.float64)
    projection[2, 1] = bad
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    out = performer_attention(q, k, v, key_padding_mask=mask, num_features=6,
                              projection=projection)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1, :, :5]).all()
    assert (out[1, :, 5:] == 0).all()


def test_a_compiled_layer_redraws_on_the_eager_schedule():
    """Under torch.compile the redraw is tensor ops; they once never counted the calls,
    so a compiled layer trained on its first features forever (0.45 off eager from the
    third call at interval 2)."""
    import copy

    torch.manual_seed(5)
    layer = MultiHeadAttention(16, 2, "performer", num_features=8,
                               feature_redraw_interval=2).train()
    twin = copy.deepcopy(layer)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    x = torch.randn(2, 10, 16)
    for _ in range(5):
        torch.testing.assert_close(compiled(x), layer(x))
    state, twin_state = layer.method_state, twin.method_state
    assert int(state.redraws) == 2
    for name in ("redraws", "calls_since_redraw", "projection"):
        assert torch.equal(getattr(twin_state, name), getattr(state, name)), name


def test_a_compiled_layer_under_checkpointing_does_not_count_the_recomputation():
    """Activation checkpointing runs the compiled forward again inside the backward
    pass: that run neither counts nor redraws (read when the graph runs), so compiled
    and eager layers keep one schedule and the gradients of the features each call
    used (a redraw inside the recomputation gave gradients 4 off)."""
    import copy

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(5)
    layer = MultiHeadAttention(16, 2, "performer", num_features=8,
                               feature_redraw_interval=2).double().train()
    twin = copy.deepcopy(layer)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    for _ in range(4):
        grads = []
        for model in (layer, compiled):
            leaf = x.clone().requires_grad_(True)
            checkpoint(model, leaf, use_reentrant=False).square().sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[1], grads[0])
    for name in ("redraws", "calls_since_redraw", "projection"):
        assert torch.equal(getattr(twin.method_state, name),
                           getattr(layer.method_state, name)), name
    assert int(layer.method_state.redraws) == 1


def test_a_projection_of_other_rows_names_num_features():
    q = torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match=r"pass num_features=16 with it"):
        performer_attention(q, q, q, projection=torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"its columns are the head dim, D = 8"):
        performer_attention(q, q, q, num_features=16, projection=torch.randn(16, 4))
