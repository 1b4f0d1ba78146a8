"""``torch.autocast`` state for any device type: torch raises for a device type that
autocast does not know (``meta``, where a model's shapes are traced or its flops
counted) instead of answering that autocast is off there.

Which device types autocast knows is read once, at import: ``torch.compile`` (dynamo)
of torch 2.11 cannot trace ``torch.amp.is_autocast_available`` (a C++ builtin it
skips), so a compiled call with ``fullgraph=True`` failed at its first line and
without it broke its graph there; a set's membership traces as a constant."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


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
