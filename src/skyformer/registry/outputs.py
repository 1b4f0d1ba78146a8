"""What a method registered from outside the library must return, checked where its
core returns: ``[B, H, Nq, Dv]`` (q's leading dims, v's last) in q's dtype, on q's device.

The library's own methods are tested to return that; a plugin that returns the wrong
number of rows would otherwise reach a ``MultiHeadAttention`` layer's output silently
(``[B, Nq', dim]``), and one that returns another dtype or a transposed tensor would
fail later in torch's internals, far from its cause.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def check_output(core: Callable[..., Any], out: Any, q: Tensor, v: Any,
                 autocast: bool = False) -> Tensor:
    """``out`` where it is what a call of ``core`` on ``q`` and ``v`` must return (module
    docstring), else a ``TypeError`` naming the core, what it returned and what it must;
    ``autocast``: the caller's ``torch.autocast`` cast the inputs to ``q``'s dtype."""
    if not isinstance(v, Tensor):  # a call form the check does not know: left as it is
        return out
    name = _named(core)
    expected = (*q.shape[:-1], v.shape[-1])
    if not isinstance(out, Tensor):
        raise TypeError(f"the attention method {name} returned a {type(out).__name__}; a "
                        f"method returns one tensor [B, H, Nq, Dv] = {list(expected)}.")
    if tuple(out.shape) != expected or out.dtype != q.dtype:
        cast = (f"; torch.autocast cast the inputs to {_dtype(q.dtype)}, so that is the dtype "
                f"to return (the library runs the method with autocast off)"
                if out.dtype != q.dtype and autocast else "")
        raise TypeError(
            f"the attention method {name} returned a {_dtype(out.dtype)} tensor of shape "
            f"{list(out.shape)} for q of shape {list(q.shape)} and v of shape "
            f"{list(v.shape)}; a method returns [B, H, Nq, Dv] = {list(expected)} in q's "
            f"dtype ({_dtype(q.dtype)}){cast}.")
    if out.device != q.device:
        raise TypeError(f"the attention method {name} returned a tensor on {out.device} for "
                        f"q on {q.device}; a method returns its output on the inputs' "
                        f"device (make new tensors with device=q.device).")
    return out


def _named(core: Callable[..., Any]) -> str:
    """``'name' (module.function)``: the registered name and where its core is defined."""
    names = registered_names(core)
    where = _where(core)
    return f"{' or '.join(map(repr, names))} ({where})" if names else where


def registered_name(core: Callable[..., Any]) -> str:
    """The name ``core`` is registered under (``module.function`` where none; ``a or
    b`` where one function is registered under two names: a call does not say which
    it was)."""
    return " or ".join(registered_names(core)) or _where(core)


def registered_names(core: Callable[..., Any]) -> list[str]:
    """The names ``core`` is registered under, in registration order."""
    from .methods import _REGISTRY  # it imports this module (through autocast)

    # a method registered with its options as keyword arguments runs an adapter
    # (signature.core_of), which unwraps to the function; over a copy (one C call,
    # which no thread interrupts): a method registered in another thread meanwhile
    # would end the iteration of the dict itself
    return [m.name for m in tuple(_REGISTRY.values())
            if inspect.unwrap(m.core) is inspect.unwrap(core)]


def _where(core: Callable[..., Any]) -> str:
    """``module.function`` of ``core``."""
    return f"{getattr(core, '__module__', '?')}.{getattr(core, '__qualname__', repr(core))}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
