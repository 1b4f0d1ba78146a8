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


def _through_and_separate(xs, indices, weights, in_place=False):
    """The same loss, sum(w_i * x_i') + sum(w_r * rows), with the x_i' and rows from
    ``gather_rows_through`` and from the xs, ``gather_rows`` and ``torch.cat``."""
    *w_xs, w_r = weights
    throughs, rows = gather_rows_through(xs, indices, in_place=in_place)
    separate = torch.cat([gather_rows(x, i).flatten(x.dim() - 2, -2)
                          for x, i in zip(xs, indices, strict=True)], dim=-2)
    return (sum((t * w).sum() for t, w in zip(throughs, w_xs, strict=True))
            + (rows * w_r).sum(),
            sum((x * w).sum() for x, w in zip(xs, w_xs, strict=True))
            + (separate * w_r).sum())


@pytest.mark.parametrize(
    "x_shapes, index_shapes",
    [
        ([(2, 3, 7, 5)], [(2, 3, 11)]),  # one tensor, repeats
        ([(2, 3, 7, 5), (2, 3, 9, 5)], [(2, 3, 4), (2, 3, 6)]),  # two, as [Q; K]
        ([(2, 1, 3, 7, 5)], [(2, 4, 3, 2, 6)]),  # broadcast dim, blocks of picks
        ([(7, 5), (4, 5)], [(9,), (2,)]),  # no leading dims
    ],
)
@pytest.mark.parametrize("in_place", [False, True])
def test_through_gives_the_values_and_gradients_of_separate_reads(x_shapes, index_shapes,
                                                                  in_place):
    g = gen(2)
    xs = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
          for shape in x_shapes]
    indices = [torch.randint(0, x.shape[-2], shape, generator=g)
               for x, shape in zip(xs, index_shapes, strict=True)]
    throughs, rows = gather_rows_through(xs, indices)
    for through, x in zip(throughs, xs, strict=True):
        torch.testing.assert_close(through, x, rtol=0, atol=0)
    want = torch.cat([reference(x, i).flatten(x.dim() - 2, -2)
                      for x, i in zip(xs, indices, strict=True)], dim=-2)
    torch.testing.assert_close(rows, want, rtol=0, atol=0)
    weights = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in xs] \
        + [torch.randn(rows.shape, generator=g, dtype=torch.float64)]
    got, separate = _through_and_separate(xs, indices, weights, in_place)
    for a, e in zip(torch.autograd.grad(got, xs), torch.autograd.grad(separate, xs),
                    strict=True):
        torch.testing.assert_close(a, e)


def test_through_with_an_output_unread_and_mixed_dtypes():
    g = gen(3)
    x = torch.randn(2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 5, 3, generator=g, dtype=torch.float32, requires_grad=True)
    ix, iy = torch.randint(0, 5, (2, 4), generator=g), torch.randint(0, 5, (2, 2), generator=g)
    _, rows = gather_rows_through([x, y], [ix, iy])
    assert rows.dtype == torch.float64 and rows.shape == (2, 6, 3)
    got = torch.autograd.grad(rows.sum(), [x, y])
    want = torch.autograd.grad(torch.cat([gather_rows(x, ix), gather_rows(y, iy)], 1).sum(),
                               [x, y])
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)
    (through_x, _), _ = gather_rows_through([x, y], [ix, iy])
    (only_x,) = torch.autograd.grad(through_x.square().sum(), x)
    torch.testing.assert_close(only_x, 2 * x)
    frozen = y.detach()  # no gradient wanted: none computed, x's as before
    _, rows = gather_rows_through([x, frozen], [ix, iy])
    (only_x,) = torch.autograd.grad(rows.sum(), x)
    torch.testing.assert_close(only_x, got[0])
    with pytest.raises(ValueError, match="one index per tensor, one or two"):
        gather_rows_through([x, y], [ix])


def test_through_double_backward_forward_mode_and_per_sample_gradients():
    g = gen(4)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ix, iy = torch.randint(0, 4, (2, 3), generator=g), torch.randint(0, 4, (2, 2), generator=g)

    for in_place in (False, True):  # differentiated backward passes add out of place
        def squares(a, b, in_place=in_place):
            (ta, tb), rows = gather_rows_through([a, b], [ix, iy], in_place=in_place)
            return ta.square(), tb.square(), rows.square()

        assert torch.autograd.gradcheck(squares, (x, y))
        assert torch.autograd.gradgradcheck(squares, (x, y))

    def loss(a, b, ia, ib):  # one sample: a [5, 3], b [4, 3], ia [3], ib [2]
        (ta, tb), rows = gather_rows_through([a, b], [ia, ib], in_place=True)
        return ta.sin().sum() + tb.cos().sum() + rows.square().sum()

    def separate(a, b, ia, ib):
        rows = torch.cat([gather_rows(a, ia), gather_rows(b, ib)])
        return a.sin().sum() + b.cos().sum() + rows.square().sum()

    tangents = (torch.randn(5, 3, generator=g, dtype=torch.float64),
                torch.randn(4, 3, generator=g, dtype=torch.float64))
    primals = (x[0].detach(), y[0].detach())
    _, got = torch.func.jvp(lambda a, b: loss(a, b, ix[0], iy[0]), primals, tangents)
    _, want = torch.func.jvp(lambda a, b: separate(a, b, ix[0], iy[0]), primals, tangents)
    torch.testing.assert_close(got, want)
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(
        x.detach(), y.detach(), ix, iy)
    for i in range(2):
        want = torch.autograd.grad(separate(x[i], y[i], ix[i], iy[i]), (x, y))
        torch.testing.assert_close(per_sample[0][i], want[0][i])
        torch.testing.assert_close(per_sample[1][i], want[1][i])


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
        got, want = _through_and_separate([h], [index], weights)
        with Recorder(lambda func, args, out: func.overloadpacket.__name__) as ops:
            torch.autograd.grad(got if use_through else want, x)
        counts.append(ops.items)
    through, separate = counts
    assert "index_add" in through and not {"zeros", "new_zeros"} & set(through)
    assert {"zeros", "new_zeros"} & set(separate)
    assert through.count("add") < separate.count("add")


def test_through_in_place_adds_into_the_gradient_it_is_given():
    """``in_place``: the rows' gradient goes into the gradient that reaches x through
    the node (here a product's, a tensor of its own): no tensor of x's size is made,
    the gradients are those of the out-of-place addition."""
    g = gen(6)
    x = torch.randn(2, 3, 50, 4, generator=g, requires_grad=True)
    index = torch.randint(0, 50, (2, 3, 6), generator=g)
    weights = (torch.randn(x.shape, generator=g), torch.randn(2, 3, 6, 4, generator=g))

    def made(func, args, out):  # the tensors of x's size an operation allocates
        name = func.overloadpacket.__name__
        fresh = isinstance(out, torch.Tensor) and not name.endswith("_") \
            and not out._is_view() and out.numel() >= x.numel()
        return name if fresh else None

    grads, allocations = [], []
    for in_place in (False, True):
        loss, _ = _through_and_separate([x * 2], [index], weights, in_place)
        with Recorder(made) as recorded:
            grads.append(torch.autograd.grad(loss, x)[0])
        allocations.append(recorded.items)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert allocations[0].count("index_add") == 1  # the copy in_place saves
    assert "index_add" not in allocations[1]
    assert len(allocations[1]) == len(allocations[0]) - 1


def test_through_in_place_adds_out_of_place_into_one_gradient_given_twice():
    """An addition of the two passed-through tensors gives both the same gradient:
    the in-place addition would then add each one's rows into the other's gradient.
    Against the promise ``in_place`` asks for, but detected: added out of place."""
    g = gen(9)
    x, y = (torch.randn(2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    ix, iy = torch.randint(0, 6, (2, 4), generator=g), torch.randint(0, 6, (2, 2), generator=g)
    w = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    grads = []
    for in_place in (False, True):
        (a, b), rows = gather_rows_through([x, y], [ix, iy], in_place=in_place)
        grads.append(torch.autograd.grad(((a + b) * w).sum() + rows.square().sum(), (x, y)))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
