"""transformers attention masks -> key_padding_mask and causal (skyformer.masks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    eager_mask,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from skyformer.masks import BLOCKED_LOGIT, UnsupportedMaskError, allowed_entries, resolve_mask

B, N = 3, 7


def padding() -> torch.Tensor:
    """Right padding, left padding and none: [B, N] bool, True = real."""
    m = torch.ones(B, N, dtype=torch.bool)
    m[0, 5:] = False
    m[1, :2] = False
    return m


def resolve(mask, nq=N, nk=N, causal=False):
    return resolve_mask(mask, batch=B, query_len=nq, key_len=nk, is_causal=causal)


def hf_mask(builder, mask_function, pad, **kwargs):
    """A 4-D mask built by transformers' own mask builders, as its models build them."""
    return builder(batch_size=B, q_length=N, kv_length=N, mask_function=mask_function,
                   attention_mask=pad, **kwargs)


def test_no_mask_follows_the_causal_flag():
    assert resolve(None).key_padding_mask is None and resolve(None).causal is False
    assert resolve(None, causal=True).causal is True
    assert resolve(None, nq=1, nk=N, causal=True).causal is False  # one query sees every key
    # one token alone: the causal form, as a longer prompt's first row and a decoding
    # state's first step compute it (hidden nothing either way)
    assert resolve(None, nq=1, nk=1, causal=True).causal is True
    assert resolve(None, nq=1, nk=1).causal is False
    with pytest.raises(UnsupportedMaskError, match="cached prefix"):
        resolve(None, nq=3, nk=N, causal=True)


@pytest.mark.parametrize("builder", [sdpa_mask, eager_mask], ids=["bool", "additive"])
def test_padding_masks_from_transformers(builder):
    pad = padding()
    mask = hf_mask(builder, bidirectional_mask_function, pad)
    assert mask.shape == (B, 1, N, N)
    got = resolve(mask)
    assert got.causal is False
    assert torch.equal(got.key_padding_mask, pad)


@pytest.mark.parametrize("builder", [sdpa_mask, eager_mask], ids=["bool", "additive"])
def test_causal_masks_with_left_and_right_padding(builder):
    pad = padding()
    kwargs = {"allow_is_causal_skip": False} if builder is sdpa_mask else {}
    mask = hf_mask(builder, causal_mask_function, pad, **kwargs)
    got = resolve(mask)
    assert got.causal is True
    assert torch.equal(got.key_padding_mask, pad)


def test_causal_mask_without_padding_is_causal_only():
    mask = hf_mask(sdpa_mask, causal_mask_function, torch.ones(B, N, dtype=torch.bool),
                   allow_is_causal_skip=False)
    got = resolve(mask)
    assert got.causal is True and got.key_padding_mask is None


def test_broadcast_forms_and_two_dimensional_masks():
    pad = padding()
    assert torch.equal(resolve(pad[:, None, None, :]).key_padding_mask, pad)  # [B, 1, 1, Nk]
    one = torch.ones(1, 1, 1, N, dtype=torch.bool)
    one[..., -1] = False
    assert torch.equal(resolve(one).key_padding_mask, one[0, 0, 0].expand(B, N))
    assert torch.equal(resolve(pad.long()).key_padding_mask, pad)  # [B, Nk], 1 = real
    assert resolve(torch.ones(B, 1, N, N, dtype=torch.bool)).key_padding_mask is None
    additive = torch.zeros(B, 1, 1, N).masked_fill(~pad[:, None, None, :], float("-inf"))
    assert torch.equal(resolve(additive).key_padding_mask, pad)
    legacy = (1.0 - pad.float())[:, None, None, :] * -10000.0  # old BERT extended mask
    assert torch.equal(resolve(legacy).key_padding_mask, pad)


def test_a_two_dimensional_additive_mask_is_refused_not_read_inverted():
    """[B, Nk] holds 1 for real tokens; an additive one (0 = real, -inf or a large
    negative = padding, as torch.nn.MultiheadAttention's float key_padding_mask) read
    as nonzero = real named the padding real and the real tokens padding."""
    pad = padding()
    for blocked in (float("-inf"), torch.finfo(torch.float32).min, -10000.0):
        additive = torch.zeros(B, N).masked_fill(~pad, blocked)
        with pytest.raises(UnsupportedMaskError, match=r"holds 1 for real tokens and 0 for "
                                                       r"padding.* \(mask == 0\)"):
            resolve(additive)
    assert torch.equal(resolve(pad.float()).key_padding_mask, pad)  # 1.0 / 0.0: as before


def test_identical_heads_accepted_differing_heads_refused():
    pad = padding()
    same = pad[:, None, None, :].expand(B, 4, N, N)
    assert torch.equal(resolve(same).key_padding_mask, pad)
    different = same.clone()
    different[0, 2, :, 0] = False
    with pytest.raises(UnsupportedMaskError, match="differs between heads"):
        resolve(different)


def test_fully_blocked_rows_of_padded_queries_are_accepted():
    pad = padding()
    mask = pad[:, None, None, :] & pad[:, None, :, None]  # padded query rows see nothing
    got = resolve(mask)
    assert torch.equal(got.key_padding_mask, pad) and got.causal is False


def test_causal_masks_whose_padded_query_rows_see_nothing_are_accepted():
    """Causal masks with padding whose padded queries' rows are blocked whole: causal
    with key padding, as the module docstring says (transformers' causal builders give
    tril & visible there, so no other test reached the unchecked rows of the causal
    branch)."""
    pad = padding()
    tril = torch.ones(N, N, dtype=torch.bool).tril()
    mask = tril & pad[:, None, None, :] & pad[:, None, :, None]
    got = resolve(mask)
    assert got.causal is True and torch.equal(got.key_padding_mask, pad)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_rows_opened_to_every_key_name_query_padding_mask(causal):
    """transformers before 5 opened padded query rows to every key under SDPA: such a
    row cannot be told from a real query's, so the mask is refused, and the sentence
    named no way out; it names query_padding_mask, with which the mask is accepted."""
    pad = padding()
    pattern = torch.ones(N, N, dtype=torch.bool)
    pattern = pattern.tril() if causal else pattern
    mask = (pattern & pad[:, None, None, :]) | ~pad[:, None, :, None]
    with pytest.raises(UnsupportedMaskError, match=r"The queries it opens to every key look "
                       r"like padded queries: pass them as query_padding_mask \[B, Nq\]"):
        resolve(mask, causal=causal)
    got = resolve_mask(mask, batch=B, query_len=N, key_len=N, is_causal=causal,
                       query_valid=pad)
    assert got.causal is causal and torch.equal(got.key_padding_mask, pad)
    with pytest.raises(UnsupportedMaskError, match=r"look like padded queries: pass the "
                                                   r"2-D mask\.$"):  # a caller's own way out
        resolve_mask(mask, batch=B, query_len=N, key_len=N, is_causal=causal,
                     name_padded_queries="pass the 2-D mask")
    window = hf_mask(sdpa_mask, sliding_window_causal_mask_function(3), padding(),
                     allow_is_causal_skip=False) | ~pad[:, None, :, None]
    with pytest.raises(UnsupportedMaskError) as refused:  # a window is not padding
        resolve(window, causal=True)
    assert "opens to every key" not in str(refused.value)


def test_bias_masks_are_refused():
    bias = torch.zeros(B, 1, N, N)
    bias[..., 0] = -0.5  # e.g. an ALiBi-like term
    with pytest.raises(UnsupportedMaskError, match="carries a bias"):
        resolve(bias)


def test_other_patterns_are_refused():
    window = hf_mask(sdpa_mask, sliding_window_causal_mask_function(3), padding(),
                     allow_is_causal_skip=False)
    with pytest.raises(UnsupportedMaskError, match="neither key padding nor causal"):
        resolve(window)
    packed = torch.zeros(B, 1, N, N, dtype=torch.bool)
    packed[..., :3, :3] = True
    packed[..., 3:, 3:] = True  # two sequences packed in one row
    with pytest.raises(UnsupportedMaskError, match="neither key padding nor causal"):
        resolve(packed)
    real_query_sees_nothing = torch.ones(B, 1, N, N, dtype=torch.bool)
    real_query_sees_nothing[0, 0, 2] = False
    with pytest.raises(UnsupportedMaskError, match="neither key padding"):
        resolve(real_query_sees_nothing)


def test_a_causal_mask_over_more_keys_names_the_cache():
    """A left-padded batch over a static cache's slots (or a cached prefix): causal with
    key padding, Nq < Nk. Without padding the sentence named the static cache; with it,
    only the generic patterns."""
    nk = N + 5
    pad = torch.ones(B, nk, dtype=torch.bool)
    pad[1, :2] = False
    rows = torch.ones(N, nk, dtype=torch.bool).tril(nk - N)  # query i sees keys <= i + 5
    with pytest.raises(UnsupportedMaskError, match=r"neither key padding.*with as many "
                       r"queries as keys \(here Nq=7 queries, Nk=12 keys: a cached prefix, "
                       r"or the slots of a static cache, cache_implementation='static'\)"):
        resolve(rows & pad[:, None, None, :], nk=nk, causal=True)
    with pytest.raises(UnsupportedMaskError, match=r"causal with key padding \(e\.g\. a "
                       r"sliding window.*causal masking; "):  # Nq == Nk: no such clause
        resolve(hf_mask(sdpa_mask, sliding_window_causal_mask_function(3), padding(),
                        allow_is_causal_skip=False))


def test_a_causal_mask_of_the_other_convention_is_named_so():
    """True above the diagonal (torch.nn.MultiheadAttention's causal mask, True = not
    allowed, where True = attend is read): the sentence says to pass ~mask."""
    above = torch.ones(N, N, dtype=torch.bool).triu(1).expand(B, 1, N, N)
    with pytest.raises(UnsupportedMaskError, match=r"complement of a causal mask .* pass "
                                                   r"~mask\.$"):
        resolve(above, causal=True)
    assert resolve(~above, causal=True).causal


def test_an_additive_mask_with_the_blocked_half_swapped_is_named_so():
    """A float mask has one convention (added to the logits): -inf on and below the
    diagonal is a swapped mask, and ~mask, the bool advice, fails on a float tensor."""
    tril = torch.ones(N, N, dtype=torch.bool).tril()
    swapped = torch.zeros(N, N).masked_fill(tril, float("-inf")).expand(B, 1, N, N)
    with pytest.raises(UnsupportedMaskError, match=r"the blocked half swapped\? A causal "
                       r"mask blocks the entries above the diagonal") as refused:
        resolve(swapped, causal=True)
    assert "~mask" not in str(refused.value)


def test_query_valid_must_be_bool():
    """``~`` of a 0/1 integer tensor is -1/-2, every row unchecked: a window mask was
    taken as no mask at all."""
    window = hf_mask(sdpa_mask, sliding_window_causal_mask_function(3), padding(),
                     allow_is_causal_skip=False)
    with pytest.raises(TypeError, match=r"query_valid must be a bool tensor .* got "
                                        r"torch.int64; pass query_valid.bool\(\)"):
        resolve_mask(window, batch=B, query_len=N, key_len=N, is_causal=True,
                     query_valid=padding().long())


def test_malformed_masks_are_refused():
    with pytest.raises(UnsupportedMaskError, match="must broadcast"):
        resolve(torch.ones(B, 1, N, N + 1, dtype=torch.bool))
    with pytest.raises(UnsupportedMaskError, match="shape \\[B, Nk\\]"):
        resolve(torch.ones(B, N + 2))
    with pytest.raises(UnsupportedMaskError, match=r"boolean .* or additive"):
        resolve(torch.ones(B, 1, N, N, dtype=torch.long))
    with pytest.raises(UnsupportedMaskError, match="3 dimensions"):
        resolve(torch.ones(B, N, N, dtype=torch.bool))
    with pytest.raises(UnsupportedMaskError, match="not a tensor"):
        resolve([[1, 0]])


def test_cross_attention_padding_keeps_queries():
    pad = torch.ones(B, 9, dtype=torch.bool)
    pad[2, 6:] = False
    mask = pad[:, None, None, :].expand(B, 1, N, 9)
    got = resolve(mask, nq=N, nk=9)
    assert torch.equal(got.key_padding_mask, pad) and got.causal is False


@pytest.mark.parametrize("builder", [sdpa_mask, eager_mask], ids=["bool", "additive"])
def test_a_compiled_call_takes_the_declared_pattern_and_checks_it_on_the_device(builder):
    """Under ``torch.compile(fullgraph=True)`` the mask's values cannot decide a branch:
    the model's causal flag says which pattern it is, and a device-side assertion
    raises at run time for any other (here a sliding window)."""
    pad = padding()

    def keys(mask, causal):
        got = resolve(mask, causal=causal)
        return got.key_padding_mask, got.causal

    compiled = torch.compile(keys, backend="eager", fullgraph=True)
    for function, causal in ((causal_mask_function, True),
                             (bidirectional_mask_function, False)):
        mask = hf_mask(builder, function, pad)
        key_valid, got_causal = compiled(mask, causal)
        assert got_causal is causal and torch.equal(key_valid, pad)
    window = hf_mask(builder, sliding_window_causal_mask_function(3), pad)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="not causal with key padding"):
        torch.compile(keys, backend="eager", fullgraph=True)(window, True)


def test_an_additive_entry_at_the_blocked_logit_is_blocked_on_both_readings():
    """Legacy BERT's -10000 is a blocked entry (exp(-1e4) is 0 in float32 and float64),
    for ``allowed_entries`` (read without checks, e.g. by decoding's cache checks) as for
    ``resolve_mask`` (which refuses a small negative bias: it attends, weighted)."""
    bias = torch.tensor([0.0, -1.0, BLOCKED_LOGIT, -1e9, float("-inf")])
    assert allowed_entries(bias.view(1, 1, 1, 5)).flatten().tolist() == [
        True, True, False, False, False]
    blocking = torch.tensor([0.0, BLOCKED_LOGIT, -1e9, 0.0])
    resolved = resolve(blocking.view(1, 1, 1, 4).expand(B, 1, N, 4), nk=4)
    assert resolved.key_padding_mask.tolist() == [[True, False, False, True]] * B
