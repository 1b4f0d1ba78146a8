"""When a computation must be written in plain differentiable operators.

The library's fast paths are custom ``autograd.Function``s (chunked products whose
backward rebuilds the block, the Razavi iteration, the multipole near field), Triton
kernels and SDPA's fused kernels. Two callers cannot use them:

- ``torch.export`` traces through a Function's forward, whose ``out=`` writes into
  preallocated buffers cannot be replayed in the exported graph with grad enabled;
- forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``,
  ``torch.autograd.forward_ad``): the Functions have a hand-written backward only, and
  SDPA's fused kernels (flash, memory-efficient, the CPU flash kernel) have no
  forward-mode derivative.

There the same computation runs as functional operators that autograd differentiates in
both modes (the block formed whole, as a naive reference would), giving the same values
up to rounding. Reverse-mode training, ``torch.compile`` and ``vmap`` keep the fast paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor
from torch.autograd.function import once_differentiable

F = TypeVar("F", bound=Callable[..., Any])


def forward_mode_active() -> bool:
    """Whether forward-mode AD is running: a dual level is open (``torch.func.jvp``,
    ``jacfwd`` and ``hessian`` open one, as ``forward_ad.dual_level`` does). Asked of
    the level rather than of the tensors: inside ``hessian`` (``jacfwd`` over
    ``jacrev``) the tensors a method sees are wrapped by the inner transform and show
    no tangent, yet the outer one differentiates the call forward. (A level opened with
    no tangent in sight also takes the plain path: same values, more memory.) Read
    under ``torch.compile`` too: dynamo guards on it, so ``jvp`` inside a compiled
    function, or a compiled function called under ``jvp``, gets the plain graph. False
    while exporting."""
    if torch.compiler.is_exporting():
        return False
    return forward_ad._current_level >= 0


def functional_ops_only() -> bool:
    """Whether the fast paths must give way to plain operators (module docstring):
    under ``torch.export`` or forward-mode AD."""
    return torch.compiler.is_exporting() or forward_mode_active()


def no_derivatives(fn: F) -> F:
    """``torch.no_grad()`` for both modes: ``fn`` runs without autograd on detached
    tensor arguments. ``no_grad`` alone stops reverse mode only: a tangent carried by
    an argument still reaches the result (e.g. sampling probabilities that reverse mode
    treats as constants would get a forward-mode derivative)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def first_order_backward(backward: F) -> F:
    """``once_differentiable`` for the ``backward`` of a custom ``autograd.Function``
    whose gradient is not itself differentiable, refusing in a sentence what it lets
    through: a differentiable backward of plain autograd (``create_graph=True``:
    ``torch.autograd.functional.hessian`` / ``hvp``, gradient penalties). There
    ``once_differentiable`` returns a gradient that silently drops its dependence on
    the saved inputs. Under ``torch.func`` transforms (tensors wrapped by functorch)
    ``once_differentiable`` is left to itself: ``torch.func.grad`` runs every backward
    with grad mode on, and a second reverse pass raises there."""
    once = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        tensors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not any(
                torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            raise RuntimeError(
                "skyformer: this attention's fused backward pass is not differentiable "
                "(create_graph=True, as torch.autograd.functional.hessian / hvp use). "
                "For second derivatives use forward-over-reverse: torch.func.hessian, or "
                "torch.func.jvp of torch.func.grad; they take plain differentiable "
                "operators.")
        return once(ctx, *grads)

    return wrapper  # type: ignore[return-value]
