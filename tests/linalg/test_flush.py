"""Negligible entries are flushed to zero on the CPU, where subnormal arithmetic is slow:
no subnormal number reaches a matrix product, and the results do not change beyond
rounding (``linalg/flush.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from skyformer.linalg import gaussian_kernel_block, half_sq_norm, lemma3_inverse
from skyformer.linalg.flush import (
    flush_exponent_on_cpu_,
    flush_negligible_,
    negligible,
    negligible_exponent,
)
from skyformer.registry import get_method


def subnormal_count(x: torch.Tensor) -> int:
    return int(((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entries_below_sqrt_tiny_become_zero_and_the_rest_stay(dtype):
    t = negligible(dtype)
    assert t == pytest.approx(math.sqrt(torch.finfo(dtype).tiny))
    x = torch.tensor([t / 2, -t / 2, 2 * t, -2 * t, 1.0, float("nan"), float("inf"),
                      torch.finfo(dtype).tiny / 4], dtype=dtype)
    y = flush_negligible_(x.clone())
    assert y[:2].eq(0).all() and y[-1] == 0
    assert torch.equal(y[2:5], x[2:5]) and y[5].isnan() and y[6] == float("inf")


@pytest.mark.parametrize(("dtype", "base2"), [(torch.float32, False), (torch.float32, True),
                                              (torch.float64, False), (torch.float64, True)])
def test_exponents_below_the_floor_give_exact_zeros(dtype, base2):
    floor = negligible_exponent(dtype, base2=base2)
    e = torch.tensor([floor - 1, floor + 1, 0.0, float("-inf")], dtype=dtype)
    c = flush_exponent_on_cpu_(e.clone(), base2=base2)
    c = c.exp2() if base2 else c.exp()
    assert c[0] == 0 and c[1] > 0 and c[2] == 1 and c[3] == 0
    assert subnormal_count(c) == 0


def far_clusters(dtype=torch.float32, n=64, d=16, spread=12.0, seed=0):
    """Rows in four clusters far apart: the kernel block between clusters underflows."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, d, generator=g, dtype=dtype) * spread
    x = centres.repeat_interleave(n // 4, 0) + 0.5 * torch.randn(n, d, generator=g, dtype=dtype)
    return x[None, None]  # [1, 1, n, d]


def on_a_line(n=64, d=16, step=0.5, dtype=torch.float32):
    """Row i at i * step on the first axis: squared distances / 2 run from 0 to ~500,
    through float32's subnormal range (87 to 103)."""
    x = torch.zeros(n, d, dtype=dtype)
    x[:, 0] = step * torch.arange(n, dtype=dtype)
    return x[None, None]


def test_far_pairs_give_zeros_not_subnormals():
    x = on_a_line()
    c = gaussian_kernel_block(x, x, half_sq_norm(x), half_sq_norm(x))
    with torch.no_grad():
        unflushed = torch.exp(-torch.cdist(x[0, 0], x[0, 0]) ** 2 / 2)
    assert subnormal_count(unflushed) > 0  # the data does produce them
    assert subnormal_count(c) == 0
    torch.testing.assert_close(c[0, 0], unflushed, rtol=1e-5, atol=negligible(torch.float32))


def test_the_lemma3_inverse_of_a_nearly_block_diagonal_matrix_has_no_subnormals():
    x = on_a_line(step=2.0)  # W of the unflushed iteration: ~300 subnormal entries
    m = gaussian_kernel_block(x, x, half_sq_norm(x), half_sq_norm(x))
    w = lemma3_inverse(m, gamma=0.1)
    assert subnormal_count(w) == 0
    exact = lemma3_inverse(m.double(), gamma=0.1, pinv="exact")
    torch.testing.assert_close(w.double(), exact, rtol=0, atol=2e-3 * exact.abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["skyformer", "nystrom_softmax"])
def test_flushing_leaves_the_output_as_float64_computes_it(name, causal):
    """Far clusters of tokens: float32 (flushed) against float64 (nothing to flush)."""
    g = torch.Generator().manual_seed(1)
    q = far_clusters(n=128, spread=3.0, seed=1).expand(1, 2, 128, 16).contiguous()
    k = q + 0.1 * torch.randn(q.shape, generator=g)
    v = torch.randn(q.shape, generator=g)
    attend = get_method(name).bind(seq_len=128, num_features=32, causal=causal)
    key = torch.tensor([3, 4])
    out32 = attend(q, k, v, generator=key)
    out64 = attend(q.double(), k.double(), v.double(), generator=key)
    err = (out32.double() - out64).norm() / out64.norm()
    assert err < 1e-4
