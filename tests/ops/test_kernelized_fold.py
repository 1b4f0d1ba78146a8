"""Exact kernelized attention through SDPA at head dim D (``fold_key_norms=True``,
``ops/kernelized/sdpa_fold.py``) against the naive pairwise reference, both routes (the
key norms as a bias of the scores; folded into the values, which CUDA bfloat16 takes and
the CPU tests force): outputs and gradients, padding, causal masks, cross-attention,
Dv != D, half types, the range the values route is exact in, ``torch.func`` and
``torch.compile``; on CUDA with ``SKYFORMER_TEST_CUDA=1`` (FlashAttention-2 for
bfloat16, the memory-efficient kernel with the bias for float32).
"""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer import kernelized_attention
from skyformer.ops.kernelized import sdpa_fold
from skyformer.ops.kernelized.naive import reference_kernelized_attention
from tests.conftest import edge_padding, gen, make_qkv
from tests.devices import devices, relative_error
from tests.dispatch import Recorder

CASES = [  # b, h, nq, nk, d, dv
    (2, 2, 37, 45, 16, 24),
    (1, 3, 70, 70, 40, 8),
    (2, 1, 33, 1, 128, 16),
    (1, 1, 130, 97, 64, 64),
]
FORMS = ["plain", "padded", "causal", "padded causal"]


@pytest.fixture(params=["bias", "values"])
def route(request, monkeypatch):
    """The key norms as a bias of the scores (the CPU's and CUDA float32's route) or
    folded into the values (CUDA bfloat16's), forced on any device."""
    if request.param == "values":
        monkeypatch.setattr(sdpa_fold, "takes_key_bias", lambda q: False)
    return request.param


def _errors(q, k, v, mask, causal, dtype, device) -> dict[str, float]:
    """Output and input gradients of the folded call in ``dtype`` on ``device``: relative
    errors against the pairwise reference in float64 on the same rounded inputs."""
    leaves = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, key_padding_mask=mask, causal=causal,
                               fold_key_norms=True)
    assert out.dtype == dtype and out.device.type == torch.device(device).type
    exact = [t.to(device, dtype).double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_kernelized_attention(*exact, key_padding_mask=mask, causal=causal)
    weights = torch.randn(out.shape, generator=gen(9), dtype=torch.float64).to(device)
    got = [out, *torch.autograd.grad((out * weights.to(dtype)).sum(), leaves)]
    want = [ref, *torch.autograd.grad((ref * weights).sum(), exact)]
    return {name: relative_error(a, e)
            for name, a, e in zip(["out", "dq", "dk", "dv"], got, want, strict=True)}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("case", "form"), [(case, form) for case in CASES for form in FORMS
                                            if "causal" not in form or case[2] == case[3]])
def test_folded_sdpa_equals_the_naive_reference(device, case, form, route):
    b, h, nq, nk, d, dv = case
    q, k, v = make_qkv(b, h, nq, d, nk=nk, dv=dv, seed=nq + d, scale=0.7)
    mask = edge_padding(b, nk, device) if "padded" in form else None
    dtype, tolerance = ((torch.float64, 1e-12) if device == "cpu"
                        else (torch.float32, 1e-4))  # float64 on CUDA: the augmentation
    errors = _errors(q, k, v, mask, "causal" in form, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_folded_sdpa_in_float32_and_half_types(device, dtype, causal, route):
    """To the dtype's rounding: bfloat16 as SDPA itself rounds (the weights before their
    product with V), float16 computed in float32 and rounded once at the end."""
    q, k, v = make_qkv(2, 2, 66, 64, seed=4)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    errors = _errors(q, k, v, edge_padding(2, 66, device), causal, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


def test_the_augmentation_and_the_fold_agree_with_padded_queries_zeroed():
    q, k, v = make_qkv(2, 2, 50, 32, seed=6)
    mask = edge_padding(2, 50, "cpu")
    out = [kernelized_attention(q, k, v, key_padding_mask=mask, fold_key_norms=fold)
           for fold in (False, True)]
    assert relative_error(out[1], out[0]) < 1e-12
    assert (out[1][0, :, -12:] == 0).all()  # padded queries of batch 0


def _one_far_key(span: float, d: int = 64) -> tuple[torch.Tensor, ...]:
    """float32 keys near the origin and one key (the last) with s |k|^2 / 2 = ``span``
    (s = d^-1/2), the last query next to it, so that its row is that key's value."""
    q, k, v = make_qkv(1, 1, 40, d, seed=3, dtype=torch.float32, scale=0.5)
    far = torch.full((d,), (2 * span * d**0.5 / d) ** 0.5)
    k[0, 0, -1], q[0, 0, -1] = far, far + 0.1
    return q, k, v


def _errors_against_float64(q, k, v, **options) -> list[float]:
    """Relative errors of the folded call's output and q, k, v gradients against the
    pairwise reference in float64 on the same (rounded) inputs."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    exact = [t.double().requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, fold_key_norms=True, **options)
    ref = reference_kernelized_attention(*exact, **options)
    weights = torch.randn(ref.shape, generator=gen(2), dtype=torch.float64)
    got = [out, *torch.autograd.grad((out * weights.to(out.dtype)).sum(), leaves)]
    want = [ref, *torch.autograd.grad((ref * weights).sum(), exact)]
    return [relative_error(a, b) for a, b in zip(got, want, strict=True)]


@pytest.mark.parametrize("span", [55.0, 95.0, 300.0])
def test_exact_within_the_range_of_each_route(span, route):
    """The values route within its limit (55 < ``FOLD_SPAN_LIMIT``), the bias route at
    any span: outputs and gradients as exact as the augmentation's (float32's rounding
    of the far key: about 3e-5 in its own row)."""
    if route == "values" and span > sdpa_fold.FOLD_SPAN_LIMIT:
        pytest.skip("past the values route's limit: the next test")
    q, k, v = _one_far_key(span)
    assert max(_errors_against_float64(q, k, v)) < 1e-5
    out = kernelized_attention(q, k, v, fold_key_norms=True)
    augmented = kernelized_attention(q, k, v, fold_key_norms=False)
    ref = reference_kernelized_attention(q.double(), k.double(), v.double())
    assert relative_error(out[0, 0, -1], ref[0, 0, -1]) < 1e-4
    assert relative_error(out[0, 0, -1], augmented[0, 0, -1]) < 1e-5


def test_past_the_values_route_limit_the_head_is_nan_not_silently_inexact(monkeypatch):
    monkeypatch.setattr(sdpa_fold, "takes_key_bias", lambda q: False)
    q, k, v = _one_far_key(sdpa_fold.FOLD_SPAN_LIMIT + 20)  # less after the mean is out
    other = make_qkv(1, 1, 40, 64, seed=4, dtype=torch.float32, scale=0.5)
    q, k, v = (torch.cat([a, b], dim=1) for a, b in zip((q, k, v), other, strict=True))
    out = kernelized_attention(q, k, v, fold_key_norms=True)  # heads: too wide, fine
    assert out[0, 0].isnan().all()
    ref = reference_kernelized_attention(*(t[:, 1:].double() for t in (q, k, v)))
    assert relative_error(out[:, 1:], ref) < 1e-5


def _large_norm_keys(span: float, d: int = 64) -> tuple[torch.Tensor, ...]:
    """bfloat16 keys near x with s |x|^2 / 2 = 400 and the first along x with ``span``
    more, the queries next to the keys: the first key's larger score, not carried by
    -b in the values route, takes the softmax weight of the others' (their weights can
    fall below e^-87 while their C is the larger)."""
    g = gen(5)
    x = torch.full((d,), (2 * 400 * d**0.5 / d) ** 0.5)
    k = x + 0.05 * torch.randn(12, d, generator=g)
    k[0] = x * ((400 + span) / 400) ** 0.5
    q = k.clone()
    q[1:] += 0.05 * torch.randn(11, d, generator=g)
    v = torch.randn(12, d, generator=g)
    return tuple(t[None, None].to(torch.bfloat16) for t in (q, k, v))


@pytest.mark.parametrize("span", [55.0, 95.0])
def test_the_values_route_keeps_every_key_below_its_limit_and_says_so_above(span,
                                                                            monkeypatch):
    """Causal, so that row 1 sees key 0 (larger norm and score) and key 1 only."""
    monkeypatch.setattr(sdpa_fold, "takes_key_bias", lambda q: False)
    q, k, v = _large_norm_keys(span)
    out = kernelized_attention(q, k, v, causal=True, fold_key_norms=True)
    if span > sdpa_fold.FOLD_SPAN_LIMIT:
        assert out.isnan().all()
        return
    ref = reference_kernelized_attention(*(t.double() for t in (q, k, v)), causal=True)
    rows = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rows.max() < 1e-2  # bfloat16's rounding in every row


def test_padded_keys_of_the_values_route_stay_out_of_every_row(monkeypatch):
    """A padded key has k = 0, b = 0: its v' must be 0, not exp(c) (which overflows once
    the valid keys' b, and so c, pass 88), whatever the causal order."""
    monkeypatch.setattr(sdpa_fold, "takes_key_bias", lambda q: False)
    q, k, v = make_qkv(1, 1, 16, 64, seed=9, dtype=torch.float32)
    q, k = q + 5.0, k + 5.0  # b of 94 to 112: a span of 18, far from the limit
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, -2:] = False
    for causal in (False, True):
        errors = _errors_against_float64(q, k, v, key_padding_mask=mask, causal=causal)
        assert max(errors) < 1e-4, (causal, errors)


def test_the_values_route_backward_takes_any_gradient_size(monkeypatch):
    """dO . v' = r g . v' passes float32's range here for |g| ~ 1e20 (r ~ e^15, v' up to
    e^40 |v|): the backward scales dO (it is linear in it) and the gradients back. (At
    |g| ~ 1e30 the term of a, -s q (g . C V), passes it itself, on either route.)"""
    monkeypatch.setattr(sdpa_fold, "takes_key_bias", lambda q: False)
    q, k, v = _one_far_key(55.0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, fold_key_norms=True)
    weights = torch.randn(out.shape, generator=gen(3))
    small = torch.autograd.grad((out * weights).sum(), leaves, retain_graph=True)
    large = torch.autograd.grad((out * weights * 1e20).sum(), leaves)
    for a, b in zip(large, small, strict=True):
        assert a.isfinite().all()
        assert relative_error(a / 1e20, b) < 1e-5  # rounded otherwise, as a whole


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_reaches_only_the_causal_rows_that_see_it(route, bad):
    """Not the rows before it (the fused kernel adds the bias after its causal mask; a
    NaN folded into V would reach them through 0 x NaN), nor the other keys' shift."""
    q, k, v = make_qkv(1, 2, 40, 16, seed=7)
    clean = kernelized_attention(q, k, v, causal=True, fold_key_norms=True)
    k[0, 1, 20, 3] = bad
    out = kernelized_attention(q, k, v, causal=True, fold_key_norms=True)
    torch.testing.assert_close(out[:, :, :20], clean[:, :, :20], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, 0], clean[:, 0], rtol=1e-12, atol=1e-12)
    assert not out[0, 1, 20:].isfinite().all()


def test_fold_exponent_shift_is_the_middle_of_the_valid_keys_range_with_headroom():
    norms = torch.tensor([[[1.0, 5.0, 1000.0, 9.0]], [[2.0, 300.0, 4.0, float("nan")]]])
    valid = torch.tensor([[True, True, False, True], [True, True, True, False]])[:, None]
    shift, too_wide = sdpa_fold.fold_exponent_shift(norms, valid)
    assert shift[:, 0, 0].tolist() == [5.0, 2.0 + sdpa_fold.FOLD_HEADROOM]
    assert too_wide[:, 0, 0].tolist() == [False, True]
    empty, _ = sdpa_fold.fold_exponent_shift(norms, torch.zeros_like(valid))
    assert empty.eq(0).all()  # no valid key: 0, not inf


def test_cpu_calls_take_the_head_dim_by_default_and_the_augmentation_on_request(
        monkeypatch):
    """Default (None): a CPU call runs SDPA's CPU kernel at head dim D, a padding-like
    attn_mask (one row over the keys) added to the key bias; False, a mask with a row per
    query (slower at head dim D on the CPU): the augmentation at D + 8. True: head dim D
    with any mask. A learned mask is routed as a fixed one of its shape."""
    from skyformer.ops.kernelized import kernelized as module

    q, k, v = make_qkv(1, 2, 20, 16)
    ran = []

    def counting(name, call):
        def counted(*args, **kwargs):
            ran.append(name)
            return call(*args, **kwargs)
        return counted

    for name in ("kernelized_by_folding", "kernelized_by_sdpa"):
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))

    def route(**options):
        def width(func, args, out):
            return args[0].shape[-1] if "scaled_dot_product" in func.name() else None

        ran.clear()
        with Recorder(width) as seen:
            out = kernelized_attention(q, k, v, **options)
        c = torch.exp(-(q[..., :, None, :] - k[..., None, :, :]).square().sum(-1) / 8)
        mask = options.get("attn_mask")  # the Gaussian times the mask's weights
        if mask is not None:
            c = c * (mask if mask.dtype == torch.bool else mask.detach().exp())
        assert relative_error(out, c @ v) < 1e-12  # s = 16^-1/2: the exponent / 8
        return ran[0], set(seen.items) - {None}

    folded = ("kernelized_by_folding", {16})
    assert route() == route(fold_key_norms=True) == folded
    assert route(fold_key_norms=False) == ("kernelized_by_sdpa", {24})
    keys = torch.rand(1, 1, 1, 20, generator=gen(1), dtype=torch.float64)
    assert route(attn_mask=keys) == route(attn_mask=keys.expand(1, 1, 20, 20)) == folded
    assert route(attn_mask=keys > 0.2) == folded
    causal_pattern = torch.ones(20, 20, dtype=torch.bool).tril()
    assert route(attn_mask=causal_pattern)[0] == "kernelized_by_sdpa"
    assert route(attn_mask=causal_pattern, fold_key_norms=True) == folded
    learned = keys.clone().requires_grad_(True)
    assert route(attn_mask=learned) == route(attn_mask=learned, fold_key_norms=True) \
        == folded
    per_query = torch.rand(20, 20, generator=gen(2), dtype=torch.float64).requires_grad_()
    assert route(attn_mask=per_query)[0] == "kernelized_by_sdpa"
    assert route(attn_mask=per_query, fold_key_norms=True) == folded


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_an_attn_mask_with_padding_and_causal_equals_the_augmentation(kind):
    """CPU: the mask added to the key bias, with key padding and causal; a query that may
    see no key (an all-False row) gets zeros and zero gradients, as from the
    augmentation. Outputs and gradients, float64."""
    q, k, v = make_qkv(2, 2, 30, 16, seed=13)
    g = gen(14)
    mask = torch.rand(2, 1, 30, 30, generator=g) > 0.3
    mask[:, :, 4] = False  # query 4 sees nothing
    if kind == "float":
        mask = torch.where(mask, 3 * torch.rand(mask.shape, generator=g), -torch.inf)
        mask = mask.double()
    padding = edge_padding(2, 30)
    results = []
    for fold in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = kernelized_attention(*leaves, attn_mask=mask, key_padding_mask=padding,
                                   causal=True, fold_key_norms=fold)
        weights = torch.randn(out.shape, generator=gen(15), dtype=torch.float64)
        results.append([out, *torch.autograd.grad((out * weights).sum(), leaves)])
    for got, want in zip(*results, strict=True):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert results[0][0][:, :, 4].eq(0).all()


@pytest.mark.parametrize("shape", [(2, 1, 1, 30), (2, 2, 1, 30), (30, 30), (2, 2, 30, 30)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_learned_attn_mask_gets_the_augmentations_gradient(shape, causal):
    """A float mask that requires grad (a learned bias): at head dim D its gradient is
    the scores' (column sums for a row over the keys, P formed again for a row per
    query), summed over what it broadcasts over; float64, with key padding, against the
    augmentation through SDPA's own autograd. It was refused with fold_key_norms=True."""
    q, k, v = make_qkv(2, 2, 30, 16, seed=21)
    bias = torch.randn(shape, generator=gen(22), dtype=torch.float64)
    padding = edge_padding(2, 30)
    weights = torch.randn(2, 2, 30, 16, generator=gen(23), dtype=torch.float64)
    results = []
    for fold in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
        out = kernelized_attention(*leaves[:3], attn_mask=leaves[3], causal=causal,
                                   key_padding_mask=padding, fold_key_norms=fold)
        results.append([out, *torch.autograd.grad((out * weights).sum(), leaves)])
    assert results[0][-1].shape == shape
    assert results[0][-1].abs().max() > 1e-3  # the mask does reach the loss
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_learned_attn_mask_under_a_reentrant_checkpoint():
    """The forward of a reentrant checkpoint runs without grad mode, its recomputation
    with it: with fold_key_norms=True the recomputation raised where the mask requires
    grad. Gradients as without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = make_qkv(1, 2, 12, 8, seed=24)
    bias = torch.randn(12, 12, generator=gen(25), dtype=torch.float64)

    def attend(q, k, v, bias):
        return kernelized_attention(q, k, v, attn_mask=bias, fold_key_norms=True)

    grads = []
    for run in (attend, lambda *t: checkpoint(attend, *t, use_reentrant=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
        run(*leaves).square().sum().backward()  # reentrant: .backward(), not .grad()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_bad_combinations_are_refused_in_a_sentence():
    q, k, v = make_qkv(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r'fold_key_norms=True .* kernel="triton"'):
        kernelized_attention(q, k, v, fold_key_norms=True, kernel="triton")
    with pytest.raises(ValueError, match="fold_key_norms must be True, False or None"):
        kernelized_attention(q, k, v, fold_key_norms="yes")


def test_torch_func_transforms_and_forward_mode(route):
    q, k, v = make_qkv(3, 2, 20, 16, seed=11)
    call = lambda q, k, v: kernelized_attention(q, k, v, fold_key_norms=True)  # noqa: E731
    mapped = torch.func.vmap(call)(q[:, None], k[:, None], v[:, None])[:, 0]
    torch.testing.assert_close(mapped, call(q, k, v), rtol=1e-12, atol=1e-12)

    def loss(q, k, v):
        return (call(q, k, v) * v.sum(-1, keepdim=True)).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    loss(*leaves).backward()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)
    per_sample = torch.func.vmap(torch.func.grad(loss))(q[:, None], k[:, None], v[:, None])
    for i in range(3):  # each sample's gradient of q, alone
        alone = torch.func.grad(loss)(q[i : i + 1], k[i : i + 1], v[i : i + 1])
        torch.testing.assert_close(per_sample[i], alone, rtol=1e-12, atol=1e-12)
    # forward mode: the fused kernels have no derivative there, the augmentation does
    tangent = torch.randn_like(q)
    _, jvp = torch.func.jvp(lambda q: call(q, k, v), (q,), (tangent,))
    ref_jvp = torch.func.jvp(lambda q: reference_kernelized_attention(q, k, v), (q,),
                             (tangent,))[1]
    torch.testing.assert_close(jvp, ref_jvp, rtol=1e-9, atol=1e-12)


def test_compiled_call_equals_the_eager_one(route):
    q, k, v = make_qkv(1, 2, 24, 16, seed=12, dtype=torch.float32)
    mask = edge_padding(1, 24, "cpu")

    def step(q, k, v):
        return skyformer.attention(q, k, v, "kernelized", fold_key_norms=True,
                                   key_padding_mask=mask)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for call in (step, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = call(*leaves)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="the CUDA operators' signatures need a CUDA build of torch "
                           "(checked under fake CUDA tensors, no GPU needed)")
@pytest.mark.parametrize(("dtype", "width"), [(torch.bfloat16, 64), (torch.float32, 64),
                                              (torch.bfloat16, 264)])
def test_cuda_operator_calls_are_well_formed_on_fake_tensors(dtype, width):
    """The CUDA branch's private operators as the Function calls them, forward and
    backward, on fake tensors (shapes and dtypes from their fake kernels, which check
    neither dtypes nor head dims; the CUDA tests check those): half types without a bias
    (FlashAttention-2 up to head dim 256, the memory-efficient kernel above), float32
    with the key bias (memory-efficient)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 3, 100, width, device="cuda", dtype=dtype)
                   for _ in range(3))
        bias = torch.zeros(2, 3, 1, 100, device="cuda") if sdpa_fold.takes_key_bias(q) \
            else None
        out, lse, seed, offset = sdpa_fold._fused_forward(q, k, v, bias, 0.125, True)
        grads = sdpa_fold._fused_backward(out, q, k, v, bias, out, lse, seed, offset, 0.125,
                                          True)
    assert sdpa_fold.takes_key_bias(q) == (dtype == torch.float32)
    assert sdpa_fold.uses_flash(q) == (dtype == torch.bfloat16 and width <= 256)
    assert out.shape == q.shape and lse.dtype == torch.float32 and lse.shape[-1] >= 100
    assert [g.shape for g in grads] == [q.shape] * 3
