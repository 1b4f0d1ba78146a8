"""BigBird block-sparse attention against the dense masked reference, and its layout rules."""

from __future__ import annotations

import itertools

import pytest
import torch

from skyformer import MultiHeadAttention, softmax_attention
from skyformer.ops.bigbird import BigBirdConfig, bigbird_attention
from skyformer.ops.bigbird.bigbird import bigbird_layout
from skyformer.ops.bigbird.naive import bigbird_pattern, reference_bigbird_attention
from tests.conftest import gen, make_qkv


def layout_for(mask, b, h, n, num_features, seed, r=3, queries="auto"):
    """The layout of a call with ``key_padding_mask=mask`` and ``query_padding_mask=queries``."""
    cfg = BigBirdConfig(num_features, r)
    queries = mask if isinstance(queries, str) else queries
    return bigbird_layout(queries, mask, b, h, n, cfg.block_size, r, torch.device("cpu"),
                          gen(seed))


def holes_mask(b, n):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, n - 8:] = False  # right padding
    mask[1, 10] = False  # a hole
    return mask


@pytest.mark.parametrize("n, num_features, r", [(48, 32, 3), (45, 32, 3), (61, 24, 1), (30, 8, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_matches_dense_reference_outputs_and_gradients(n, num_features, r, masked):
    """Block sizes 4, 4 (N not a multiple), 4 with r = 1, and 1."""
    q, k, v = make_qkv(2, 2, n, 8)
    mask = holes_mask(2, n) if masked else None
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = bigbird_attention(q, k, v, key_padding_mask=mask, generator=gen(5),
                             num_features=num_features, num_random_blocks=r)
    layout = layout_for(mask, 2, 2, n, num_features, 5, r)
    ref = reference_bigbird_attention(q, k, v, layout, key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("masked", [False, True])
def test_one_block_covering_the_sequence_is_exact_softmax(masked):
    q, k, v = make_qkv(2, 2, 40, 8)
    mask = holes_mask(2, 40) if masked else None
    exact = softmax_attention(q, k, v, key_padding_mask=mask)
    for num_features in (8 * 40, 512):  # block size >= N
        out = bigbird_attention(
            q, k, v, key_padding_mask=mask, generator=gen(0), num_features=num_features
        )
        torch.testing.assert_close(out, exact, rtol=1e-9, atol=1e-11)
    # three and four blocks: every query block's window or globality covers everything;
    # five with a random block: the one key block left is drawn
    for num_features, r in ((8 * 14, 3), (8 * 10, 3), (6 * 8, 1)):
        out = bigbird_attention(q, k, v, generator=gen(0), num_features=num_features,
                                num_random_blocks=r)
        torch.testing.assert_close(out, softmax_attention(q, k, v), rtol=1e-9, atol=1e-11)


def test_block_size_mapping():
    assert BigBirdConfig().block_size == 64  # 512 keys = (3 + 2 + 3) blocks of 64
    assert BigBirdConfig(num_features=128).block_size == 16
    assert BigBirdConfig(num_features=512, num_random_blocks=0).block_size == 102
    assert BigBirdConfig(num_features=6).block_size == 1


def test_pattern_follows_the_paper():
    """Block size 2, 20 blocks, r = 3: middle rows see 8 distinct blocks (7 for the rows
    next to a global block), global blocks are dense rows and columns, random blocks lie
    outside the window and the global blocks."""
    n, bs = 40, 2
    layout = layout_for(None, 1, 3, n, 16, 0)
    assert layout.block_size == bs and layout.num_blocks == 20
    pattern = bigbird_pattern(layout, n)[0]  # [H, N, N]
    per_query = pattern.sum(-1)  # [H, N]
    assert torch.all(per_query[:, :bs] == n) and torch.all(per_query[:, -bs:] == n)
    assert torch.all(pattern[:, :, :bs]) and torch.all(pattern[:, :, -bs:])
    assert torch.all(per_query[:, bs : 2 * bs] == 7 * bs) and torch.all(
        per_query[:, -2 * bs : -bs] == 7 * bs
    )
    assert torch.all(per_query[:, 2 * bs : -2 * bs] == 8 * bs)
    for h in range(3):
        for i in range(1, 19):
            picked = layout.random[0, h, i][layout.random_live[0, h, i]].tolist()
            assert len(picked) == 3 and len(set(picked)) == 3
            assert not set(picked) & {0, 19, i - 1, i, i + 1}
    assert not torch.equal(layout.random[0, 0], layout.random[0, 1]), "heads draw their own blocks"


def test_random_blocks_are_uniform_among_candidates():
    """Query block 5 of 12 blocks has the 7 candidates {1, 2, 3, 7, 8, 9, 10}; over 4000
    draws each should be picked 3/7 of the time."""
    layout = layout_for(None, 1, 4000, 12, 8, 0)  # block size 1, 4000 heads as draws
    picks = layout.random[0, :, 5].flatten()
    counts = torch.bincount(picks, minlength=12).double()
    candidates = [1, 2, 3, 7, 8, 9, 10]
    assert counts[[0, 4, 5, 6, 11]].sum() == 0
    expected = 4000 * 3 / 7
    chi2 = ((counts[candidates] - expected) ** 2 / expected).sum().item()
    assert chi2 < 30, chi2  # 6 degrees of freedom (a bit fewer: no replacement): p < 1e-4


def _draws_by_hand(u, last, r):
    """Block i's j-th pick: candidate floor(u_j (c - j)) among the middle blocks
    1..last-1 outside i-1..i+1 not chosen yet, listed one by one."""
    b, h, nb, _ = u.shape
    blocks = torch.zeros(b, h, nb, r, dtype=torch.long)
    for bi, hi, i in itertools.product(range(b), range(h), range(nb)):
        last_b = int(last[bi])
        left = [x for x in range(1, last_b) if x not in (i - 1, i, i + 1)]
        for j in range(min(r, len(left))):
            blocks[bi, hi, i, j] = left.pop(
                min(int(u[bi, hi, i, j] * len(left)), len(left) - 1))
    return blocks


@pytest.mark.parametrize("r", [0, 1, 3, 9])
def test_random_blocks_are_the_uniforms_picks_among_those_left(r):
    from skyformer.ops.bigbird.bigbird import _choose_random_blocks

    u = torch.rand(2, 3, 14, r, generator=gen(r), dtype=torch.float64)
    last = torch.tensor([13, 6])
    blocks, alive = _choose_random_blocks(u, last, r)
    assert torch.equal(blocks, _draws_by_hand(u, last, r))
    assert torch.equal(alive.sum(-1)[1, 0], torch.tensor(
        [min(r, len([x for x in range(1, 6) if x not in (i - 1, i, i + 1)]))
         for i in range(14)]))


def test_the_random_draw_runs_a_number_of_operations_linear_in_its_blocks():
    """Each pick is placed among the earlier ones in one comparison with all of them,
    not one operation per earlier pick: r = 200 ran ~20,000 operations a call."""
    from skyformer.ops.bigbird.bigbird import _choose_random_blocks
    from tests.dispatch import Recorder

    def operations(r):
        with Recorder(lambda func, args, out: func) as ops:
            _choose_random_blocks(torch.rand(1, 1, 4, r), torch.tensor([300]), r)
        return len(ops.items)

    assert operations(64) < 2.5 * operations(32)


def test_padding_builds_blocks_over_real_tokens():
    """Right and left padding give the layout (and output) of the truncated sequence."""
    q, k, v = make_qkv(1, 2, 30, 8)
    trunc = bigbird_attention(
        q[:, :, 4:27], k[:, :, 4:27], v[:, :, 4:27], generator=gen(3), num_features=16
    )
    mask = torch.zeros(1, 30, dtype=torch.bool)
    mask[0, 4:27] = True
    padded = bigbird_attention(q, k, v, key_padding_mask=mask, generator=gen(3), num_features=16)
    torch.testing.assert_close(padded[:, :, 4:27], trunc, rtol=1e-12, atol=1e-12)
    assert torch.all(padded[:, :, :4] == 0) and torch.all(padded[:, :, 27:] == 0)


def test_self_attention_only_and_bad_options():
    q, k, v = make_qkv(1, 2, 12, 8, nk=20)
    with pytest.raises(ValueError, match="different number of queries and keys"):
        bigbird_attention(q, k, v)
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"num_random_blocks": -1}, "num_random_blocks"),
        ({"scale": float("nan")}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            bigbird_attention(q, k, v, **options)


def test_random_blocks_must_fit_the_key_budget():
    """Each query attends to 5 + r blocks of at least one key: r above num_features - 5
    gathers more keys than the budget (num_random_blocks=10**9 asked for hundreds of
    GB); the paper's 3 runs at any budget, with blocks of one key."""
    with pytest.raises(ValueError, match=r"num_random_blocks=1000000000 does not fit "
                                         r"num_features=512.*at most 507"):
        BigBirdConfig(num_random_blocks=10**9)
    with pytest.raises(ValueError, match=r"num_random_blocks=9 does not fit num_features=12"):
        bigbird_attention(*make_qkv(1, 1, 8, 4), num_features=12, num_random_blocks=9)
    BigBirdConfig(num_features=512, num_random_blocks=507)
    BigBirdConfig(num_features=2, num_random_blocks=3)


def query_and_key_masks(n):
    """Masks of their own: the queries' holes and padding differ from the keys'."""
    keys, queries = holes_mask(2, n), torch.ones(2, n, dtype=torch.bool)
    queries[0, n - 6:] = False  # right padding where the keys have left padding
    queries[1, [2, 3, 17]] = False
    return queries, keys


@pytest.mark.parametrize("n, num_features", [(48, 32), (45, 32), (30, 8)])
@pytest.mark.parametrize("masks", ["context", "both", "queries"])
def test_a_query_mask_of_its_own_matches_the_dense_reference(n, num_features, masks):
    """Query blocks are cut from the real queries, key blocks from the real keys: every
    query real beside padded keys (a MultiHeadAttention context of the same length),
    masks of their own on both sides, and a query mask alone. Padded query rows are zero."""
    queries, keys = query_and_key_masks(n)
    queries, keys = {"context": (None, keys), "both": (queries, keys),
                     "queries": (queries, None)}[masks]
    q, k, v = make_qkv(2, 2, n, 8, seed=3)
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = bigbird_attention(q, k, v, key_padding_mask=keys, query_padding_mask=queries,
                             generator=gen(5), num_features=num_features)
    layout = layout_for(keys, 2, 2, n, num_features, 5, queries=queries)
    ref = reference_bigbird_attention(q, k, v, layout, key_padding_mask=keys,
                                      query_padding_mask=queries)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    real_rows = fast.abs().sum((1, 3)) > 0  # [B, N]
    assert torch.equal(real_rows, torch.ones_like(real_rows) if queries is None else queries)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_a_context_with_padded_keys_runs_in_multi_head_attention():
    """MultiHeadAttention passes a context of the same length as cross-attention (every
    query real): its padded keys get no weight and every query row is computed."""
    layer = MultiHeadAttention(16, 2, method="bigbird", num_features=8)
    x, context = torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    out = layer(x, mask, context=context, generator=gen(0))
    junk = context.clone()
    junk[1, 8:] = 1e3
    torch.testing.assert_close(layer(x, mask, context=junk, generator=gen(0)), out)
    assert out.shape == (2, 12, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_a_scale_of_zero_or_below_matches_the_reference(scale):
    """Any finite scale, as softmax and torch's SDPA take; it was refused."""
    q, k, v = make_qkv(2, 2, 45, 8)
    mask = holes_mask(2, 45)
    fast = bigbird_attention(q, k, v, key_padding_mask=mask, generator=gen(5),
                             num_features=32, scale=scale)
    ref = reference_bigbird_attention(q, k, v, layout_for(mask, 2, 2, 45, 32, 5),
                                      key_padding_mask=mask, scale=scale)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
