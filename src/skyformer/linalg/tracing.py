"""Whether a method may look at tensor values to choose a branch or a shape.

Eager code can read a value (``bool(mask.all())``, a block count) to skip work or
allocate less. ``torch.compile``, tracers and ``torch.func`` transforms cannot: a compiled
or traced graph must not depend on the data, and a functorch-wrapped tensor (vmap,
grad) has no single value. Methods ask ``may_read_values`` and take the
data-independent path (a bound, an unconditional mask) when the answer is no; both
paths give the same result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .functional_ops import exporting


def may_read_values(*tensors: Tensor) -> bool:
    """False under ``torch.compile``, ``torch.jit.trace`` and ``make_fx`` (proxy or fake
    tensors: ``torch.export`` too), or when any tensor is wrapped by a ``torch.func``
    transform or is on the meta device (shapes without values). A tracer records
    operators only: a value read there would be baked into the graph, and a raw Triton
    launch (the landmark draws) would not be recorded."""
    if _recorded():
        return False
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) or t.is_meta
                   for t in tensors)


def values_to_check(t: Tensor) -> Tensor | None:
    """The values behind ``t`` where a check may read them without the result depending
    on them: ``t`` in eager code; under ``torch.func`` transforms the tensor the
    transforms wrap (under ``vmap`` every mapped slice at once), which a check of every
    entry may read although no branch may; None under ``torch.compile``, tracers and on
    the meta device."""
    if _recorded():
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return None if t.is_meta else t


def _recorded() -> bool:
    """Whether a tracer records this code (``torch.compile``, ``torch.jit.trace``,
    ``make_fx`` and ``torch.export``): operators only, no values."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or _tracing_mode_active()


def strides_hold() -> bool:
    """Whether every later run of this code sees the strides its inputs have now: in
    eager code, and under ``torch.compile``, which guards on them (another layout
    recompiles). Not in a program recorded once (``torch.export``, ``torch.jit.trace``,
    ``make_fx``): it keeps operators, not strides, and runs inputs of any layout, so a
    choice read from a stride there would be applied to other inputs."""
    if exporting() or torch.jit.is_tracing():
        return False
    return torch.compiler.is_compiling() or not _tracing_mode_active()


def _tracing_mode_active() -> bool:
    """Whether a ``make_fx``-style tracer (proxy tensors) or fake tensors are active."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.PROXY, keys.FAKE))
