from __future__ import annotations

import pytest
import torch

from skyformer import softmax_attention
from skyformer.ops.softmax.naive import reference_softmax_attention
from tests.conftest import make_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_path_matches_naive_reference(causal, masked):
    q, k, v = make_qkv(2, 3, 19, 8)
    mask = None
    if masked:
        mask = torch.ones(2, 19, dtype=torch.bool)
        mask[0, 15:] = False
        mask[1, :4] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    grads_fast = torch.autograd.grad(fast.sin().sum(), (q, k, v))
    ref = reference_softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    grads_ref = torch.autograd.grad(ref.sin().sum(), (q, k, v))
    torch.testing.assert_close(fast, ref)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_custom_scale_and_cross_attention():
    q, k, v = make_qkv(1, 2, 6, 4, nk=11, dv=3)
    fast = softmax_attention(q, k, v, scale=0.7)
    ref = torch.softmax(0.7 * q @ k.transpose(-1, -2), -1) @ v
    torch.testing.assert_close(fast, ref)


def test_bad_options():
    q, k, v = make_qkv(1, 1, 4, 4, nk=5)
    with pytest.raises(ValueError, match="causal"):
        softmax_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        softmax_attention(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_a_zero_or_negative_scale_is_torch_sdpa_s(scale):
    """torch's SDPA takes any finite scale (0 weighs the visible keys alike); so does
    exact softmax, with key padding and causal (the padded causal form carries the
    padding in an extra logit column), where it refused all but positive ones."""
    import torch.nn.functional as F

    q, k, v = make_qkv(2, 2, 7, 4, dv=3)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    torch.testing.assert_close(softmax_attention(q, k, v, scale=scale),
                               F.scaled_dot_product_attention(q, k, v, scale=scale))
    # unpadded causal: torch's CPU flash kernel gave NaN rows for scale <= 0, its math
    # kernel and an explicit tril mask the right ones
    tril = torch.ones(7, 7, dtype=torch.bool).tril()
    for dtype in (torch.float64, torch.float32):
        a, b, c = (t.to(dtype) for t in (q, k, v))
        torch.testing.assert_close(
            softmax_attention(a, b, c, causal=True, scale=scale),
            F.scaled_dot_product_attention(a, b, c, attn_mask=tril, scale=scale))
    for causal in (False, True):
        allowed = valid[:, None, None, :] & (torch.ones(7, 7, dtype=torch.bool).tril()
                                             if causal else True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        got = softmax_attention(q, k, v, key_padding_mask=valid, causal=causal, scale=scale)
        real = valid[:, None, :, None].expand_as(got)  # padded query rows are zeroed
        torch.testing.assert_close(got[real], want[real])


@pytest.mark.parametrize("shape", [(3, 1, 6, 5), (2, 4, 6, 5), (6, 4)])
def test_an_attn_mask_of_another_batch_or_head_count_is_named(shape):
    q, k, v = make_qkv(2, 3, 6, 4, nk=5)
    with pytest.raises(ValueError, match=r"softmax: attn_mask must broadcast to "
                                         r"\[B, H, Nq, Nk\] = \[2, 3, 6, 5\], got"):
        softmax_attention(q, k, v, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_an_attn_mask_of_one_key_column_broadcasts():
    q, k, v = make_qkv(2, 3, 6, 4, nk=5)
    rows = torch.tensor([True, False, True, True, False, True])[:, None]
    out = softmax_attention(q, k, v, attn_mask=rows)
    torch.testing.assert_close(out, softmax_attention(q, k, v, attn_mask=rows.expand(6, 5)))
    assert out[:, :, 1].abs().max() == 0


@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_a_nan_bias_row_is_nan_as_in_sdpa_and_a_row_without_keys_zero(method):
    """A row of an additive mask that is all NaN (a bias computed from a NaN) is NaN, as
    in torch's SDPA; only a row whose every entry is -inf has no key and gives zeros."""
    import skyformer

    q, k, v = make_qkv(1, 1, 4, 8)
    bias = torch.zeros(4, 4)
    bias[2] = float("nan")
    bias[1] = float("-inf")
    out = skyformer.scaled_dot_product_attention(q, k, v, bias, method=method)
    assert out[0, 0, 2].isnan().all()
    assert out[0, 0, 1].eq(0).all()
    assert out[0, 0, [0, 3]].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_padded_causal_rows_whose_logits_all_lie_far_below_zero_keep_their_weights(dtype):
    """The padded causal form carried the padding as a fixed logit of -1e6: a row whose
    real logits all lay below it (a large scale, s = 1e4, with q.k ~ -150) gave the
    padded keys every weight and came out 0, where torch's SDPA with the same mask
    gives the real keys' values. The padded logit now lies below every real one, a NaN
    row of another head left out."""
    import torch.nn.functional as F

    n = 6
    q = torch.full((2, 2, n, 4), 5.0)
    k = -(5 + torch.rand(2, 2, n, 4, generator=torch.Generator().manual_seed(0)) * 5)
    v = torch.randn(2, 2, n, 3, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[0, :2] = False  # left padding: rows 0-1 of element 0 see no real key
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got = softmax_attention(q, k, v, key_padding_mask=valid, causal=True, scale=1e4,
                            query_padding_mask=None)
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, None, :]
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=1e4,
                                          attn_mask=allowed)
    sees_a_key = allowed.any(-1, keepdim=True)
    torch.testing.assert_close(got.float(), torch.where(sees_a_key, want, 0.0),
                               **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}))
    if dtype == torch.float32:  # a NaN query row spoils its own row alone, as in SDPA
        q[0, 1, -1, 0] = torch.nan
        spoilt = softmax_attention(q, k, v, key_padding_mask=valid, causal=True, scale=1e4,
                                   query_padding_mask=None)
        assert spoilt[0, 1, -1].isnan().all()
        torch.testing.assert_close(spoilt[0, :, :-1], got[0, :, :-1])
        torch.testing.assert_close(spoilt[0, 0], got[0, 0])


@pytest.mark.parametrize(("causal", "dv"), [(True, 16), (False, 8), (False, 24), (True, 8)])
def test_the_padded_causal_form_and_another_value_width_form_no_n_by_n_block(causal, dv):
    """SDPA's CPU flash kernel takes q, k, v of one head dim; the padding's extra logit
    column (causal) or a value width Dv != D sent the call to the math backend, which
    forms the [N, N] scores. Forward and backward stay below N^2 / 8 entries, equal to
    the materialised reference."""
    from tests.dispatch import check_lean_and_equal

    n = 256
    q, k, v = make_qkv(1, 1, n, 16, dv=dv)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[:, -40:] = False
    check_lean_and_equal(
        lambda *qkv: softmax_attention(*qkv, key_padding_mask=mask, causal=causal),
        lambda *qkv: reference_softmax_attention(*qkv, key_padding_mask=mask, causal=causal),
        [t.clone().requires_grad_(True) for t in (q, k, v)], n * n // 8)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_keeps_sdpa_s_causal_flag_and_no_n_by_n_bias(monkeypatch, causal, padded):
    """With dropout_p the call stays on SDPA's causal flag and key-column mask, which its
    fused kernels take with dropout on CUDA; it built a [B, H, N, N] bias. Dropout
    follows its expectation (the mean of many draws is the output without it)."""
    import torch.nn.functional as F

    q, k, v = make_qkv(2, 1, 6, 4)
    valid = torch.ones(2, 6, dtype=torch.bool)
    if padded:
        valid[1, 4:] = False
    mask = valid if padded else None
    calls = []
    original = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask, kwargs.get("is_causal", False)))
        return original(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    clean = softmax_attention(q, k, v, key_padding_mask=mask, causal=causal)
    torch.manual_seed(0)
    draws = torch.stack([softmax_attention(q, k, v, key_padding_mask=mask, causal=causal,
                                           dropout_p=0.5) for _ in range(3000)])
    assert all(m is None or m.shape[-2] == 1 for m, _ in calls)
    assert all(flag == causal for _, flag in calls)
    assert not torch.equal(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0), clean, atol=0.1, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64], ids=["bool", "additive"])
@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_a_key_padding_mask_expanded_over_the_queries_forms_no_n_by_n_bias(method, dtype):
    """A mask ``[B, 1, Nq, Nk]`` that is one key row expanded over the queries (stride 0,
    as ``skyformer.hf`` builds padding masks: O(N) memory) became a materialised
    [B, 1, Nq, Nk] bias and was kept for the backward pass; it stays one row, which
    SDPA broadcasts. Forward and backward stay below N^2 / 4 entries, equal to the
    call with ``key_padding_mask``."""
    import skyformer
    from tests.dispatch import check_lean_and_equal

    n = 256
    q, k, v = make_qkv(2, 1, n, 8)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, -40:] = False
    rows = valid if dtype == torch.bool else torch.where(valid, 0.0, float("-inf"))
    mask = rows[:, None, None, :].expand(2, 1, n, n)
    method_fn = skyformer.get_method(method).function
    check_lean_and_equal(
        lambda *qkv: method_fn(*qkv, attn_mask=mask, query_padding_mask=valid),
        lambda *qkv: method_fn(*qkv, key_padding_mask=valid),
        [t.clone().requires_grad_(True) for t in (q, k, v)], n * n // 4)


def _recorded(recorder: str, fn, example: tuple):
    """``fn`` recorded on ``example`` by ``recorder`` (a program that runs other inputs)."""
    if recorder == "export":
        class Module(torch.nn.Module):
            def forward(self, *args):
                return fn(*args)

        return torch.export.export(Module(), example).module()
    if recorder == "jit.trace":
        return torch.jit.trace(fn, example, check_trace=False)
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*example)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("recorder", ["export", "jit.trace", "make_fx"])
@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_a_program_recorded_with_an_expanded_mask_runs_any_mask(method, recorder):
    """A program exported (or traced) with an example mask that repeats a key row by
    stride 0 ran every later mask as its first query row: a graph keeps no strides, so
    a causal mask given to it then was read as a padding row. The recorded program takes
    any mask of the shape."""
    import skyformer

    n = 8
    q, k, v = make_qkv(2, 2, n, 4)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, -3:] = False
    method_fn = skyformer.get_method(method).function

    def call(q, k, v, mask):
        return method_fn(q, k, v, attn_mask=mask)

    program = _recorded(recorder, call, (q, k, v, valid[:, None, None, :].expand(2, 1, n, n)))
    causal = torch.ones(2, 1, n, n, dtype=torch.bool).tril()
    torch.testing.assert_close(program(q, k, v, causal), call(q, k, v, causal))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_bias_with_half_inputs_keeps_its_precision_on_the_cpu(dtype):
    """A float32 attn_mask (a bias such as ALiBi's, hundreds at long N) with half
    inputs: the CPU's SDPA takes it as it is, as torch's own call; rounded to bfloat16,
    its spacing of 2 there would move the logits by whole units."""
    q, k, v = make_qkv(1, 2, 16, 8, seed=11)
    bias = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) * 3 - 300.3
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.to(dtype) for t in (q, k, v)), attn_mask=bias)
    out = softmax_attention(*(t.to(dtype) for t in (q, k, v)), attn_mask=bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    exact = softmax_attention(q, k, v, attn_mask=bias.double())
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=0.02)
    # a float64 mask (torch refuses it) is not rounded to the inputs' dtype either
    wider = softmax_attention(*(t.to(dtype) for t in (q, k, v)), attn_mask=bias.double())
    torch.testing.assert_close(wider, out, rtol=0, atol=0)
