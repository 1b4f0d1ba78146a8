"""Reformer LSH attention against softmax over the union of its LSH sets."""

from __future__ import annotations

import pytest
import torch

from skyformer import softmax_attention
from skyformer.ops.reformer import ReformerConfig, reformer_attention
from skyformer.ops.reformer.naive import reference_reformer_attention, reformer_attention_sets
from skyformer.ops.reformer.reformer import buckets_per_sequence
from skyformer.registry import get_method
from skyformer.sketch import draw_rotations
from tests.conftest import gen, make_qkv


def rotations_for(q, mask, seed, **options):
    cfg = ReformerConfig(**options)
    lengths = mask.sum(-1) if mask is not None else torch.full((q.shape[0],), q.shape[2])
    columns = int(buckets_per_sequence(cfg, lengths).max()) // 2
    return draw_rotations(q.shape[1], cfg.num_hashes, q.shape[-1], columns,
                          generator=gen(seed), dtype=q.dtype)


OPTIONS = [
    {"num_features": 8},
    {"num_features": 8, "shared_qk": True},
    {"num_features": 8, "exclude_self": False},
    {"num_features": 6, "num_hashes": 3},
    {"num_features": 10, "num_buckets": 4, "shared_qk": True, "exclude_self": False},
    {"num_features": 8, "exclude_self": True},
    # the paper's same-bucket mask
    {"num_features": 8, "attend_across_buckets": False},
    {"num_features": 8, "attend_across_buckets": False, "shared_qk": True},
    {"num_features": 6, "num_buckets": 6, "attend_across_buckets": False, "num_hashes": 3},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_fast_matches_reference_outputs_and_gradients(options):
    q, k, v = make_qkv(2, 2, 21, 6, dv=5, seed=1)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, 17:] = False
    mask[1, :3] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = reformer_attention(q, k, v, key_padding_mask=mask, generator=gen(2), **options)
    ref = reference_reformer_attention(q, k, v, rotations_for(q, mask, 2, **options),
                                       key_padding_mask=mask, **options)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    inputs = (q, v) if options.get("shared_qk") else (q, k, v)
    for a, b in zip(torch.autograd.grad(fast.square().sum(), inputs),
                    torch.autograd.grad(ref.square().sum(), inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_rounds_are_deduplicated():
    """Two rounds see some keys twice and some once; the combination counts each key
    once (Appendix A's N_ij): softmax over the union, not weighted by the counts."""
    q, k, v = make_qkv(1, 2, 40, 6, seed=3)
    options = {"num_features": 8, "num_hashes": 2, "exclude_self": False}
    rot = rotations_for(q, None, 4, **options)
    single = {**options, "num_hashes": 1}
    counts = sum(reformer_attention_sets(q, k, rot[:, r : r + 1], **single).long()
                 for r in range(2))
    assert (counts == 1).any() and (counts == 2).any()
    fast = reformer_attention(q, k, v, generator=gen(4), **options)
    logits = (q @ k.transpose(-1, -2) / 6**0.5).masked_fill(counts == 0, float("-inf"))
    union = torch.softmax(logits, -1).nan_to_num()  # a query may find no key: output 0
    torch.testing.assert_close(fast, union @ v, rtol=1e-10, atol=1e-12)
    counted = union * counts
    double_counted = (counted / counted.sum(-1, keepdim=True)).nan_to_num() @ v
    assert (fast - double_counted).abs().max() > 1e-3


@pytest.mark.parametrize("rounds", [1, 2])
def test_one_bucket_one_chunk_with_self_is_exact_softmax(rounds):
    """Limit: every key in the query's bucket and chunk, attention to self allowed."""
    q, k, v = make_qkv(2, 2, 23, 8, seed=5)
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[1, 15:] = False
    out = reformer_attention(q, k, v, key_padding_mask=mask, num_features=46, num_buckets=1,
                             num_hashes=rounds, exclude_self=False, generator=gen(0))
    torch.testing.assert_close(out, softmax_attention(q, k, v, key_padding_mask=mask),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm", [1e3, 1e4])
def test_round_weights_sum_to_one_at_large_logits(norm):
    """float32 logits of 1e6 to 1e8, where adding log 2 to a round's log-normaliser is
    lost to rounding: the rounds' weights still sum to one (the output was up to twice
    softmax attention's, every round weighted 1)."""
    q, k, v = (t.float() for t in make_qkv(1, 2, 16, 8, seed=5))
    q, k = q * norm, k * norm
    out = reformer_attention(q, k, v, num_features=32, num_buckets=1, num_hashes=2,
                             exclude_self=False, generator=gen(0))
    torch.testing.assert_close(out, softmax_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_no_attention_to_self_unless_alone():
    q, k, v = make_qkv(1, 1, 12, 4, seed=6)
    # one bucket, one chunk: everyone sees everyone, so self is always excluded
    out = reformer_attention(q, k, v, num_features=24, num_buckets=1, exclude_self=True,
                             generator=gen(0))
    logits = (q @ k.transpose(-1, -2)) / 2.0
    logits = logits.masked_fill(torch.eye(12, dtype=torch.bool), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-10, atol=1e-12)
    # a sequence of one token can only attend to itself
    single = reformer_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], exclude_self=True,
                                generator=gen(0))
    torch.testing.assert_close(single, v[:, :, :1], rtol=0, atol=1e-15)


def test_query_with_no_key_in_any_round_attends_to_itself():
    """Same-bucket mask, self allowed: a query whose bucket holds no key of its window in
    any round returns its own value, never a zero row."""
    q, k, v = make_qkv(1, 2, 48, 6, seed=8)
    options = {"num_features": 4, "num_buckets": 16, "num_hashes": 1,
               "attend_across_buckets": False, "exclude_self": False}
    sets = reformer_attention_sets(q, k, rotations_for(q, None, 3, **options), **options)
    alone = sets.sum(-1) == 1
    alone &= sets.diagonal(dim1=-2, dim2=-1)
    assert alone.any()
    out = reformer_attention(q, k, v, generator=gen(3), **options)
    torch.testing.assert_close(out[alone], v[alone], rtol=0, atol=1e-15)
    assert (out.abs().sum(-1) > 0).all()


def test_shared_qk_uses_normalised_queries_and_ignores_k():
    q, k, v = make_qkv(1, 2, 20, 6, seed=7)
    shared = reformer_attention(q, k, v, num_features=8, shared_qk=True, generator=gen(1))
    junk = reformer_attention(q, 5 * k + 1, v, num_features=8, shared_qk=True, generator=gen(1))
    explicit = reformer_attention(q, q / q.norm(dim=-1, keepdim=True), v, num_features=8,
                                  exclude_self=True, generator=gen(1))
    torch.testing.assert_close(shared, junk, rtol=0, atol=0)
    # hashing both sides with the same rotations is the same computation (bucket of a
    # vector does not depend on its length)
    torch.testing.assert_close(shared, explicit, rtol=1e-12, atol=1e-12)


def test_shared_qk_gives_the_unused_key_projection_a_zero_gradient():
    """With shared_qk a layer's key projection got no gradient at all, so training under
    DistributedDataParallel (find_unused_parameters=False, as skyformer lra train sets
    it up) stopped at its second step; it gets zeros, as every other parameter a
    gradient."""
    from skyformer import MultiHeadAttention

    layer = MultiHeadAttention(8, 2, "reformer", num_features=8, shared_qk=True).double()
    layer(torch.randn(2, 16, 8, dtype=torch.float64, generator=gen(0)),
          generator=gen(1)).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert not layer.k_proj.weight.grad.any() and layer.q_proj.weight.grad.any()


def test_buckets_follow_the_real_length():
    cfg = ReformerConfig()  # chunk 64
    lengths = torch.tensor([1, 64, 65, 4096, 0])
    assert buckets_per_sequence(cfg, lengths).tolist() == [2, 2, 4, 128, 1]
    assert buckets_per_sequence(ReformerConfig(num_buckets=6), lengths).tolist() == [6] * 5


def test_defaults_are_the_published_settings():
    cfg = get_method("reformer").make_config()
    assert (cfg.num_features, cfg.chunk, cfg.num_hashes) == (128, 64, 2)
    # reformer-pytorch's and trax's defaults: the whole window, self excluded with shared QK
    assert cfg.attend_across_buckets and cfg.exclude_self is None and not cfg.self_excluded
    assert ReformerConfig(shared_qk=True).self_excluded
    assert not get_method("reformer").capabilities.cross_attention


def test_bad_inputs_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 1}, "num_features"),
        ({"num_hashes": 0}, "num_hashes"),
        ({"num_buckets": 3}, "num_buckets"),
        ({"num_buckets": 0}, "num_buckets"),
        ({"shared_qk": 1}, "shared_qk"),
        ({"exclude_self": "no"}, "exclude_self"),
        ({"attend_across_buckets": None}, "attend_across_buckets"),
        ({"scale": 0.0}, "scale"),
    ):
        with pytest.raises(ValueError, match=word):
            reformer_attention(q, k, v, **options)
    qc, kc, vc = make_qkv(1, 1, 6, 4, nk=9)
    with pytest.raises(ValueError, match="different number of queries and keys"):
        reformer_attention(qc, kc, vc)


def test_a_real_query_at_a_padded_key_is_refused():
    """A query real where its key is padding (query_padding_mask None, or one marking
    more positions real) was sorted with the padding: with no real key in its windows it
    attended to its padded self and got 0 where softmax gives v_0 (1.46 off). Queries
    padded where keys are real are taken, and equal the reference."""
    q, k, v = make_qkv(1, 1, 16, 8, seed=1)
    keys = torch.zeros(1, 16, dtype=torch.bool)
    keys[0, :4] = True
    for queries in (None, torch.ones(1, 16, dtype=torch.bool), keys | (torch.arange(16) == 9)):
        with pytest.raises(ValueError, match="reformer: a query is real where its position's "
                                             r"key is padding .*\(query_padding_mask='auto'\)"):
            reformer_attention(q, k, v, key_padding_mask=keys, query_padding_mask=queries,
                               num_features=8, generator=gen(0))
    fewer = keys & (torch.arange(16) != 2)
    out = reformer_attention(q, k, v, key_padding_mask=keys, query_padding_mask=fewer,
                             num_features=8, generator=gen(0))
    same = reformer_attention(q, k, v, key_padding_mask=keys, num_features=8, generator=gen(0))
    torch.testing.assert_close(out, same * fewer[:, None, :, None])
    assert out[0, 0, 2].abs().max() == 0
