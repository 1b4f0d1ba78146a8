"""Functions for memory-measurement tests, importable as ``tests.eval.memory_helpers:<name>``."""

from __future__ import annotations

import torch

MIB = 2**20


def free_one_then_hold_two(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Allocate and free 30 MiB, then hold two 20 MiB buffers at once: a true peak of
    40 MiB above the inputs, whatever the allocator kept from an earlier call."""
    a = torch.ones(30 * MIB // 4)
    del a
    b = torch.ones(20 * MIB // 4)
    c = torch.ones(20 * MIB // 4)
    out = v + (b[:1] + c[:1])
    del b, c
    return out
