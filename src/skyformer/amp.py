"""``torch.autocast`` state for any device type: torch raises for a device type that
autocast does not know (``meta``, where a model's shapes are traced or its flops
counted) instead of answering that autocast is off there.

Which device types autocast knows is read once, at import: ``torch.compile`` (dynamo)
of torch 2.11 cannot trace ``torch.amp.is_autocast_available`` (a C++ builtin it
skips), so a compiled call with ``fullgraph=True`` failed at its first line and
without it broke its graph there; a set's membership traces as a constant."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])


def _known_device_types() -> frozenset[str]:
    candidates = {"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia",
                  torch._C._get_privateuse1_backend_name()}
    known = set()
    for device_type in candidates:
        try:
            if torch.amp.is_autocast_available(device_type):
                known.add(device_type)
        except RuntimeError:  # a device type this build of torch does not parse
            pass
    return frozenset(known)


AUTOCAST_DEVICE_TYPES = _known_device_types()


def autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available(device_type)``, traceable by ``torch.compile``."""
    return device_type in AUTOCAST_DEVICE_TYPES


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``; False where autocast is unknown."""
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> AbstractContextManager:
    """A context turning autocast off on ``device_type`` (nothing where it is unknown)."""
    if not autocast_available(device_type):
        return nullcontext()
    return torch.autocast(device_type, enabled=False)


def outside_autocast(backward: F) -> F:
    """Run a custom ``autograd.Function``'s ``backward(ctx, *grads)`` with autocast off
    on its first gradient's device, as eager autograd runs it after ``loss.backward()``
    outside the ``torch.autocast`` block. ``torch.compile`` traces the backward under
    the forward's autocast state instead: there the backward's products came out in
    the autocast dtype and its float32 accumulations (``baddbmm_`` into a float32
    buffer) failed to compile. The methods' forward passes already run with autocast
    off (``registry.autocast``); their backward passes now match."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        # unconditionally: under torch.compile the state read here is the forward's
        # (autocast off), not the one the backward graph is later traced under; one
        # `with` (dynamo traces no ExitStack of autocast contexts)
        device = next((g.device.type for g in grads if isinstance(g, Tensor)), "cpu")
        with autocast_off(device):
            return backward(ctx, *grads)

    return wrapper  # type: ignore[return-value]


def warn_if_compiled_backward_casts(*tensors: Any) -> None:
    """Warn, while ``torch.compile`` traces a call under ``torch.autocast`` that will be
    differentiated, when PyTorch is set to trace its backward pass under the forward's
    autocast state (``torch._functorch.config.backward_pass_autocast`` =
    ``"same_as_forward"``, the default up to at least torch 2.13). The methods run their
    forward with autocast off and keep steps in float32 there; in that compiled backward
    pass PyTorch's own derivatives of those steps run in the autocast dtype, unlike in
    eager mode where ``loss.backward()`` runs after the autocast block (at N = 512, D =
    32 in bfloat16: Nystromformer's gradients 8.7 % from float32 instead of 0.4 %).
    ``"off"`` (eager's semantics) makes compiled gradients equal eager ones. The check
    runs once per traced graph (``comptime``), never per call, and not for a method
    whose config says ``FLOAT32_STEPS = False`` (its compiled gradients equal eager ones
    under either setting: ``benchmarks/compiled_autocast.py``)."""
    if not torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    if not any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        return
    from torch._dynamo.comptime import comptime

    comptime(lambda _: _warn_backward_autocast())


def _warn_backward_autocast() -> None:
    import torch._functorch.config as functorch_config

    if getattr(functorch_config, "backward_pass_autocast", "off") == "same_as_forward":
        warnings.warn(
            "skyformer: this call is compiled under torch.autocast and will be "
            "differentiated, and torch.compile traces its backward pass under the forward's "
            "autocast (torch._functorch.config.backward_pass_autocast = 'same_as_forward'): "
            "the float32 steps of an approximate method (normalisers, Nystrom cores) then "
            "take their gradients in the autocast dtype, further from float32 than in eager "
            "mode. Set "
            "torch._functorch.config.backward_pass_autocast = 'off' before compiling (eager's "
            "behaviour, with loss.backward() run after the autocast block) for gradients "
            "equal to eager ones.", stacklevel=2)
