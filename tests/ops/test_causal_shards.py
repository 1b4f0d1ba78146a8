"""The causal forms of linear attention and Performer over a sequence split in shards,
in one process: each shard's rows take the earlier shards' sums through
``KeyReduction.earlier`` (what ``skyformer.distributed`` exchanges across ranks,
``tests/distributed``), and equal the rows of the whole sequence, the rows whose
normaliser is lost included (they fall back to the mean of every earlier value)."""

from __future__ import annotations

import pytest
import torch

from skyformer.ops.linear.linear import LinearConfig, causal_linear, linear_features
from skyformer.ops.performer.performer import PerformerConfig, performer_from_projection
from skyformer.ops.shared.causal_prefix import prefix_mean_values
from skyformer.ops.shared.inputs import check_attention_inputs
from skyformer.ops.shared.reduction import WHOLE, KeyReduction
from tests.conftest import make_qkv


class ShardsInOrder(KeyReduction):
    """Shards evaluated one after another in one process: each call's partials are
    recorded, and a later shard's ``earlier`` gets the recorded ones of the shards
    before it, in the order the code asks for them (the same in every shard)."""

    sharded = True

    def __init__(self) -> None:
        self.shards: list[list[torch.Tensor]] = []

    def next_shard(self) -> None:
        self.shards.append([])

    def earlier(self, partial: torch.Tensor) -> torch.Tensor:
        asked = len(self.shards[-1])
        self.shards[-1].append(partial)
        before = [shard[asked] for shard in self.shards[:-1]]
        return torch.stack(before) if before else partial[None][:0]


def _sharded(run, bounds, q, k, v, mask):
    reduce = ShardsInOrder()
    outs = []
    for start, stop in bounds:
        reduce.next_shard()
        part = slice(start, stop)
        outs.append(run(q[:, :, part], k[:, :, part], v[:, :, part],
                        None if mask is None else mask[:, part], reduce))
    return torch.cat(outs, dim=2)


def _linear(q, k, v, mask, reduce=WHOLE):
    info = check_attention_inputs(q, k, v, mask, method="linear")
    phi_q, phi_k, vw = linear_features(q, k, v, info.key_valid)
    return causal_linear(phi_q, phi_k, vw, LinearConfig().eps, reduce=reduce)


def _performer(projection):
    config = PerformerConfig(num_features=projection.shape[0], causal=True)

    def run(q, k, v, mask, reduce=WHOLE):
        info = check_attention_inputs(q, k, v, mask, method="performer")
        return performer_from_projection(q, k, v, projection, info, config, reduce)
    return run


BOUNDS = [(0, 30), (30, 31), (31, 100), (100, 150)]  # a shard of one row, chunks across


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method", ["linear", "performer"])
def test_shards_in_order_give_the_whole_sequences_rows_and_gradients(method, padded):
    q, k, v = make_qkv(2, 2, 150, 8, dv=4, seed=3)
    mask = None
    if padded:
        mask = torch.ones(2, 150, dtype=torch.bool)
        mask[0, 25:40] = False  # across two boundaries, over the one-row shard
        mask[1, :100] = False  # every shard before the last all padding
    projection = torch.randn(6, 8, generator=torch.Generator().manual_seed(1),
                             dtype=torch.float64)
    run = _linear if method == "linear" else _performer(projection)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = run(*leaves, mask)
    parts = [t.clone().requires_grad_() for t in (q, k, v)]
    got = _sharded(run, BOUNDS, *parts, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for a, b in zip(parts, leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_a_later_shards_rows_without_a_usable_normaliser_take_every_earlier_value():
    """Queries along +e1 and keys along -e1, far out, with the features +-e1: each
    product phi(q).phi(k) underflows, so the rows fall back to the mean of the values
    of the keys up to them, the earlier shards' included."""
    q, k, v = make_qkv(1, 1, 20, 4, seed=2)
    q[..., 0] += 300.0
    k[..., 0] -= 300.0
    projection = torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]], dtype=torch.float64)
    run = _performer(projection)
    want = run(q, k, v, None)
    torch.testing.assert_close(want, prefix_mean_values(v, None))  # every row falls back
    torch.testing.assert_close(_sharded(run, [(0, 7), (7, 20)], q, k, v, None), want)


def test_prefix_means_continue_the_earlier_sums():
    v = make_qkv(2, 3, 12, 5)[2]
    valid = torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) > 0.3
    whole = prefix_mean_values(v, valid)
    real = valid[:, None, :5, None].to(v.dtype)
    earlier = torch.cat([(v[:, :, :5] * real).sum(2, keepdim=True),
                         real.sum(2, keepdim=True).expand(2, 3, 1, 1)], -1)
    torch.testing.assert_close(prefix_mean_values(v[:, :, 5:], valid[:, 5:], earlier),
                               whole[:, :, 5:])
    ones = torch.ones(2, 12, dtype=torch.bool)
    torch.testing.assert_close(prefix_mean_values(v[:, :, 5:], None, earlier),
                               prefix_mean_values(v[:, :, 5:], ones[:, 5:], earlier))


def test_earlier_each_gives_each_partial_of_the_earlier_shards_in_its_shape_and_dtype():
    """The packed exchange returns what one ``earlier`` per partial would: ``[R,
    *shape]`` in each partial's dtype (a float32 scale beside float64 sums), gradients
    reaching the shard that offered them; in one process R = 0."""
    reduce = ShardsInOrder()
    offered = []
    for shard in range(3):
        reduce.next_shard()
        sums = torch.full((2, 3, 4), float(shard + 1), dtype=torch.float64,
                          requires_grad=True)
        scale = torch.full((2,), -float(shard), dtype=torch.float32)
        offered.append(sums)
        got_sums, got_scale = reduce.earlier_each(sums, scale)
    assert got_sums.shape == (2, 2, 3, 4) and got_sums.dtype == torch.float64
    assert got_scale.shape == (2, 2) and got_scale.dtype == torch.float32
    torch.testing.assert_close(got_sums, torch.stack([t.detach() for t in offered[:2]]))
    torch.testing.assert_close(got_scale, torch.tensor([[0.0, 0.0], [-1.0, -1.0]]))
    got_sums[1].sum().backward()
    assert offered[0].grad is None or not offered[0].grad.any()
    torch.testing.assert_close(offered[1].grad, torch.ones(2, 3, 4, dtype=torch.float64))
    alone = WHOLE.earlier_each(offered[0], torch.zeros(5, dtype=torch.float32))
    assert [(t.shape, t.dtype) for t in alone] == [((0, 2, 3, 4), torch.float64),
                                                   ((0, 5), torch.float32)]
