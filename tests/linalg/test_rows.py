"""Whole-row gathers by index_select against torch.gather, values and gradients."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import gather_rows
from tests.conftest import gen


def reference(x, index):
    """torch.gather along the row dim with index expanded over the last dim (x broadcast
    to the index's leading dims first)."""
    lead = x.dim() - 2
    batch = index.shape[:lead]
    xe = x.expand(*batch, *x.shape[lead:])
    flat = index.reshape(*batch, -1, 1).expand(*batch, -1, x.shape[-1])
    return xe.gather(lead, flat).view(*index.shape, x.shape[-1])


@pytest.mark.parametrize(
    "x_shape, index_shape",
    [
        ((2, 3, 7, 5), (2, 3, 11)),  # more picks than rows: repeats
        ((2, 3, 7, 5), (2, 3, 4, 6)),  # blocks of picks
        ((2, 1, 3, 7, 5), (2, 4, 3, 2, 6)),  # x shared across a broadcast dim
        ((7, 5), (9,)),  # no leading dims
        ((2, 3, 7, 5), (2, 3, 0)),  # nothing picked
    ],
)
def test_values_and_gradients_match_gather(x_shape, index_shape):
    g = gen(0)
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, x_shape[-2], index_shape, generator=g)
    out = gather_rows(x, index)
    want = reference(x, index)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (got_grad,) = torch.autograd.grad(out, x, grad)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(got_grad, want_grad)


def test_non_contiguous_input_and_half_precision():
    g = gen(1)
    x = torch.randn(2, 9, 3, 4, generator=g).transpose(1, 2).to(torch.bfloat16)  # [2, 3, 9, 4]
    index = torch.randint(0, 9, (2, 3, 5), generator=g)
    torch.testing.assert_close(gather_rows(x, index), reference(x, index), rtol=0, atol=0)


def test_bad_shapes_are_explained():
    with pytest.raises(ValueError, match="at least 2 leading dims"):
        gather_rows(torch.zeros(2, 3, 4, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 2 dims"):
        gather_rows(torch.zeros(4), torch.zeros(2, dtype=torch.long))
