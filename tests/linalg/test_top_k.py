"""``linalg.top_k``: the first k of a stable descending sort (ties by the lowest index,
NaN above every number), at ``torch.topk``'s cost."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg.top_k import top_k
from tests.conftest import gen


@pytest.mark.parametrize("seed", range(20))
def test_top_k_is_the_head_of_a_stable_descending_sort(seed):
    g = gen(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    x = torch.randint(0, 4, (3, 2, n), generator=g).double()  # many ties
    x[0, 0, int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    x[1, 1] = float("-inf")  # a row of padding
    for k in {0, 1, n // 2, n}:
        values, index = top_k(x, k)
        want_values, want_index = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(index, want_index[..., :k])
        torch.testing.assert_close(values, want_values[..., :k], equal_nan=True)


def test_the_values_carry_the_gradient_of_the_entries_chosen():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0]], requires_grad=True)
    values, index = top_k(x, 2)
    assert index.tolist() == [[1, 2]]
    values.sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_the_timing_script_runs():
    from tests.benchmark_scripts import load_benchmark

    assert load_benchmark("topk_ties").main(["--seq-lens", "64", "--clusters", "2",
                                             "--repeats", "1"]) == 0
