"""``normalised_or``: the fused Function against the plain operators it replaces."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from skyformer.ops.shared import normalised
from skyformer.ops.shared.normalised import normalised_or
from tests.conftest import gen
from tests.dispatch import Recorder


def _plain(numerator, denominator, fallback, usable=None):
    """The formula as plain operators (the path forward-mode AD takes)."""
    with mock.patch.object(normalised, "functional_ops_only", lambda: True):
        return normalised_or(numerator, denominator, fallback, usable)


def _inputs(fallback_rows: int, dtype=torch.float64):
    g = gen(7)
    num = torch.randn(2, 3, 9, 5, generator=g, dtype=dtype)
    den = torch.rand(2, 3, 9, 1, generator=g, dtype=dtype) + 0.1
    den[0, 0, 2] = 1e-200 if dtype == torch.float64 else 0.0  # below sqrt(tiny)
    den[1, 2, 4] = -0.5
    num[0, 0, 2] = float("inf")  # an overflowed numerator on a fallback row
    fallback = torch.randn(2, 3, fallback_rows, 5, generator=g, dtype=dtype)
    usable = torch.rand(2, 3, 9, 1, generator=g) > 0.2
    return [t.requires_grad_(True) for t in (num, den, fallback)], usable


@pytest.mark.parametrize("fallback_rows", [1, 9])
@pytest.mark.parametrize("with_usable", [False, True])
def test_values_and_gradients_are_the_plain_formulas(fallback_rows, with_usable):
    (num, den, fallback), usable = _inputs(fallback_rows)
    usable = usable if with_usable else None
    weights = torch.randn(2, 3, 9, 5, generator=gen(8), dtype=torch.float64)
    got = normalised_or(num, den, fallback, usable)
    want = _plain(num, den, fallback, usable)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads = torch.autograd.grad((got * weights).sum(), (num, den, fallback))
    plain = torch.autograd.grad((want * weights).sum(), (num, den, fallback))
    for a, e in zip(grads, plain, strict=True):
        assert a.isfinite().all()  # the inf numerator's row gives zero gradients
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_second_derivatives_and_vmap():
    (num, den, fallback), usable = _inputs(1)
    num = num.detach().clone()
    num[0, 0, 2] = 1.0  # gradcheck perturbs every entry: keep them finite
    den = den.detach().clone()
    den[0, 0, 2] = 1e-3  # and away from the usability threshold
    leaves = [t.detach().requires_grad_(True) for t in (num, den, fallback)]
    assert torch.autograd.gradcheck(lambda *t: normalised_or(*t, usable), leaves)
    assert torch.autograd.gradgradcheck(lambda *t: normalised_or(*t, usable), leaves)
    per_sample = torch.func.vmap(torch.func.grad(
        lambda n, d, f: normalised_or(n, d, f).square().sum()))(num, den, fallback)
    for i in range(2):
        want = torch.autograd.grad(_plain(*(t[i:i + 1] for t in leaves)).square().sum(),
                                   leaves)
        torch.testing.assert_close(per_sample[i], want[0][i])


def test_the_backward_pass_forms_two_tensors_of_the_numerators_size():
    """Autograd's backward of the plain formulas formed six (the masked gradient, the
    quotient's partial derivatives and their products); the fused one forms the
    numerator's gradient, the product for the denominator's and the selection for the
    fallback's."""
    (num, den, fallback), _ = _inputs(1, torch.float32)
    size = num.numel()

    views = {"expand", "detach", "view", "_unsafe_view", "reshape", "transpose", "t",
             "permute", "alias", "slice", "select", "unsqueeze", "squeeze", "as_strided"}

    def big(func, args, out):  # a new tensor of the numerator's size (or more)
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and not name.endswith("_") and name not in views \
                and out.numel() >= size:
            return name
        return None

    counts = []
    for run in (normalised_or, _plain):
        out = run(num, den, fallback)
        with Recorder(big) as recorded:
            torch.autograd.grad(out.sum(), (num, den, fallback))
        counts.append(len(recorded.items))
    assert counts[0] == 3 and counts[1] >= 6


def test_the_backward_pass_keeps_the_inputs_dtypes_under_autocast_and_nan_to_its_row():
    """A float32 model whose backward pass runs under autocast gets float32 gradients
    (the products for the denominator and the fallback would run in bfloat16), and a
    NaN in the incoming gradient of a usable row stays out of the fallback's gradient."""
    (num, den, fallback), _ = _inputs(1, torch.float32)
    weights = torch.randn(2, 3, 9, 5, generator=gen(3))
    weights[1, 1, 1, 0] = float("nan")  # row 1 is usable
    want = torch.autograd.grad((_plain(num, den, fallback) * weights).sum(),
                               (num, den, fallback))
    out = normalised_or(num, den, fallback)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad((out * weights).sum(), (num, den, fallback))
    for a, e in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert got[2].isfinite().all()


def test_a_denominator_sliced_from_a_product_does_not_keep_the_product_alive():
    """The denominator is saved for the backward pass; as the last column of a product
    ``[..., Dv + 1]`` (``numerator_and_denominator``) it would hold the whole product
    until then, as large as the output: a copy of the column is saved instead, and the
    gradient still reaches the product."""
    (num, den, fallback), _ = _inputs(1)
    product = torch.cat([num.detach(), den.detach()], dim=-1).requires_grad_(True)
    numerator, denominator = normalised.numerator_and_denominator(product * 1.0)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = normalised_or(numerator, denominator, fallback)
    assert saved and max(saved) <= out.untyped_storage().nbytes()
    weights = torch.randn(out.shape, generator=gen(3), dtype=out.dtype)
    (grad,) = torch.autograd.grad((out * weights).sum(), product)
    want = torch.autograd.grad((_plain(*normalised.numerator_and_denominator(product),
                                       fallback) * weights).sum(), product)[0]
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_the_forward_pass_forms_one_tensor_of_the_outputs_size():
    """The selection is written into the quotient (where(..., out=quotient)): one tensor
    of the output's size, not two (the peak of a long inference call); allocations
    counted by the profiler (a dispatch mode would turn the writing in place off)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    (num, den, fallback), _ = _inputs(1, torch.float32)
    num, den, fallback = (t.detach() for t in (num, den, fallback))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = normalised_or(num, den, fallback)
    sizes, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            sizes.append(node.extra_fields.alloc_size)
        nodes.extend(node.children)
    assert sum(size >= num.numel() * 4 for size in sizes) == 1, sizes
    assert got.untyped_storage().data_ptr() != num.untyped_storage().data_ptr()
    torch.testing.assert_close(got, _plain(num, den, fallback), rtol=0, atol=0)


@pytest.mark.parametrize("save", ["every operator", "div"])
def test_selective_checkpointing_gets_the_quotient_back_unchanged(save):
    """Selective checkpointing keeps the outputs of the operators its policy saves and
    hands them back in its recomputation: under its dispatch mode the selection is not
    written into the quotient."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    (num, den, fallback), _ = _inputs(1)
    num = num.detach().clone()
    num[0, 0, 2] = 1.0
    leaves = [t.detach().requires_grad_(True) for t in (num, den, fallback)]

    def policy(ctx, op, *args, **kwargs):
        keep = save == "every operator" or op == torch.ops.aten.div.Tensor
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    want = torch.autograd.grad(normalised_or(*leaves).square().sum(), leaves)
    out = checkpoint(normalised_or, *leaves, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(policy))
    for got, expected in zip(torch.autograd.grad(out.square().sum(), leaves), want,
                             strict=True):
        torch.testing.assert_close(got, expected)
