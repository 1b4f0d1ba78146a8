"""A dispatch mode that records what the operators inside it produce (for tests that
check which tensors a call creates)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
