"""Property-based checks of the padding and non-finite promises (docs/reliability.md),
for every registered method: each property runs per method (pytest parametrisation;
drawing the method too left about half of them unchecked at CI's example count), and
hypothesis draws the shapes, the padding pattern (right, left, holes; self- and
cross-attention) and the data; local windows and convolutions get their own property,
with widths between one token and the whole sequence and a hole in the middle.

CI runs ``EXAMPLES`` examples per property and method; ``SKYFORMER_HYPOTHESIS_EXAMPLES=200``
runs a long search (200 examples for each of the 95 property-method pairs). A method
registered with ``mask=False`` skips the padding properties (``mask_params``) and runs the
others unpadded (``mask_for``).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from skyformer import get_method, list_methods, random_key
from tests.conftest import mask_for, mask_params

EXAMPLES = int(os.environ.get("SKYFORMER_HYPOTHESIS_EXAMPLES", "10"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 30,
                    suppress_health_check=[HealthCheck.too_slow])
METHODS = list_methods()
# Linformer's projections have one column per position: holes in the mask change which
# columns the real tokens meet, so position-free compaction does not hold for it.
POSITION_FREE = [m for m in METHODS if not get_method(m).capabilities.fixed_length]
CROSS = [m for m in METHODS if get_method(m).capabilities.cross_attention]
MAX_LEN = 32


@st.composite
def cases(draw, cross=False):
    b, h = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    nk = draw(st.integers(2, 20))
    nq = draw(st.integers(2, 20)) if cross else nk
    masks = draw(st.lists(st.lists(st.booleans(), min_size=nk, max_size=nk)
                          .filter(any), min_size=b, max_size=b))
    seed = draw(st.integers(0, 2**31 - 1))
    budget = draw(st.sampled_from([None, 2, 5, 16]))
    return b, h, nq, nk, torch.tensor(masks), seed, budget


def qkv(b, h, nq, nk, seed, dtype=torch.float64, scale=1.0, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, nk, d, generator=g, dtype=dtype)
    return q, k, v


def bound(method, budget):
    options = {} if budget is None or "num_features" not in get_method(method).option_names() \
        else {"num_features": budget}
    return get_method(method).bind(seq_len=MAX_LEN, **options)


def call(fn, q, k, v, mask, seed, **kwargs):
    return fn(q, k, v, key_padding_mask=mask, generator=random_key(seed), **kwargs)


@pytest.mark.parametrize("method", mask_params(METHODS))
@SETTINGS
@given(case=cases())
def test_garbage_in_padded_positions_never_reaches_real_outputs(method, case):
    b, h, _, n, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = qkv(b, h, n, n, seed)
    clean = call(fn, q, k, v, mask, seed)
    pad = ~mask[:, None, :, None]
    for garbage in (float("nan"), float("inf"), 1e30):
        dirty = [torch.where(pad, torch.full_like(t, garbage), t) for t in (q, k, v)]
        out = call(fn, *dirty, mask, seed)
        real = mask[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[real], clean[real], rtol=0, atol=0)
        assert torch.equal(out[~real], torch.zeros_like(out[~real]))


@pytest.mark.parametrize("method", mask_params(METHODS))
@SETTINGS
@given(case=cases())
def test_one_element_never_depends_on_another_or_on_the_padded_width(method, case):
    b, h, _, n, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = qkv(b, h, n, n, seed)
    out = call(fn, q, k, v, mask, seed)
    # another element's data and mask change; this one's padded width grows by 5
    extra = 5 if n + 5 <= MAX_LEN else 0
    q2, k2, v2 = (torch.cat([t, torch.randn(*t.shape[:2], extra, t.shape[3],
                                            dtype=t.dtype)], dim=2) for t in (q, k, v))
    mask2 = torch.cat([mask, torch.zeros(b, extra, dtype=torch.bool)], dim=1)
    if b > 1:
        q2[0] = torch.randn_like(q2[0])
        mask2[0, : n // 2 + 1] = True
    out2 = call(fn, q2, k2, v2, mask2, seed)
    for i in range(1 if b > 1 else 0, b):
        real = mask[i]
        torch.testing.assert_close(out2[i, :, :n][:, real], out[i][:, real], rtol=1e-9,
                                   atol=1e-9)


@pytest.mark.parametrize("method", mask_params(POSITION_FREE))
@SETTINGS
@given(case=cases())
def test_left_padding_and_holes_equal_the_compacted_sequence(method, case):
    """Real tokens anywhere in the row (left padding, holes) give the outputs they give
    packed at the front (right padding): padding equals truncation for any pattern."""
    b, h, _, n, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = qkv(b, h, n, n, seed)
    out = call(fn, q, k, v, mask, seed)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real ones first
    index = order[:, None, :, None]
    packed = [t.gather(2, index.expand_as(t)) for t in (q, k, v)]
    packed_mask = mask.gather(1, order)
    out_packed = call(fn, *packed, packed_mask, seed)
    for i in range(b):
        torch.testing.assert_close(out_packed[i][:, packed_mask[i]], out[i][:, mask[i]],
                                   rtol=1e-8, atol=1e-8)


# Options whose pattern runs along the sequence, for a width w drawn to hold neither one
# token nor the whole sequence: these must act on ranks among the real tokens.
LOCAL_PATTERNS = {
    "scatterbrain": lambda w: {"num_features": 4, "support": "local", "block_size": w},
    "nystromformer": lambda w: {"num_features": 4, "conv_kernel": 2 * (w // 2) + 1},
    "bigbird": lambda w: {"num_features": 6 * w, "num_random_blocks": 1},
    "skyformer_multipole": lambda w: {"num_features": 8 * w, "window": w // 2},
}


@st.composite
def holed_cases(draw):
    """A local pattern of width 2 <= w < n and masks with a hole in the middle."""
    b, h, n = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(6, 20))
    masks = []
    for _ in range(b):
        mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        hole = draw(st.integers(1, n - 2))
        mask[hole - 1 : hole + 2] = [True, False, True]
        masks.append(mask)
    width = draw(st.integers(2, n - 1))
    return b, h, n, torch.tensor(masks), width, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("method", sorted(LOCAL_PATTERNS))
@SETTINGS
@given(case=holed_cases())
def test_local_windows_and_convolutions_follow_ranks_among_real_tokens(method, case):
    """Holes inside a window or a convolution: the outputs are those of the real tokens
    packed at the front (a pattern over positions would see the holes)."""
    b, h, n, mask, width, seed = case
    fn = get_method(method).bind(**LOCAL_PATTERNS[method](width))
    q, k, v = qkv(b, h, n, n, seed)
    extra = {}
    if method == "nystromformer":
        g = torch.Generator().manual_seed(seed)
        extra["conv_weight"] = torch.randn(h, fn.config.conv_kernel, generator=g,
                                           dtype=torch.float64)
    out = call(fn, q, k, v, mask, seed, **extra)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real ones first
    packed = [t.gather(2, order[:, None, :, None].expand_as(t)) for t in (q, k, v)]
    packed_mask = mask.gather(1, order)
    out_packed = call(fn, *packed, packed_mask, seed, **extra)
    for i in range(b):
        torch.testing.assert_close(out_packed[i][:, packed_mask[i]], out[i][:, mask[i]],
                                   rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("method", CROSS)
@SETTINGS
@given(case=cases(cross=True))
def test_non_finite_real_inputs_are_never_hidden(method, case):
    b, h, nq, nk, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = qkv(b, h, nq, nk, seed)
    g = torch.Generator().manual_seed(seed)
    i = int(torch.randint(0, nq, (1,), generator=g))
    bad_q = q.clone()
    bad_q[0, 0, i, 0] = float("nan")
    out = call(fn, bad_q, k, v, mask_for(method, mask), seed, query_padding_mask=None)
    assert torch.isnan(out[0, 0, i]).all()  # the query's own row shows it
    j = int(mask[0].nonzero()[int(torch.randint(0, int(mask[0].sum()), (1,), generator=g))])
    bad_v = v.clone()
    bad_v[0, 0, j, 0] = float("inf")
    out = call(fn, q, k, bad_v, mask_for(method, mask), seed, query_padding_mask=None)
    assert not torch.isfinite(out[0, 0]).all(dim=-1).any()  # every row that sees it


@pytest.mark.parametrize("method", METHODS)
@SETTINGS
@given(case=cases(), scale=st.sampled_from([10.0, 30.0]))
def test_gradients_stay_finite_at_large_norms_in_float32(method, case, scale):
    b, h, _, n, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = (t.requires_grad_(True) for t in qkv(b, h, n, n, seed, torch.float32, scale))
    out = call(fn, q, k, v, mask_for(method, mask), seed)
    # an output that overflowed float32 is not what this property checks (assume, not
    # skip: a skip inside @given ends the whole property at that example)
    assume(bool(torch.isfinite(out).all()))
    out[mask[:, None, :, None].expand_as(out)].sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all(), method


@pytest.mark.parametrize("method", mask_params(CROSS))
@SETTINGS
@given(case=cases(cross=True))
def test_cross_attention_key_padding_equals_truncated_keys(method, case):
    """Padded keys in cross-attention give the outputs of the keys cut off (a batch of
    one, right padding); the query blocks of the LSH methods follow the real keys."""
    _, h, nq, nk, mask, seed, budget = case
    fn = bound(method, budget)
    q, k, v = qkv(1, h, nq, nk, seed)
    real = int(mask[0].sum())
    right = torch.zeros(1, nk, dtype=torch.bool)
    right[0, :real] = True
    out = call(fn, q, k, v, right, seed, query_padding_mask=None)
    cut = call(fn, q, k[:, :, :real], v[:, :, :real], None, seed, query_padding_mask=None)
    torch.testing.assert_close(out, cut, rtol=1e-8, atol=1e-8)
