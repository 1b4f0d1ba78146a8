"""Angular LSH, Hamming ordering and equal-sized buckets (KDEformer Appendix A)."""

from __future__ import annotations

import math

import pytest
import torch

from skyformer.ops.kdeformer.naive import reference_block_pattern
from skyformer.sketch import (
    angular_hash,
    draw_hyperplanes,
    equal_size_buckets,
    gray_code_order,
    gray_code_rank,
    gray_rank_of,
    hamming_blocks,
    hamming_order,
)
from tests.conftest import gen, make_qkv


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
def test_gray_order_is_a_permutation_with_unit_hamming_steps(bits):
    """Lemma A.2: every label once, consecutive labels differ in exactly one bit."""
    order = gray_code_order(bits)
    assert sorted(order.tolist()) == list(range(2**bits))
    steps = order[1:] ^ order[:-1]
    assert all(bin(int(x)).count("1") == 1 for x in steps)
    # The lemma's recursion is the reflected binary code t ^ (t >> 1).
    t = torch.arange(2**bits)
    assert torch.equal(order, t ^ (t >> 1))
    assert torch.equal(gray_code_rank(bits)[order], t)


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 4, 5, 8, 9, 17])
def test_gray_rank_of_labels_is_the_tables_lookup(bits):
    """The closed form (prefix XOR of the bits) against the table of the lemma's
    induction, for every label (a random sample of them at 17 bits), keeping the
    labels' shape and dtype."""
    table = gray_code_rank(bits)
    labels = (torch.arange(2**bits) if bits <= 9
              else torch.randint(0, 2**bits, (3, 1000), generator=gen(bits)))
    rank = gray_rank_of(labels, bits)
    assert rank.dtype == labels.dtype and rank.shape == labels.shape
    assert torch.equal(rank, table[labels])


def test_gray_order_small_cases_and_bad_bits():
    assert gray_code_order(0).tolist() == [0]
    assert gray_code_order(2).tolist() == [0, 1, 3, 2]  # 00, 01, 11, 10 as in Figure 5(c)
    with pytest.raises(ValueError, match="bits"):
        gray_code_order(-1)


def test_hash_bits_are_hyperplane_signs():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).T  # columns are the normals w_1, w_2
    # bit i = 1{w_i . x > 0}, label = sum_i 2^i bit_i
    assert angular_hash(x, w).tolist() == [1, 2, 0]


def test_collision_probability_matches_claim_1():
    """Pr[h(x) = h(y)] = (1 - theta/pi)^r (Claim 1), over many independent hashes."""
    theta, r, trials = math.pi / 3, 2, 20000
    x = torch.tensor([1.0, 0.0, 0.0])
    y = torch.tensor([math.cos(theta), math.sin(theta), 0.0])
    w = draw_hyperplanes((trials,), 3, r, generator=gen(0))
    hx = angular_hash(x.expand(trials, 1, 3), w)
    hy = angular_hash(y.expand(trials, 1, 3), w)
    rate = (hx == hy).double().mean().item()
    expected = (1 - theta / math.pi) ** r
    stderr = math.sqrt(expected * (1 - expected) / trials)
    assert abs(rate - expected) < 4 * stderr


def test_hamming_order_sorts_by_gray_rank_then_position_padding_last():
    x, _, _ = make_qkv(1, 1, 30, 4, seed=1)
    w = draw_hyperplanes((1, 1), 4, 3, generator=gen(1), dtype=x.dtype)
    valid = torch.ones(1, 30, dtype=torch.bool)
    valid[0, 5:9] = False
    order = hamming_order(x, w, valid)[0, 0].tolist()
    rank = gray_code_rank(3)[angular_hash(x, w)][0, 0].tolist()
    real = [i for i in range(30) if valid[0, i]]
    assert order[:26] == sorted(real, key=lambda i: (rank[i], i))
    assert order[26:] == [5, 6, 7, 8]


def test_right_padding_keeps_the_order_of_real_rows():
    x, _, _ = make_qkv(1, 2, 20, 4, seed=2)
    w = draw_hyperplanes((1, 2), 4, 4, generator=gen(2), dtype=x.dtype)
    valid = torch.zeros(1, 20, dtype=torch.bool)
    valid[0, :13] = True
    padded = hamming_order(x, w, valid)[..., :13]
    truncated = hamming_order(x[:, :, :13], w)
    assert torch.equal(padded, truncated)


def test_equal_size_buckets_pad_with_sentinel_and_reject_too_few_slots():
    order = torch.tensor([[4, 0, 2, 1, 3]])
    buckets = equal_size_buckets(order, 2, 3)
    assert buckets.tolist() == [[[4, 0], [2, 1], [3, 5]]]
    with pytest.raises(ValueError, match="fewer than N"):
        equal_size_buckets(order, 2, 2)


@pytest.mark.parametrize("nq", [18, 11])
def test_blocks_match_the_naive_pattern(nq):
    """Fast bucket ids == block pattern built with Python sorting and Gray closed form."""
    q, k, _ = make_qkv(2, 2, nq, 6, nk=18, seed=3)
    w = draw_hyperplanes((2, 2), 6, 3, generator=gen(3), dtype=q.dtype)
    mask = torch.ones(2, 18, dtype=torch.bool)
    mask[0, 14:] = False
    mask[1, :3] = False
    kwargs = {"key_valid": mask, "query_valid": mask if nq == 18 else None}
    blocks = hamming_blocks(q, k, w, 4, **kwargs)
    fast = blocks.q_block[..., :, None] == blocks.k_block[..., None, :]
    ref = reference_block_pattern(q, k, w, 4, key_padding_mask=mask)
    assert torch.equal(fast, ref)
    # every slot index of a block is a real position or the sentinel
    assert int(blocks.q_index.max()) <= nq and int(blocks.k_index.max()) <= 18


def test_hamming_blocks_refuses_an_empty_block():
    q, k, _ = make_qkv(1, 1, 8, 4)
    planes = draw_hyperplanes((1, 1), 4, 3, generator=gen(0))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        hamming_blocks(q, k, planes, 0)
