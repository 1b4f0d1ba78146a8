"""``skyformer.scaled_dot_product_attention``: SDPA's signature and semantics for every
method, and a sentence where a method cannot honour an argument."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import skyformer
from skyformer import CapabilityError, list_methods, random_key
from skyformer import scaled_dot_product_attention as sdpa
from tests.conftest import lacks, make_qkv

APPROXIMATE = [m for m in list_methods() if not skyformer.get_method(m).capabilities.exact]
ATOL = 1e-10  # float64 inputs


def test_default_is_softmax_and_equals_torch():
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    torch.testing.assert_close(sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("shape", [(10, 7), (1, 10, 7), (2, 1, 10, 7), (2, 3, 10, 7), (1, 7)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attn_mask_broadcasts_like_sdpa(shape, kind):
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(shape, generator=g, dtype=torch.float64) > 0.3
    mask[..., 0] = True  # every query sees a key (SDPA gives NaN for an empty row)
    if kind == "additive":
        mask = torch.where(mask, torch.randn(shape, generator=g, dtype=torch.float64),
                           torch.tensor(float("-inf"), dtype=torch.float64))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(sdpa(q, k, v, mask), expected)
    # kernelized takes the same masks (its weights are Gaussian, not softmax)
    out = sdpa(q, k, v, mask, method="kernelized")
    assert out.shape == expected.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("shape", [(10, 1), (2, 1, 10, 1), (1, 3, 1, 1)])
def test_attn_mask_broadcasts_over_the_keys_like_sdpa(shape):
    """A mask with one column (per query: all keys or none) broadcasts over S in SDPA."""
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    mask = torch.ones(shape, dtype=torch.bool)
    mask.view(-1)[::2] = False
    torch.testing.assert_close(sdpa(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    expected = sdpa(q, k, v, mask.expand(*shape[:-1], 7), method="kernelized")
    torch.testing.assert_close(sdpa(q, k, v, mask, method="kernelized"), expected)


def test_an_attn_mask_over_the_keys_reads_as_key_padding_for_the_approximations():
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    key = random_key(0)
    torch.testing.assert_close(
        sdpa(q, k, v, torch.ones(2, 1, 1, 1, dtype=torch.bool), method="skyformer",
             generator=key),
        sdpa(q, k, v, method="skyformer", generator=key))


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
@pytest.mark.parametrize("shape", [(2, 7), (3, 1, 1, 7), (2, 3, 10, 8), (1, 2, 3, 10, 7)])
def test_a_mask_that_does_not_broadcast_is_named_as_given(method, shape):
    """[B, S] is transformers' padding form, not SDPA's: SDPA reads a 2-D mask as [L, S];
    the sentence names the shape passed, not the 4-D view the methods see."""
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    with pytest.raises(ValueError, match=rf"attn_mask has shape \({', '.join(map(str, shape))}\),"
                                         r" which does not broadcast to the attention's "
                                         r"\[B, H, L, S\] = \[2, 3, 10, 7\]"):
        sdpa(q, k, v, torch.ones(shape, dtype=torch.bool), method=method)


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
def test_a_torch_multihead_attention_mask_gets_the_reshape(method):
    """torch.nn.MultiheadAttention's per-head mask [B * H, L, S] does not broadcast to
    SDPA's [B, H, L, S]; the sentence gives the view that does."""
    q, k, v = make_qkv(2, 3, 10, 8, nk=7)
    with pytest.raises(ValueError, match=r"attn_mask.view\(2, 3, 10, 7\) \(and a bool one of "
                                         r"torch's, True = blocked, inverts with ~\)\.$"):
        sdpa(q, k, v, torch.ones(6, 10, 7, dtype=torch.bool), method=method)


@pytest.mark.parametrize("method", ["kernelized", "skyformer"])
def test_is_causal_beside_causal_false_is_refused(method):
    """``is_causal=True, causal=False`` ran causal: the two disagree, and one of them
    was dropped without a word."""
    q, k, v = make_qkv(1, 2, 8, 4)
    with pytest.raises(ValueError, match=rf"^{method}: is_causal=True and causal=False "
                                         r"disagree"):
        sdpa(q, k, v, is_causal=True, method=method, causal=False)


def test_kernelized_bool_mask_equals_gathered_keys():
    q, k, v = make_qkv(1, 2, 6, 4, nk=9)
    mask = torch.zeros(9, dtype=torch.bool)
    mask[[0, 3, 4, 8]] = True
    out = sdpa(q, k, v, mask, method="kernelized")
    kept = sdpa(q, k[:, :, mask], v[:, :, mask], method="kernelized")
    torch.testing.assert_close(out, kept)


def test_is_causal_and_scale_equal_torch():
    q, k, v = make_qkv(2, 2, 9, 8)
    torch.testing.assert_close(sdpa(q, k, v, is_causal=True, scale=0.3),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              scale=0.3))


def test_attn_mask_and_is_causal_together_both_apply():
    """As torch's fused kernels do (its math path refuses the pair): a bias and the
    causal mask at once, as documented."""
    q, k, v = (torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    bias = torch.randn(5, 5, generator=torch.Generator().manual_seed(3))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(
        sdpa(q, k, v, attn_mask=bias, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, -torch.inf)))


@pytest.mark.parametrize("blocked", [None, -torch.inf, torch.finfo(torch.float32).min],
                         ids=["bool", "-inf", "finfo.min"])
def test_an_attn_mask_that_is_causal_beside_is_causal_runs_the_causal_form(blocked):
    """With is_causal both masks apply: a prefix-LM mask (the first keys open to every
    query) beside is_causal is causal, as softmax and torch read it; an approximate
    method refused it, read alone. Blocked additive entries are read as resolve_mask
    reads them (transformers fills finfo.min), a batch element without keys included.
    A mask that allows only what causal hides is the other convention's and keeps its
    sentence."""
    n = 7
    q, k, v = make_qkv(2, 2, n, 4)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    prefix = torch.stack([tril | (torch.arange(n) < 3), torch.zeros(n, n, dtype=torch.bool)])
    mask = prefix if blocked is None else torch.zeros(2, n, n).masked_fill(~prefix, blocked)
    mask = mask[:, None]  # [B, 1, N, N]: element 1 has no key
    keys = torch.tensor([[True] * n, [False] * n])
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, is_causal=True, method="linear"),
                               sdpa(q, k, v, is_causal=True, key_padding_mask=keys,
                                    method="linear"))
    with pytest.raises(ValueError, match="neither key padding nor causal"):
        sdpa(q, k, v, attn_mask=mask, method="linear")  # alone it is no causal mask
    swapped = ~tril if blocked is None else torch.zeros(n, n).masked_fill(tril, blocked)
    with pytest.raises(ValueError, match=r"complement of a causal mask|blocked half swapped"):
        sdpa(q, k, v, attn_mask=swapped, is_causal=True, method="linear")


@pytest.mark.parametrize("method", APPROXIMATE)
def test_padding_attn_mask_equals_key_padding_mask(method):
    """An approximate method reads a key-padding attn_mask (bool or additive) as its
    key_padding_mask."""
    q, k, v = make_qkv(2, 2, 24, 8)
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, 17:] = False
    key = random_key(0)
    opts = {"max_seq_len": 32} if method == "linformer" else {}
    if lacks(method, "mask", lambda: sdpa(q, k, v, valid[:, None, None, :], method=method)):
        return
    expected = sdpa(q, k, v, method=method, key_padding_mask=valid, generator=key, **opts)
    additive = torch.zeros(2, 1, 1, 24, dtype=q.dtype).masked_fill(~valid[:, None, None], -1e9)
    for mask in (valid[:, None, None, :], additive):
        out = sdpa(q, k, v, mask, method=method, generator=key, **opts)
        real = valid[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[real], expected[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["softmax", "kernelized"])
def test_exact_methods_ignore_what_padding_holds_given_it_beside_an_attn_mask(method):
    """docs/reliability.md: an attn_mask goes to SDPA as it is, so padding that may hold
    NaN or inf is given as key_padding_mask beside it; real rows and their gradients
    are then those of finite padding, and the padded inputs get zero gradients."""
    q, k, v = make_qkv(2, 2, 12, 8)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, 9:] = False
    valid[1, :2] = False
    window = torch.ones(12, 12, dtype=torch.bool).tril()
    pad = ~valid[:, None, :, None].expand(-1, 2, -1, 8)
    junk = [t.masked_fill(pad, bad) for t, bad in zip((q, k, v), (float("nan"), float("inf"),
                                                               float("-inf")), strict=True)]
    results = []
    for inputs in ((q, k, v), junk):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = sdpa(*leaves, window, method=method, key_padding_mask=valid)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    for clean, dirty in zip(*results, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, atol=1e-12, rtol=0)
    assert all(torch.all(g[pad] == 0) for g in results[1][1:])


@pytest.mark.parametrize("method", ["softmax", "skyformer[num_features=4]"])
def test_a_key_padding_mask_without_a_real_token_gets_the_conventions_warning(method):
    """skyformer.attention and the layers warned where torch's convention (True =
    padding) made every key padding; this entry gave rows of 0 without a word. An
    attn_mask read as padding is SDPA's own convention, and is not warned of."""
    q = torch.randn(2, 2, 6, 8)
    nothing_real = torch.zeros(2, 6, dtype=torch.bool)
    name = method.partition("[")[0]
    with pytest.warns(UserWarning, match=rf"^{name}.*: key_padding_mask is False everywhere, "
                                         r"so every key is padding") as caught:
        out = sdpa(q, q, q, key_padding_mask=nothing_real, method=method)
    assert len(caught) == 1 and caught[0].filename == __file__
    assert (out == 0).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sdpa(q, q, q, attn_mask=nothing_real[:, None, None, :], method=method)


def test_approximate_method_refuses_a_general_mask_with_a_sentence():
    q, k, v = make_qkv(1, 1, 8, 4)
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    mask[:, 0] = True
    with pytest.raises(ValueError, match="methods without attn_mask \\(the approximate ones\\) "
                                         "take only a key padding mask and, those with a "
                                         "causal form, causal masking; skyformer is one of "
                                         "those: use method='softmax' or "
                                         "'kernelized'"):
        sdpa(q, k, v, mask, method="skyformer")


def test_causal_and_scale_refusals_name_the_method():
    q, k, v = make_qkv(1, 1, 8, 4)
    with pytest.raises(CapabilityError, match="nystromformer cannot do causal"):
        sdpa(q, k, v, is_causal=True, method="nystromformer")
    torch.testing.assert_close(  # a causal approximation takes is_causal
        sdpa(q, k, v, is_causal=True, method="skyformer", generator=torch.Generator()),
        skyformer.attention(q, k, v, "skyformer", causal=True, generator=torch.Generator()))
    with pytest.raises(CapabilityError, match=r"linear cannot use scale=0\.3: it has no logit "
                       r"scale option.*1/sqrt\(E\) = 0\.5, which change nothing.*"
                       r"methods with a scale option: softmax, kernelized, skyformer"):
        sdpa(q, k, v, scale=0.3, method="linear")
    # SDPA's default 1/sqrt(E) names no scale of its own: accepted, and nothing changes
    torch.testing.assert_close(sdpa(q, k, v, scale=4**-0.5, method="linear"),
                               sdpa(q, k, v, method="linear"))


@pytest.mark.parametrize("method", ["skyformer", "kernelized", "performer"])
def test_scale_is_the_methods_scale_option(method):
    q, k, v = make_qkv(1, 2, 12, 8)
    key = random_key(3)
    torch.testing.assert_close(
        sdpa(q, k, v, scale=0.2, method=method, generator=key),
        skyformer.attention(q, k, v, method, scale=0.2, generator=key))


@pytest.mark.parametrize("method", ["softmax", "skyformer", "linear"])
def test_gqa_shares_each_kv_head_with_a_group_of_query_heads(method):
    q, _, _ = make_qkv(2, 6, 10, 8)
    _, k, v = make_qkv(2, 2, 10, 8, seed=1)
    key = random_key(0)
    out = sdpa(q, k, v, enable_gqa=True, method=method, generator=key)
    repeated = sdpa(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), method=method,
                    generator=key)
    torch.testing.assert_close(out, repeated)
    if method == "softmax":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v,
                                                                       enable_gqa=True))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        sdpa(q, k, v, method=method)


def test_unbatched_inputs_as_sdpa():
    q, k, v = make_qkv(1, 3, 10, 8)
    torch.testing.assert_close(sdpa(q[0], k[0], v[0], is_causal=True),
                               F.scaled_dot_product_attention(q[0], k[0], v[0],
                                                              is_causal=True))


def test_dropout_on_weights_for_softmax_matches_its_expectation():
    q, k, v = make_qkv(1, 1, 6, 4)
    torch.manual_seed(0)
    draws = torch.stack([sdpa(q, k, v, dropout_p=0.5) for _ in range(4000)])
    assert not torch.equal(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0), sdpa(q, k, v), atol=0.1, rtol=0)


def test_dropout_on_the_output_for_methods_without_weights():
    q, k, v = make_qkv(1, 2, 64, 8, dtype=torch.float32)
    key = random_key(0)
    clean = sdpa(q, k, v, method="skyformer", generator=key)
    torch.manual_seed(0)
    out = sdpa(q, k, v, dropout_p=0.25, method="skyformer", generator=key)
    kept = out != 0
    assert 0.65 < kept.float().mean() < 0.85
    torch.testing.assert_close(out[kept], clean[kept] / 0.75)


@pytest.mark.parametrize("method", ["softmax", "skyformer", "performer", "linformer"])
def test_varlen_equals_each_sequence_alone(method):
    lengths = [5, 9, 3]
    q, k, v = make_qkv(1, 2, sum(lengths), 8)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    opts = {"max_seq_len": 16} if method == "linformer" else {}
    key = random_key(2)
    packed = sdpa(q, k, v, method=method, cu_seqlens=cu, generator=key, **opts)
    assert packed.shape == q.shape
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = sdpa(*(t[:, :, start:end] for t in (q, k, v)), method=method, generator=key,
                     **opts)
        if skyformer.get_method(method).capabilities.randomized:
            # random draws are indexed by (sequence, rank): the b-th sequence of a batch
            # is not the first of a batch of one, so compare with the padded batch instead
            valid = torch.zeros(3, 9, dtype=torch.bool)
            for i, n in enumerate(lengths):
                valid[i, :n] = True
            padded = torch.zeros(3, 2, 9, 8, dtype=q.dtype)
            tensors = []
            for t in (q, k, v):
                p = padded.clone()
                for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(),
                                               strict=True)):
                    p[i, :, : e - s] = t[0, :, s:e]
                tensors.append(p)
            alone = sdpa(*tensors, method=method, key_padding_mask=valid, generator=key,
                         **opts)[b : b + 1, :, : end - start]
        torch.testing.assert_close(packed[:, :, start:end], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method, options", [(m, {}) for m in list_methods()]
                         + [("scatterbrain", {"support": "lsh"})])
def test_varlen_equals_the_padded_batch_with_its_key_mask(method, options):
    """Packed self-attention is the padded batch with the keys' padding shared by the
    queries: the LSH blocks (KDEformer, Scatterbrain) and the causal chunks read one mask
    for both, not two equal masks (which they take for cross-attention)."""
    lengths = [70, 45, 10]
    cu = torch.tensor([0, 70, 115, 125])
    q, k, v = make_qkv(1, 2, sum(lengths), 8)
    opts = {"max_seq_len": 128} if method == "linformer" else options
    key = random_key(3)
    if lacks(method, "varlen", lambda: sdpa(q, k, v, method=method, cu_seqlens=cu)):
        return
    packed = sdpa(q, k, v, method=method, cu_seqlens=cu, generator=key, **opts)
    valid = torch.zeros(3, 70, dtype=torch.bool)
    padded = [torch.zeros(3, 2, 70, 8, dtype=q.dtype) for _ in range(3)]
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        valid[i, : end - start] = True
        for p, t in zip(padded, (q, k, v), strict=True):
            p[i, :, : end - start] = t[0, :, start:end]
    batch = sdpa(*padded, method=method, key_padding_mask=valid, generator=key, **opts)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        torch.testing.assert_close(packed[:, :, start:end], batch[i : i + 1, :, : end - start],
                                   atol=ATOL, rtol=0)


def test_varlen_causal_softmax_equals_each_sequence_alone():
    q, k, v = make_qkv(1, 2, 12, 8)
    cu = torch.tensor([0, 4, 12])
    packed = sdpa(q, k, v, is_causal=True, cu_seqlens=cu, max_seqlen=8)
    for s, e in ((0, 4), (4, 12)):
        torch.testing.assert_close(
            packed[:, :, s:e],
            F.scaled_dot_product_attention(*(t[:, :, s:e] for t in (q, k, v)), is_causal=True))


def test_varlen_errors_name_the_fix():
    q, k, v = make_qkv(1, 2, 12, 8)
    with pytest.raises(ValueError, match="rise from 0 to the packed length 12"):
        sdpa(q, k, v, cu_seqlens=torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match="batch size 1"):
        sdpa(*make_qkv(2, 2, 12, 8), cu_seqlens=torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="pass no attn_mask"):
        sdpa(q, k, v, torch.ones(12, 12, dtype=torch.bool), cu_seqlens=torch.tensor([0, 12]))


def test_layout_error_names_the_layout_and_the_call_that_fits():
    q, k, v = make_qkv(1, 2, 12, 8)
    with pytest.raises(ValueError, match=r"\[B, H, L, E\].*got \(12, 8\); for one head "
                       r"pass query\[None\]"):
        sdpa(q[0, 0], k, v)
    q5, k5, v5 = (t.unflatten(0, (1, 1)) for t in (q, k, v))  # [1, 1, 2, 12, 8]
    with pytest.raises(ValueError, match=r"query\.flatten\(0, -4\).*"
                       r"out\.unflatten\(0, \(1, 1\)\)"):
        sdpa(q5, k5, v5, method="skyformer")
    # the calls the sentences name give SDPA's result
    torch.testing.assert_close(sdpa(q5.flatten(0, -4), k5.flatten(0, -4), v5.flatten(0, -4)
                                    ).unflatten(0, (1, 1)), F.scaled_dot_product_attention(
                                        q5, k5, v5))


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer", "linear"])
@pytest.mark.parametrize("sizes", [(0, 2, 5, 5, 8), (2, 0, 5, 5, 8), (2, 2, 0, 5, 8),
                                   (2, 2, 5, 0, 8), (2, 2, 5, 5, 0)],
                         ids=["batch", "heads", "queries", "keys", "values"])
def test_a_size_of_zero_gives_sdpas_result_and_zero_gradients(method, sizes):
    """Sizes of 0 were refused ("skip the call"), where torch's SDPA returns an empty
    output, or zeros where there are no keys."""
    b, h, lq, lk, dv = sizes
    q, k = torch.randn(b, h, lq, 4), torch.randn(b, h, lk, 4)
    v = torch.randn(b, h, lk, dv)
    mask = torch.ones(b, lk, dtype=torch.bool)
    for t in (q, k, v):
        t.requires_grad_()
    out = sdpa(q, k, v, method=method, key_padding_mask=mask, query_padding_mask=None)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == expected.shape and torch.equal(out, expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v), strict=True))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):  # still checked
        sdpa(q, k, v, method=method, key_padding_mask=torch.ones(b, lk + 1, dtype=torch.bool))


def test_a_head_dim_of_zero_is_refused_where_sdpa_averages_the_values():
    q, k, v = torch.randn(1, 1, 3, 0), torch.randn(1, 1, 4, 0), torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"empty input.*; D is 0, and every dimension"):
        sdpa(q, k, v, method="skyformer")


@pytest.mark.parametrize("shapes", [((3, 4, 6), (1, 3, 5, 6), (1, 3, 5, 6)),
                                    ((3, 4, 6), (2, 3, 5, 6), (2, 3, 5, 6)),
                                    ((2, 3, 4, 6), (3, 5, 6), (3, 5, 6)),
                                    ((1, 3, 4, 6), (2, 3, 5, 6), (2, 3, 5, 6)),
                                    ((2, 3, 4, 6), (1, 3, 5, 6), (2, 3, 5, 6))],
                         ids=["unbatched-q", "unbatched-q-batch-2", "unbatched-kv",
                              "query-batch-1", "key-batch-1"])
def test_batches_of_one_and_unbatched_tensors_broadcast_as_sdpa(shapes):
    """An unbatched query beside batched keys lost the keys' batch (a [3, 4, 6] answer
    where torch gives [1, 3, 4, 6]); a query of batch 1 against keys of batch 2, or
    unbatched keys beside a batched query, were refused: torch broadcasts them all."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    out = sdpa(q, k, v, scale=torch.tensor(0.3, dtype=torch.float64))  # 0-dim, as torch
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["softmax", "skyformer", "performer"])
def test_keys_and_values_of_a_batch_of_one_are_broadcast_as_sdpa_does(method):
    """Keys and values of batch 1 against queries of batch 3: torch's SDPA broadcasts
    them; the library refused them. Now they are the expanded views, the keys' gradient
    summed over the batch."""
    q, k, v = make_qkv(3, 2, 12, 8, dtype=torch.float64)
    k, v = k[:1].requires_grad_(), v[:1].requires_grad_()
    out = sdpa(q, k, v, method=method, generator=torch.Generator().manual_seed(0))
    whole = [t.expand(3, -1, -1, -1).detach().clone().requires_grad_() for t in (k, v)]
    same = sdpa(q, *whole, method=method, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, same)
    grads = torch.autograd.grad(out.sum(), (k, v))
    expected = torch.autograd.grad(same.sum(), whole)
    for got, full in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, full.sum(0, keepdim=True))
    if method == "softmax":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_padding_mask_under_compile_and_the_sentence_for_other_masks():
    q, k, v = make_qkv(2, 2, 16, 8, dtype=torch.float32)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[0, 11:] = False
    key = random_key(1)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, m, g: sdpa(q, k, v, m, method="skyformer", generator=g),
                      fullgraph=True, backend="eager")
    torch.testing.assert_close(
        f(q, k, v, valid[:, None, None], key),
        sdpa(q, k, v, method="skyformer", key_padding_mask=valid, generator=key))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    with pytest.raises(Exception, match="cannot be read to check it is one: pass "
                                        "key_padding_mask and is_causal"):
        f(q, k, v, causal, key)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_unbatched_masks_broadcast_from_the_right_as_sdpa(dims):
    """[H, L, E] inputs take a mask [S], [L, S] or [H, L, S] as torch's SDPA does; an
    approximate method reads it too (and refuses one it cannot apply)."""
    q, k, v = make_qkv(1, 2, 5, 4, nk=6)
    q, k, v = q[0], k[0], v[0]
    pattern = torch.ones(2, 5, 6, dtype=torch.bool).tril()
    mask = pattern if dims == 3 else pattern[0] if dims == 2 else pattern[0, -1]
    torch.testing.assert_close(sdpa(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    per_sample = torch.func.vmap(lambda a, b, c: sdpa(a, b, c, mask))
    batched = torch.stack([q, 2 * q]), torch.stack([k, k]), torch.stack([v, -v])
    torch.testing.assert_close(per_sample(*batched), F.scaled_dot_product_attention(
        *batched, attn_mask=mask.expand(2, 5, 6)))
    if dims == 1:  # key padding: read by the approximate methods as in a batched call
        padding = torch.tensor([True, True, True, False, True, False])
        got = sdpa(q, k, v, padding, method="nystromformer", num_features=6)
        want = sdpa(q[None], k[None], v[None], method="nystromformer", num_features=6,
                    key_padding_mask=padding[None])[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    else:
        with pytest.raises(ValueError, match="neither key padding nor causal"):
            sdpa(q, k, v, mask, method="performer")


def test_unbatched_packed_sequences_keep_apart():
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    want = torch.cat([F.scaled_dot_product_attention(q[0, :, s:e], k[0, :, s:e], v[0, :, s:e])
                      for s, e in ((0, 3), (3, 8))], dim=1)
    torch.testing.assert_close(sdpa(q[0], k[0], v[0], cu_seqlens=cu), want)
    torch.testing.assert_close(sdpa(q[0], k[0], v[0], cu_seqlens=cu, max_seqlen=5), want)


def test_flash_attentions_packed_layout_is_named_with_the_transpose_that_fits():
    """FlashAttention's varlen layout [T, H, E] was read as [H, T, E]: the sentence named
    the head count as the packed length and the lengths as what was wrong."""
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    flash = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T, H, E]
    with pytest.raises(ValueError, match=r"packed length 2, got \[0, 3, 8\]\. The packed "
                       r"tokens lie along dim -2 .*FlashAttention's packed \[T, H, E\] "
                       r"\(here T = 8, H = 2\), pass q\.transpose\(0, 1\)"):
        sdpa(*flash, cu_seqlens=cu)
    with pytest.raises(ValueError) as wrong_lengths:  # [1, H, T, E] with H = 8, T = 20
        sdpa(*make_qkv(1, 8, 20, 4), cu_seqlens=cu)
    assert "FlashAttention" not in str(wrong_lengths.value)  # the lengths are what is wrong
    torch.testing.assert_close(sdpa(*(t.transpose(0, 1) for t in flash), cu_seqlens=cu),
                               sdpa(q[0], k[0], v[0], cu_seqlens=cu))


def test_packed_inputs_on_two_devices_are_named_before_the_lengths():
    """A value on another device was reported as cu_seqlens on the wrong one, with a fix
    (cu_seqlens.to(q.device)) that changed nothing."""
    q, k, v = make_qkv(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"query, key and value must be on one device, got "
                       r"cpu, cpu, meta"):
        sdpa(q, k, v.to("meta"), cu_seqlens=torch.tensor([0, 3, 8]))


def test_strided_cumulative_lengths_raise_no_warning_from_the_library():
    q, k, v = make_qkv(1, 2, 8, 4)
    strided = torch.tensor([0, 9, 3, 9, 8, 9])[::2]  # [0, 3, 8], a view of stride 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sdpa(q, k, v, cu_seqlens=strided)
    torch.testing.assert_close(out, sdpa(q, k, v, cu_seqlens=strided.contiguous()))


def test_an_attn_mask_pads_queries_in_self_attention_unless_told_otherwise():
    """With L == S a key hidden from every query pads its position's query too (the
    convention of key_padding_mask, "auto"); query_padding_mask=None keeps every query
    real, as SDPA does (cross-attention of equal lengths)."""
    q, k, v = make_qkv(2, 2, 8, 4)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 5:] = False
    mask = valid[:, None, None, :]
    padded = sdpa(q, k, v, mask, method="nystromformer", num_features=8)
    assert padded[0, :, 5:].eq(0).all()
    real = sdpa(q, k, v, mask, method="nystromformer", num_features=8,
                query_padding_mask=None)  # all landmarks at this size: SDPA's numbers
    torch.testing.assert_close(real, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    torch.testing.assert_close(padded[0, :, :5], real[0, :, :5])


@pytest.mark.parametrize("name", ["is_causal", "enable_gqa"])
@pytest.mark.parametrize("flag", [1, None, "yes", torch.tensor(True)])
def test_flags_other_than_a_bool_are_refused_as_torch_does(name, flag):
    # "yes" or a tensor would switch the flag on by truthiness, None off (enable_gqa=1
    # was taken, which torch refuses as it refuses is_causal=1)
    q, k, v = make_qkv(1, 2, 10, 4)
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got"):
        sdpa(q, k, v, **{name: flag})


def test_argument_errors_name_what_is_wrong():
    q, k, v = make_qkv(1, 2, 10, 4)
    cu = torch.tensor([0, 3, 8, 10])
    for short in (3, 4):  # one short: the last token would overwrite the next sequence's
        with pytest.raises(ValueError,
                           match=rf"max_seqlen is {short} but .* a sequence of 5 tokens"):
            sdpa(q, k, v, cu_seqlens=cu, max_seqlen=short)
    with pytest.raises(ValueError, match="max_seqlen_k is 2"):
        sdpa(q, k, v, cu_seqlens=cu, cu_seqlens_k=cu, max_seqlen=5, max_seqlen_k=2)
    with pytest.raises(ValueError, match="one entry per entry of cu_seqlens"):
        sdpa(q, k, v, cu_seqlens=cu, cu_seqlens_k=torch.tensor([0, 10]))
    # causal packed sequences of other key lengths: refused whatever the longest lengths
    # (padded to (5, 5) here, which the unpacked call would have taken top-left aligned)
    with pytest.raises(ValueError, match=r"Nq=2, Nk=5 in sequence 0"):
        sdpa(q[:, :, :7], k[:, :, :7], v[:, :, :7], cu_seqlens=torch.tensor([0, 2, 7]),
             cu_seqlens_k=torch.tensor([0, 5, 7]), is_causal=True)
    sdpa(q, k, v, cu_seqlens=cu, cu_seqlens_k=cu.clone(), is_causal=True)
    with pytest.raises(ValueError, match=r"cu_seqlens must be an int32 or int64 tensor \[B \+ 1\]"):
        sdpa(q, k, v, cu_seqlens=torch.tensor(10), cu_seqlens_k=torch.tensor(10),
             is_causal=True)
    # compiled, the lengths are not read (max_seqlen given): the check stays eager-only
    torch._dynamo.reset()
    packed = torch.compile(lambda q, k, v, cu, cu_k: sdpa(
        q, k, v, cu_seqlens=cu, cu_seqlens_k=cu_k, max_seqlen=5, max_seqlen_k=5,
        is_causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(packed(q, k, v, cu, cu.clone()),
                               sdpa(q, k, v, cu_seqlens=cu, is_causal=True))
    q3 = make_qkv(1, 3, 10, 4)[0]
    with pytest.raises(ValueError, match="multiple of them") as err:
        sdpa(q3, k, v, enable_gqa=True)
    assert "needs enable_gqa=True" not in str(err.value)
    with pytest.raises(ValueError, match="scaled_dot_product_attention takes torch's SDPA"):
        skyformer.attention(q, k, v, "softmax", attn_mask=torch.ones(10, 10, dtype=torch.bool))


def test_a_compiled_packed_call_keeps_max_seqlen_symbolic():
    """A training loop passes each packed batch's longest length: after one new value
    dynamo compiles max_seqlen as a symbol, and that graph takes the values after it.
    ``operator.index`` of the int fixed its value, so each value compiled again."""
    from torch._dynamo.utils import counters

    q, k, v = make_qkv(1, 2, 24, 4)
    torch._dynamo.reset()
    counters.clear()
    packed = torch.compile(lambda q, k, v, cu, longest: sdpa(
        q, k, v, cu_seqlens=cu, max_seqlen=longest, method="skyformer", num_features=4,
        generator=random_key(0)), fullgraph=True, backend="eager")
    for lengths in ((10, 8, 6), (12, 6, 6), (14, 5, 5), (9, 9, 6)):
        cu = torch.tensor((0, *lengths)).cumsum(0)
        torch.testing.assert_close(
            packed(q, k, v, cu, max(lengths)),
            sdpa(q, k, v, cu_seqlens=cu, method="skyformer", num_features=4,
                 generator=random_key(0)))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("method", ["nystromformer", "skyformer", "linear"])
def test_a_mask_row_of_a_query_called_real_is_followed_or_refused(method):
    """With query_padding_mask=None (or a tensor) the rows of real queries must follow
    the pattern read from attn_mask: a row whose own key is hidden from every query is
    not taken for padding and left unchecked (it would attend to keys its row hides)."""
    q, k, v = make_qkv(1, 1, 6, 4)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, 3] = False  # key 3 hidden from every query
    mask[3] = False
    mask[3, 0] = True  # query 3 sees key 0 only
    for rows in (None, torch.ones(1, 6, dtype=torch.bool)):
        with pytest.raises(ValueError, match="neither key padding nor causal"):
            sdpa(q, k, v, mask, method=method, query_padding_mask=rows)
    padding = mask.clone()
    padding[3] = padding[0]  # query 3 sees what the others see: key padding, row checked
    out = sdpa(q, k, v, padding, method=method, query_padding_mask=None)
    assert out[0, 0, 3].abs().sum() > 0  # a real query's row, not zeroed as padding
    hidden = sdpa(q, k, v, mask, method=method)  # "auto": query 3 is padding, row 0
    assert hidden[0, 0, 3].eq(0).all()


@pytest.mark.parametrize("method", ["softmax", "kernelized"])
@pytest.mark.parametrize("lq, lk", [(5, 9), (9, 5)])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_is_causal_with_other_lengths_aligns_top_left_as_sdpa(method, lq, lk, mask):
    """SDPA's is_causal with L != S: query i sees keys j <= i, beside any attn_mask."""
    q = make_qkv(2, 2, lq, 4)[0].requires_grad_()
    k, v = (t.requires_grad_() for t in make_qkv(2, 2, lk, 4, seed=1)[1:])
    g = torch.Generator().manual_seed(2)
    attn_mask = {"bool": torch.rand(2, 1, 1, lk, generator=g) > 0.3,
                 "float": torch.randn(lq, lk, generator=g, dtype=q.dtype), None: None}[mask]
    if mask == "bool":
        attn_mask[..., 0] = True
    tril = torch.ones(lq, lk, dtype=torch.bool).tril()
    explicit = tril if attn_mask is None else (
        attn_mask & tril if mask == "bool" else attn_mask.masked_fill(~tril, float("-inf")))
    out = sdpa(q, k, v, attn_mask, is_causal=True, method=method)
    want = sdpa(q, k, v, explicit, method=method)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    if method == "softmax":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(
            q, k, v, attn_mask, is_causal=True))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, expected in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_is_causal_with_other_lengths_names_the_methods_that_follow_sdpa():
    q, k, v = make_qkv(1, 2, 5, 4, nk=9)
    with pytest.raises(ValueError, match=r"skyformer: is_causal with 5 queries and 9 keys: SDPA "
                       r"aligns the causal mask top left .* \('softmax', 'kernelized'\)"):
        sdpa(q, k, v, is_causal=True, method="skyformer")
    with pytest.raises(ValueError, match=r"is_causal with 1 query and 9 keys: .* as many "
                       r"queries as keys \(new queries over cached keys, a decoding step: "
                       r"a decoding cache steps them, .*new_cache\(\)"):
        sdpa(q[:, :, -1:], k, v, is_causal=True, method="skyformer")
    with pytest.raises(CapabilityError, match="linformer"):
        sdpa(q, k, v, is_causal=True, method="linformer", max_seq_len=16)
    with pytest.raises(ValueError, match=r"pass attn_mask=torch.ones\(Nq, Nk, dtype=torch.bool\)"
                       r".tril\(\)"):
        skyformer.attention(q, k, v, "softmax", causal=True)


@pytest.mark.parametrize("given, message", [
    ({"max_seqlen": 5.0}, r"max_seqlen must be an int \(the longest sequence's length\) or "
                          r"None \(read from cu_seqlens\), got 5.0"),
    ({"max_seqlen": "5"}, r"max_seqlen must be an int .* got '5'"),
    ({"max_seqlen": True}, r"max_seqlen must be an int .* got True"),
    ({"max_seqlen_k": 1}, r"max_seqlen_k \(1\) without cu_seqlens_k: the keys are packed as "
                          r"the queries"),
    ({"max_seqlen": 5, "max_seqlen_k": 4}, r"max_seqlen_k \(4\) without cu_seqlens_k"),
    ({"cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int16)},
     r"cu_seqlens must be an int32 or int64 tensor \[B \+ 1\] .* got torch.int16 \(3,\)"),
    ({"cu_seqlens": torch.tensor([0, 3, 8], device="meta")},
     r"cu_seqlens is on meta but the inputs are on cpu; pass cu_seqlens.to\(q.device\)"),
])
def test_varlen_arguments_of_another_kind_are_named(given, message):
    """Lengths of the wrong type or device, and a key length that cannot apply, get a
    sentence (not torch's TypeError from inside the unpacking, nor silence)."""
    q, k, v = make_qkv(1, 2, 8, 4)
    arguments = {"cu_seqlens": torch.tensor([0, 3, 8]), **given}
    with pytest.raises(ValueError, match=message):
        sdpa(q, k, v, method="softmax", **arguments)


def test_varlen_takes_max_seqlen_k_equal_to_max_seqlen_without_cu_seqlens_k():
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8])
    torch.testing.assert_close(sdpa(q, k, v, cu_seqlens=cu, max_seqlen=5, max_seqlen_k=5),
                               sdpa(q, k, v, cu_seqlens=cu))


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer"])
@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_a_dropout_p_outside_0_1_is_named(method, p):
    """As SDPA's dropout_p: a number in [0, 1]; not silently run (a negative p in float64,
    True read as 1.0), nor left to torch's messages about flash kernels."""
    q, k, v = make_qkv(1, 2, 6, 4)
    with pytest.raises(ValueError, match=rf"{method}: dropout_p must be a number in \[0, 1\], "
                                         r"got"):
        sdpa(q, k, v, dropout_p=p, method=method, generator=random_key(0))


def test_softmax_attention_names_a_bad_dropout_p():
    q, k, v = make_qkv(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"softmax: dropout_p must be a number in \[0, 1\]"):
        skyformer.softmax_attention(q, k, v, dropout_p=-0.5)


def test_a_float_mask_under_a_transform_is_refused_not_read_as_padding():
    """Under torch.func (and torch.compile) a float mask's values cannot be read: a bias
    there would be left out, so it is refused; a bool key padding mask runs as eagerly."""
    q, k, v = make_qkv(2, 2, 16, 4)
    key = random_key(0)
    per_sample = torch.func.vmap(
        lambda a, b, c, m: sdpa(a, b, c, m, method="skyformer", generator=key))
    bias = torch.zeros(2, 1, 1, 16, dtype=q.dtype)
    bias[..., :8] = -3.0  # a mask of each sample: its values are the transform's
    with pytest.raises(CapabilityError, match="cannot be read to check that it holds no bias"):
        per_sample(q, k, v, bias)
    padding = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    padding[1, ..., 12:] = False
    want = torch.stack([sdpa(q[i], k[i], v[i], padding[i], method="skyformer", generator=key)
                        for i in range(2)])
    torch.testing.assert_close(per_sample(q, k, v, padding), want, atol=ATOL, rtol=0)


def test_a_constant_mask_under_grad_over_the_queries_is_read_as_in_eager_code():
    """torch.func.grad over the queries with a float padding mask the transform does not
    act on: the mask was refused as unreadable (the transform wrapped the view made of
    it); its values are the caller's, so it runs and gives autograd's gradient."""
    q, k, v = make_qkv(2, 2, 12, 4)
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, 9:] = False
    bias = torch.zeros(2, 1, 1, 12, dtype=q.dtype).masked_fill(~real[:, None, None], -torch.inf)

    def loss(queries):
        return sdpa(queries, k, v, bias, method="skyformer", num_features=4,
                    generator=random_key(0)).square().sum()

    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(loss)(q), leaf.grad, atol=ATOL, rtol=0)


def test_a_mask_hiding_padded_queries_names_query_padding_mask():
    """A mask whose only departure from key padding is queries that see no key (padded
    queries hidden by it) is refused with the argument that takes them, which then
    gives torch's zero rows."""
    q, k, v = make_qkv(2, 2, 40, 8)
    rows = torch.ones(2, 40, dtype=torch.bool)
    rows[0, 35:] = False
    with pytest.raises(ValueError, match=r"hides from every key look like padded "
                                         r"queries: pass them as query_padding_mask"):
        sdpa(q, k, v, rows[:, None, :, None], method="skyformer", num_features=8)
    out = sdpa(q, k, v, rows[:, None, :, None], method="skyformer", num_features=8,
               query_padding_mask=rows)
    assert not out[0, :, 35:].any()


@pytest.mark.parametrize("method", ["skyformer", "performer", "linear"])
def test_a_float_mask_that_requires_grad_is_refused_not_left_without_a_gradient(method):
    """An approximate method reads only which keys a float mask hides: a mask that
    requires grad (a learned bias) would get no gradient, in silence. Refused; the
    detached mask, or the call under no_grad, runs as the padding it holds."""
    q, k, v = make_qkv(2, 2, 16, 4)
    key = random_key(0)
    bias = torch.zeros(2, 1, 1, 16, dtype=q.dtype)
    bias[1, ..., 12:] = float("-inf")
    bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires grad.*no gradient.*detach\(\)") as err:
        sdpa(q, k, v, bias, method=method, generator=key)
    assert "attention_mask" not in str(err.value)  # transformers' name; SDPA's is attn_mask
    want = sdpa(q, k, v, bias.detach(), method=method, generator=key)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(q, k, v, bias, method=method, generator=key), want)


def test_varlen_refuses_padding_masks_rather_than_leaving_them_out():
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8])
    hide = torch.ones(1, 8, dtype=torch.bool)
    hide[0, 1] = False
    for name in ("key_padding_mask", "query_padding_mask"):
        with pytest.raises(ValueError, match=f"with cu_seqlens, pass no {name}"):
            sdpa(q, k, v, cu_seqlens=cu, **{name: hide})
    with pytest.raises(ValueError, match="pass no query_padding_mask"):
        sdpa(q, k, v, cu_seqlens=cu, query_padding_mask=None)
    sdpa(q, k, v, cu_seqlens=cu, query_padding_mask="auto")  # the default is no mask


@pytest.mark.parametrize("given", [{"cu_seqlens_k": torch.tensor([0, 3, 8])},
                                   {"max_seqlen": 5}, {"max_seqlen_k": 5}])
def test_packed_arguments_without_cu_seqlens_are_refused(given):
    q, k, v = make_qkv(1, 2, 8, 4)
    name = next(iter(given))
    with pytest.raises(ValueError, match=f"{name} belongs to packed sequences and needs "
                                         "cu_seqlens"):
        sdpa(q, k, v, **given)


def test_varlen_errors_name_the_argument_at_fault():
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match=r"cu_seqlens_k must rise from 0 to the packed "
                                         r"length 8, got \[0, 2, 6\]"):
        sdpa(q, k, v, cu_seqlens=cu, cu_seqlens_k=torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match="same packed tokens, got T = 8 keys and 7 values"):
        sdpa(q, k, v[:, :, :7], cu_seqlens=cu)


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer"])
def test_the_call_scale_wins_over_a_scale_in_the_name_also_at_the_default(method):
    q, k, v = make_qkv(1, 2, 12, 4)
    key = random_key(0)
    for scale in (0.5, 0.7):  # 0.5 = 1/sqrt(E)
        torch.testing.assert_close(
            sdpa(q, k, v, scale=scale, method=f"{method}[scale=0.3]", generator=key),
            skyformer.attention(q, k, v, method, scale=scale, generator=key))


def test_nested_tensors_are_refused_with_the_packed_form():
    rows = [torch.randn(2, n, 4) for n in (3, 5)]
    nested = torch.nested.nested_tensor([r.transpose(0, 1) for r in rows],
                                        layout=torch.jagged).transpose(1, 2)  # [B, H, j, E]
    for method in ("softmax", "kernelized"):
        with pytest.raises(ValueError, match=r"nested tensors are not taken; pack the "
                                             r"sequences .* cu_seqlens"):
            sdpa(nested, nested, nested, method=method)


@pytest.mark.parametrize("mask", [[[True] * 12] * 12, 1.0])
def test_an_attn_mask_that_is_no_tensor_is_named_by_type(mask):
    q, k, v = make_qkv(1, 2, 12, 8)
    with pytest.raises(TypeError, match=f"attn_mask must be a torch.Tensor .* got "
                                        f"{type(mask).__name__}"):
        sdpa(q, k, v, mask)


def test_a_method_passed_in_attn_mask_s_place_names_the_keyword():
    q, k, v = make_qkv(1, 2, 12, 8)
    with pytest.raises(TypeError, match=r"takes the method by keyword: method='skyformer'; "
                                        r"its fourth positional argument is attn_mask"):
        sdpa(q, k, v, "skyformer")


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_an_attn_mask_on_another_device_is_named(method, is_causal):
    """A mask left on the CPU beside GPU inputs (here: on meta beside CPU ones) gets the
    sentence key_padding_mask and cu_seqlens get, not torch's error from inside the
    method (an approximate method named key_padding_mask, which the caller never passed)."""
    q, k, v = make_qkv(1, 2, 6, 4, nk=6 if method == "skyformer" else 9)
    mask = torch.ones(6, k.shape[2], dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"attn_mask is on meta but the inputs are on cpu; "
                                         r"pass attn_mask.to\(query.device\)"):
        sdpa(q, k, v, mask, is_causal=is_causal, method=method, generator=random_key(0))

def test_a_float_key_padding_mask_gets_the_conversion_of_its_convention():
    q, k, v = make_qkv(1, 2, 6, 4)
    additive = torch.zeros(1, 6)
    additive[0, 4:] = float("-inf")  # torch.nn.MultiheadAttention's: -inf = padding
    with pytest.raises(TypeError, match=r"additive float mask .* converts with mask == 0"):
        sdpa(q, k, v, method="skyformer", key_padding_mask=additive)
    want = sdpa(q, k, v, method="softmax", key_padding_mask=additive == 0)
    torch.testing.assert_close(want[:, :, :4], F.scaled_dot_product_attention(
        q[:, :, :4], k[:, :, :4], v[:, :, :4]))
    with pytest.raises(TypeError, match=r"converts with mask == 1\.$"):  # 0/1, integers
        sdpa(q, k, v, key_padding_mask=torch.ones(1, 6, dtype=torch.long))


@pytest.mark.parametrize("padded", [False, True])
def test_a_wrong_key_padding_mask_beside_a_padding_attn_mask_gets_its_sentence(padded):
    """An attn_mask's key padding joins key_padding_mask only where that is a bool
    [B, S] tensor; any other goes to the method as given, whose check names it (joined,
    a float one failed inside ``&``, a [B, S - 1] one with torch's size error, and a
    [1, S] one was broadcast over the batch)."""
    q, k, v = make_qkv(2, 2, 8, 4)
    attn_mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    if padded:
        attn_mask[0, ..., -2:] = False
    for wrong, error, sentence in (
            (torch.ones(2, 8), TypeError, r"key_padding_mask must be a bool tensor"),
            (torch.ones(2, 7, dtype=torch.bool), ValueError, r"must have shape \[B, Nk\]"),
            (torch.ones(1, 8, dtype=torch.bool), ValueError, r"must have shape \[B, Nk\]")):
        with pytest.raises(error, match=sentence):
            sdpa(q, k, v, attn_mask, method="skyformer", key_padding_mask=wrong,
                 num_features=4, generator=random_key(0))


def test_numpy_scalars_are_numbers_as_for_sdpa():
    """A NumPy float32 scale or dropout_p (what a config read with NumPy holds) is a
    number, as torch's SDPA takes it; the refusal said it was not a finite number."""
    np = pytest.importorskip("numpy")
    q, k, v = make_qkv(1, 2, 8, 4)
    torch.testing.assert_close(sdpa(q, k, v, scale=np.float32(0.25)), sdpa(q, k, v, scale=0.25))
    torch.manual_seed(0)
    dropped = sdpa(q, k, v, dropout_p=np.float32(0.5))
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, sdpa(q, k, v, dropout_p=0.5))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        sdpa(q, k, v, scale=np.float32("inf"))


def test_an_integer_mask_with_is_causal_is_refused_as_without_it():
    """SDPA takes bool and float masks: an int mask beside is_causal (L != S) was made
    a float bias by the causal mask's torch.where (1 added to the allowed logits)."""
    q, k, v = make_qkv(1, 1, 5, 8, nk=9)
    ints = torch.ones(5, 9, dtype=torch.uint8)
    for causal in (False, True):
        with pytest.raises(TypeError, match="attn_mask"):
            sdpa(q, k, v, ints, is_causal=causal, method="softmax")


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer"])
def test_an_integer_mask_is_named_as_given(method):
    """A [L, S] mask of integers given to an approximate method was said to be a
    "4-D attention mask" (the shape the methods see), not the one passed."""
    q, k, v = make_qkv(1, 2, 6, 4)
    with pytest.raises(TypeError, match=r"^attn_mask must be boolean \(True = attend\) or "
                                        r"float .*got torch\.uint8; pass attn_mask\.bool\(\)"):
        sdpa(q, k, v, torch.ones(6, 6, dtype=torch.uint8), method=method)


@pytest.mark.parametrize("longest", [torch.tensor(5), torch.tensor(5, dtype=torch.int32), 5])
def test_max_seqlen_as_transformers_builds_it(longest):
    """transformers' packed path hands FlashAttention max_seqlen as a 0-d tensor
    (cu_seqlens.diff().max()); NumPy ints are ints too."""
    np = pytest.importorskip("numpy")
    q, k, v = make_qkv(1, 2, 8, 4)
    cu = torch.tensor([0, 3, 8])
    want = sdpa(q, k, v, cu_seqlens=cu)
    torch.testing.assert_close(sdpa(q, k, v, cu_seqlens=cu, max_seqlen=longest), want)
    torch.testing.assert_close(sdpa(q, k, v, cu_seqlens=cu, max_seqlen=np.int64(5)), want)


@pytest.mark.parametrize("method, options", [("kdeformer", {}),
                                             ("scatterbrain", {"support": "lsh"})])
def test_keys_packed_as_the_queries_are_self_attention(method, options):
    """cu_seqlens_k equal to cu_seqlens (the same tensor, as transformers passes it, or
    equal values, as FlashAttention's callers do) is packed self-attention: the LSH
    blocks took the two masks for cross-attention."""
    cu = torch.tensor([0, 70, 115, 125])
    q, k, v = make_qkv(1, 2, 125, 8)
    key = random_key(3)
    alone = sdpa(q, k, v, method=method, cu_seqlens=cu, generator=key, **options)
    for cu_k in (cu, cu.clone()):
        both = sdpa(q, k, v, method=method, cu_seqlens=cu, cu_seqlens_k=cu_k, generator=key,
                    **options)
        torch.testing.assert_close(both, alone, atol=0, rtol=0)
        one_width = sdpa(q, k, v, method=method, cu_seqlens=cu, cu_seqlens_k=cu_k,
                         max_seqlen_k=70, generator=key, **options)  # max_seqlen read
        torch.testing.assert_close(one_width, alone, atol=0, rtol=0)


@pytest.mark.parametrize("method, causal", [("performer", True), ("skyformer", True),
                                            ("bigbird", False)])
def test_keys_packed_as_the_queries_take_the_wider_of_two_bounds(method, causal):
    """max_seqlen_k other than max_seqlen, both bounds, with the keys packed as the
    queries: the two sides were padded to two widths, and the methods that need
    Nq == Nk refused although every packed pair is equal."""
    cu = torch.tensor([0, 4, 10])
    q, k, v = make_qkv(1, 2, 10, 8)
    key = random_key(2)
    both = sdpa(q, k, v, method=method, cu_seqlens=cu, cu_seqlens_k=cu.clone(), max_seqlen=6,
                max_seqlen_k=10, is_causal=causal, generator=key)
    wider = sdpa(q, k, v, method=method, cu_seqlens=cu, max_seqlen=10, is_causal=causal,
                 generator=key)
    torch.testing.assert_close(both, wider, atol=0, rtol=0)


def test_max_seqlen_of_empty_sequences_and_a_negative_one():
    cu = torch.tensor([0, 0, 0])
    q, k, v = make_qkv(1, 2, 0, 8)
    out = sdpa(q, k, v, cu_seqlens=cu, max_seqlen=0)  # what cu.diff().max() gives
    assert out.shape == (1, 2, 0, 8)
    with pytest.raises(ValueError, match=r"max_seqlen must be at least 0.*got -1"):
        sdpa(*make_qkv(1, 2, 4, 8), cu_seqlens=torch.tensor([0, 4]), max_seqlen=-1)


@pytest.mark.parametrize("method", ["linear", "softmax"])
def test_packed_sequences_without_keys_warn_of_no_mask(method):
    """Packed sequences with no key at all warned that a key_padding_mask (the one made
    from cu_seqlens, not the caller's) was False everywhere, in torch's convention."""
    q = make_qkv(1, 2, 6, 4)[0]
    empty = q[:, :, :0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sdpa(empty, empty, empty, cu_seqlens=torch.tensor([0, 0, 0]), method=method)
        assert out.shape == (1, 2, 0, 4)
        out = sdpa(q, empty, empty, cu_seqlens=torch.tensor([0, 2, 6]), method=method,
                   cu_seqlens_k=torch.tensor([0, 0, 0]))
        assert out.shape == (1, 2, 6, 4) and not out.any()
    with pytest.warns(UserWarning, match="key_padding_mask is False everywhere"):
        sdpa(q, q, q, method=method, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))


def test_a_compiled_packed_call_checks_the_lengths_on_the_device():
    """Traced, the lengths cannot be read on the host: a max_seqlen shorter than a
    sequence ran that sequence into the next one's slots, silently."""
    q = make_qkv(1, 2, 12, 4)[0]
    torch._dynamo.reset()
    packed = torch.compile(lambda q, cu, longest: sdpa(q, q, q, cu_seqlens=cu,
                                                       max_seqlen=longest),
                           fullgraph=True, backend="eager")
    cu = torch.tensor([0, 11, 12])
    torch.testing.assert_close(packed(q, cu, 11), sdpa(q, q, q, cu_seqlens=cu))
    with pytest.raises(RuntimeError, match="max_seqlen is shorter than a sequence of the "
                                           "cumulative lengths"):
        packed(q, cu, 8)
    with pytest.raises(RuntimeError, match="cu_seqlens must rise from 0 to the packed "
                                           "length T"):
        packed(q, torch.tensor([0, 13, 12]), 13)


def test_a_padded_query_row_does_not_make_keys_real():
    """With an explicit query_padding_mask, the rows of padded queries say nothing about
    which keys are real (a padded row left open was taken for a key pattern)."""
    q, k, v = make_qkv(1, 1, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[:, 3] = False
    mask[3] = True  # the padded query's row, left open
    rows = torch.tensor([[True, True, True, False]])
    out = sdpa(q, k, v, mask, method="skyformer", query_padding_mask=rows)
    want = sdpa(q, k, v, method="skyformer", key_padding_mask=rows, query_padding_mask=rows)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("method", ["bigbird", "reformer"])
def test_packed_cross_attention_of_other_lengths_is_refused_where_each_sequence_is(method):
    """A method that needs as many queries as keys refuses a packed sequence whose query
    and key lengths differ, as it refuses that sequence alone; it ran where the longest
    query and key lengths happened to be equal (both padded to one width)."""
    q, k, v = make_qkv(1, 2, 70, 8)
    cu_q, cu_k = torch.tensor([0, 20, 70]), torch.tensor([0, 50, 70])
    with pytest.raises(CapabilityError, match=r"cannot attend with a different number of "
                                              r"queries and keys.* sequence 0 has 20 "
                                              r"queries and 50 keys"):
        sdpa(q, k, v, method=method, cu_seqlens=cu_q, cu_seqlens_k=cu_k,
             generator=random_key(0))
    out = sdpa(q, k, v, method=method, cu_seqlens=cu_q, cu_seqlens_k=cu_q.clone(),
               generator=random_key(0))  # equal lengths: self-attention
    torch.testing.assert_close(out, sdpa(q, k, v, method=method, cu_seqlens=cu_q,
                                         generator=random_key(0)))


def test_keys_of_another_packed_length_without_cu_seqlens_k_ask_for_it():
    """Keys packed to another total than the queries, without cu_seqlens_k, were told
    that cu_seqlens (right for the queries) must rise to the keys' length."""
    q, k, v = make_qkv(1, 2, 8, 4, nk=6)
    with pytest.raises(ValueError, match=r"the keys hold 6 packed tokens and the queries 8.*"
                                         r"pass cu_seqlens_k"):
        sdpa(q, k, v, cu_seqlens=torch.tensor([0, 3, 8]))


@pytest.mark.parametrize("method", ["nystromformer", "skyformer"])
def test_the_refusal_of_a_mask_names_the_masks_the_method_takes(method):
    """A method without causal masking was said to take "key padding and causal masks"
    and told to pass is_causal, which it then refused: the refusals of an attn_mask
    (through a binding, and under a transform, where a mask's values cannot be read) now
    name the masks the method takes."""
    q, k, v = make_qkv(2, 2, 8, 4)
    causal = skyformer.get_method(method).capabilities.causal
    forms = "key padding and causal masks" if causal else "key padding masks"
    arguments = "key_padding_mask and is_causal" if causal else "key_padding_mask"
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    with pytest.raises(CapabilityError, match=rf"\({method} takes {forms} only"):
        skyformer.get_method(method).bind()(q, k, v, attn_mask=mask)
    per_sample = torch.func.vmap(
        lambda a, b, c, m: sdpa(a, b, c, m, method=method, generator=random_key(0)))
    for given in (mask.expand(2, 8, 8), torch.zeros(2, 1, 1, 8, dtype=q.dtype)):
        with pytest.raises(CapabilityError, match=rf"^{method} takes only {forms}, .* "
                                                  rf"{arguments}[,.]"):
            per_sample(q, k, v, given)
