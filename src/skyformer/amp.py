"""``torch.autocast`` state for any device type: torch raises for a device type that
autocast does not know (``meta``, where a model's shapes are traced or its flops
counted) instead of answering that autocast is off there."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``; False where autocast is unknown."""
    return torch.amp.is_autocast_available(device_type) \
        and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> AbstractContextManager:
    """A context turning autocast off on ``device_type`` (nothing where it is unknown)."""
    if not torch.amp.is_autocast_available(device_type):
        return nullcontext()
    return torch.autocast(device_type, enabled=False)
