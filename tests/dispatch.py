"""A dispatch mode that records what the operators inside it produce (for tests that
check which tensors a call creates)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class Recorder(TorchDispatchMode):
    """Runs every operator and keeps ``record(func, args, out)`` where it is not None."""

    def __init__(self, record: Callable[[Any, tuple, Any], Any]):
        super().__init__()
        self.record = record
        self.items: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        item = self.record(func, args, out)
        if item is not None:
            self.items.append(item)
        return out


def large_outputs(elements: int) -> Recorder:
    """A ``Recorder`` of the operators that produce a tensor of at least ``elements``
    entries (their names): a call that keeps to O(N m) records none at N * N / 8."""
    return Recorder(lambda func, args, out: func.name() if isinstance(out, Tensor)
                    and out.numel() >= elements else None)


def check_lean_and_equal(call: Callable[..., Tensor], reference: Callable[..., Tensor],
                         leaves: list[Tensor], elements: int, **tolerances: float) -> None:
    """``call(*leaves)`` and the gradients of ``out.sin().sum()`` produce no tensor of
    ``elements`` entries or more (``large_outputs``) and equal ``reference``'s."""
    import torch

    with large_outputs(elements) as big:
        out = call(*leaves)
        grads = torch.autograd.grad(out.sin().sum(), leaves)
    assert big.items == [], big.items
    want = reference(*leaves)
    torch.testing.assert_close(out, want, **tolerances)
    for got, expected in zip(grads, torch.autograd.grad(want.sin().sum(), leaves), strict=True):
        torch.testing.assert_close(got, expected, **tolerances)
