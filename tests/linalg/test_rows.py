"""Whole-row gathers by index_select against torch.gather, values and gradients; the
gather that passes its input through (``gather_rows_through``) against x and
``gather_rows`` read separately."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import gather_rows
from skyformer.linalg.rows import gather_rows_through
from tests.conftest import gen
from tests.dispatch import Recorder


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


def _through_and_separate(x, index, weights):
    """The same loss, sum(w_x * x') + sum(w_r * rows), with x' and rows from
    ``gather_rows_through`` and from x and ``gather_rows``."""
    w_x, w_r = weights
    through, rows = gather_rows_through(x, index)
    return ((through * w_x).sum() + (rows * w_r).sum(),
            (x * w_x).sum() + (gather_rows(x, index) * w_r).sum())


@pytest.mark.parametrize(
    "x_shape, index_shape",
    [((2, 3, 7, 5), (2, 3, 11)), ((2, 1, 3, 7, 5), (2, 4, 3, 2, 6)), ((7, 5), (9,))],
)
def test_through_gives_the_values_and_gradients_of_separate_reads(x_shape, index_shape):
    g = gen(2)
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, x_shape[-2], index_shape, generator=g)
    through, rows = gather_rows_through(x, index)
    torch.testing.assert_close(through, x, rtol=0, atol=0)
    torch.testing.assert_close(rows, reference(x, index), rtol=0, atol=0)
    weights = (torch.randn(x.shape, generator=g, dtype=torch.float64),
               torch.randn(rows.shape, generator=g, dtype=torch.float64))
    got, want = _through_and_separate(x, index, weights)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


def test_through_with_one_output_unread():
    g = gen(3)
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 6, (2, 4), generator=g)
    through, rows = gather_rows_through(x, index)
    (only_rows,) = torch.autograd.grad(rows.sum(), x)
    torch.testing.assert_close(only_rows, torch.autograd.grad(gather_rows(x, index).sum(), x)[0])
    through, rows = gather_rows_through(x, index)
    (only_x,) = torch.autograd.grad(through.square().sum(), x)
    torch.testing.assert_close(only_x, 2 * x)


def test_through_double_backward_forward_mode_and_per_sample_gradients():
    g = gen(4)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 5, (2, 4), generator=g)
    assert torch.autograd.gradcheck(lambda t: gather_rows_through(t, index), (x,))
    assert torch.autograd.gradgradcheck(
        lambda t: [u.square() for u in gather_rows_through(t, index)], (x,))

    def loss(t, idx):  # one sample: t [5, 3], idx [4]
        through, rows = gather_rows_through(t, idx)
        return (through.sin().sum() + rows.square().sum())

    tangent = torch.randn(x.shape, generator=g, dtype=torch.float64)
    _, got = torch.func.jvp(lambda t: loss(t[0], index[0]), (x.detach(),), (tangent,))
    through = torch.func.jvp(lambda t: (t[0].sin().sum() + gather_rows(t[0], index[0])
                                        .square().sum()), (x.detach(),), (tangent,))[1]
    torch.testing.assert_close(got, through)
    per_sample = torch.func.vmap(torch.func.grad(loss))(x.detach(), index)
    for i in range(2):
        want = torch.autograd.grad(loss(x[i], index[i]), x)[0][i]
        torch.testing.assert_close(per_sample[i], want)


def test_through_adds_the_rows_gradient_without_a_zero_tensor_of_x():
    """The point of the node: one index_add into the gradient of x, where a separate
    gather gives autograd a zero tensor of x's size and an addition of two such."""
    g = gen(5)
    x = torch.randn(2, 3, 50, 4, generator=g, requires_grad=True)
    index = torch.randint(0, 50, (2, 3, 6), generator=g)
    weights = (torch.randn(x.shape, generator=g), torch.randn(2, 3, 6, 4, generator=g))
    counts = []
    for use_through in (True, False):
        h = x * 2  # not a leaf: the gradient goes on through a node, as inside a model
        got, want = _through_and_separate(h, index, weights)
        with Recorder(lambda func, args, out: func.overloadpacket.__name__) as ops:
            torch.autograd.grad(got if use_through else want, x)
        counts.append(ops.items)
    through, separate = counts
    assert "index_add" in through and not {"zeros", "new_zeros"} & set(through)
    assert {"zeros", "new_zeros"} & set(separate)
    assert through.count("add") < separate.count("add")
