"""Gradients batched by the legacy vmap (``autograd.grad(..., is_grads_batched=True)``,
``autograd.functional.jacobian(..., vectorize=True)``) through the fused backward passes
of the PyTorch path (``first_order_backward`` in ``linalg/functional_ops.py``): the batch
is unwrapped and folded into the batch dim, on CUDA too, where autograd runs backward
passes on threads of its own. Every method on the CPU: ``tests/pt2/test_stack_matrix.py``."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg.functional_ops import _NESTED_LEGACY_BATCH
from tests.devices import devices

# The methods whose backward passes are the PyTorch path's fused Functions
FUSED = ("skyformer", "nystrom_softmax", "skyformer_adaptive", "nystromformer")


def _call(method, q, k, v, mask=None):
    options = {"num_features": 4, "generator": skyformer.random_key(5)}
    if method != "nystromformer":
        options["kernel"] = "torch"
    return skyformer.attention(q, k, v, method, key_padding_mask=mask, **options)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", FUSED)
def test_batched_gradients_are_each_gradient(device, method):
    """Each of three cotangents' gradients, with key padding: equal to one
    ``autograd.grad`` call per cotangent."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64).to(device)
               .requires_grad_(True) for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.bool, device=device)
    mask[1, 19:] = False
    out = _call(method, q, k, v, mask)
    cotangents = torch.randn(3, *out.shape, generator=g, dtype=torch.float64).to(device)
    batched = torch.autograd.grad(out, (q, k, v), cotangents, is_grads_batched=True,
                                  retain_graph=True)
    for i, cotangent in enumerate(cotangents):
        each = torch.autograd.grad(out, (q, k, v), cotangent, retain_graph=True)
        for got, want in zip(batched, each, strict=True):
            torch.testing.assert_close(got[i], want)


def test_gradients_batched_twice_are_refused_in_a_sentence():
    """A legacy vmap around ``is_grads_batched`` batches the gradients at two levels,
    which the unwrapping cannot fold: a sentence naming ``torch.func``, never a wrong
    number."""
    q, k, v = (torch.randn(1, 1, 16, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = _call("skyformer", q, k, v)

    def gradients(cotangents):
        return torch.autograd.grad(out, q, cotangents, is_grads_batched=True,
                                   retain_graph=True)[0]

    from torch._vmap_internals import _vmap

    with pytest.raises(RuntimeError, match=r"torch\.func\.vmap") as error:
        _vmap(gradients)(torch.randn(2, 3, *out.shape, dtype=torch.float64))
    assert str(error.value) == _NESTED_LEGACY_BATCH


def test_batched_gradients_with_create_graph_are_refused_as_unbatched_ones_are():
    """``create_graph=True`` asks for a differentiable backward, which the fused passes
    are not: the same sentence as without the batch, before any unwrapping."""
    q, k, v = (torch.randn(1, 1, 16, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = _call("skyformer", q, k, v)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(out, q, torch.randn(2, *out.shape, dtype=torch.float64),
                            is_grads_batched=True, create_graph=True)


def test_the_level_is_found_on_the_gradients_where_the_thread_does_not_show_it(
        monkeypatch):
    """On CUDA, autograd runs backward passes on threads of its own, where the legacy
    vmap's open level does not reach (the thread shows none): the level is then found
    on the gradients. Simulated on the CPU: the vmap's nesting counter left at zero."""
    q, k, v = (torch.randn(1, 2, 16, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = _call("skyformer", q, k, v)
    cotangents = torch.randn(3, *out.shape, dtype=torch.float64)
    want = [torch.autograd.grad(out, q, c, retain_graph=True)[0] for c in cotangents]
    monkeypatch.setattr(torch._C, "_vmapmode_increment_nesting", lambda: 1)
    monkeypatch.setattr(torch._C, "_vmapmode_decrement_nesting", lambda: 0)
    got = torch.autograd.grad(out, q, cotangents, is_grads_batched=True, retain_graph=True)[0]
    torch.testing.assert_close(got, torch.stack(want))
