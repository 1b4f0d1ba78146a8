"""Custom autograd Functions and custom operators called without PyTorch's Python
layers where plain eager code does not need them.

On a GPU an eager call of a fused method is bound by the host below N ~ 8192
(docs/gpu-record.md): the kernels take less time to run than to issue. Two generic layers of
PyTorch cost the host more there than the work they wrap, on every call:

- ``Function.apply`` of a Function with a ``setup_context`` binds its arguments with
  ``inspect.signature`` (about 20 us on a 2-core CPU; the C++ apply underneath, which
  runs ``forward``, ``setup_context`` and records the node, about 4 us);
- a custom operator (``torch.library.custom_op``) passes through the dispatcher, its
  autograd wrapper and dynamo's disable wrapper (about 7 us) to reach its Python
  implementation.

What those layers add is needed only while tracing (``torch.compile``,
``torch.export``, ``torch.jit.trace``), under ``torch.func`` transforms, under a
dispatch or function mode (fake tensors, counters of operations) or for tensor
subclasses. Elsewhere ``apply``
calls the C++ apply with the arguments as given (all of ``forward``'s, so nothing is
left to bind) and ``EagerOperator`` calls the implementation; both take the full path
otherwise, so the results are the same either way (``through_pytorch`` forces the full
path, for tests and ``benchmarks/host_time.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

# The C++ apply under ``Function.apply`` (None if a PyTorch version lacks it: then
# every call takes the full path)
_CPP_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


class _Switch:
    """Whether the direct calls are allowed (``through_pytorch`` turns them off)."""

    direct = True


def untraced_eager() -> bool:
    """Eager code: not tracing (dynamo, ``torch.jit.trace``), no ``torch.func`` transform
    (``torch.compiler.is_compiling`` first: dynamo folds it and the rest is not read)."""
    return not torch.compiler.is_compiling() \
        and not torch._C._are_functorch_transforms_active() \
        and torch._C._get_tracing_state() is None


def plain_eager() -> bool:
    """``untraced_eager`` with the direct calls allowed (``through_pytorch`` turns them
    off): the condition of both direct calls. Also where ``rows.gather_rows_through``
    may add into a gradient in place."""
    return untraced_eager() and _Switch.direct


def plain_tensors(*tensors: Any) -> bool:
    """``_plain_tensors`` of these arguments (None and non-tensors pass)."""
    return _plain_tensors(tensors, {})


def _plain_tensors(args: tuple, kwargs: dict) -> bool:
    """Every tensor argument a plain ``torch.Tensor``, none a functorch wrapper (one
    left over from a finished transform: ``Function.apply`` unwraps those) and none
    batched by the legacy vmap (the gradients of ``autograd.grad(...,
    is_grads_batched=True)``, which only the operator's batching fallback maps)."""
    functorch = torch._C._functorch
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and (type(a) is not Tensor
                                      or functorch.is_functorch_wrapped_tensor(a)
                                      or functorch.is_legacy_batchedtensor(a)):
            return False
    return True


@functools.cache
def _arity(function: type) -> int | None:
    """The number of arguments of ``function.forward`` with a ``setup_context`` (the
    context not among them), or None: one that takes ``*args`` or a context."""
    parameters = inspect.signature(function.forward).parameters.values()
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters):
        return None
    if "setup_context" not in vars(function):
        return None  # forward(ctx, ...): Function.apply binds nothing there
    return len(parameters)


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``; in plain eager code with every argument given (none
    left to a default), the C++ apply without the Python layer's argument binding."""
    if _CPP_APPLY is not None and plain_eager() and len(args) == _arity(function) \
            and _plain_tensors(args, {}):
        return _CPP_APPLY.__get__(None, function)(*args)
    return function.apply(*args)


class EagerOperator:
    """A custom operator (``torch.library.custom_op``, no mutated arguments) that, in
    plain eager code without dispatch or function modes and on plain tensors, calls its
    implementation directly; while PyTorch's profiler runs it is called as the operator,
    so that traces name it. ``op`` is the registered operator (``register_fake``
    registers with it; kernels registered for it later are not used in eager calls)."""

    def __init__(self, name: str, implementation: Callable[..., Any]) -> None:
        self.implementation = implementation
        self.op = torch.library.custom_op(name, mutates_args=())(implementation)
        functools.update_wrapper(self, implementation)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fake)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if plain_eager() and not torch._C._len_torch_dispatch_stack() \
                and not torch._C._is_torch_function_mode_enabled() \
                and not torch._C._autograd._profiler_enabled() \
                and _plain_tensors(args, kwargs):
            return self.implementation(*args, **kwargs)
        return self.op(*args, **kwargs)


def custom_op(name: str) -> Callable[[Callable[..., Any]], EagerOperator]:
    """``torch.library.custom_op(name, mutates_args=())`` as an ``EagerOperator``."""
    return functools.partial(EagerOperator, name)


@contextlib.contextmanager
def through_pytorch() -> Iterator[None]:
    """Every ``apply`` and ``EagerOperator`` call through PyTorch's full path."""
    before, _Switch.direct = _Switch.direct, False
    try:
        yield
    finally:
        _Switch.direct = before
