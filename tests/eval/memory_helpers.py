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


def kernelized_call(shape: list[int], padded: bool, causal: bool, fold: bool = False):
    """A ``CallJob`` setup: exact kernelized attention of random float32 inputs of
    ``shape`` [B, H, N, D], the last 100 keys padded if ``padded``: the SDPA augmentation,
    or with ``fold`` SDPA at head dim D (``fold_key_norms``)."""
    import skyformer

    b, _, n, _ = shape
    q, k, v = (torch.randn(*shape) for _ in range(3))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[:, -100:] = False
    return lambda: skyformer.attention(q, k, v, "kernelized", causal=causal,
                                       key_padding_mask=mask if padded else None,
                                       fold_key_norms=fold)


def method_call(method: str):
    """A ``CallJob`` setup: ``method`` (a registered name) on small random inputs."""
    import skyformer

    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    return lambda: skyformer.attention(q, k, v, method)


def scaled_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``2 v``: its forward pass holds one output-sized buffer (the output) and its
    backward pass one more (v's gradient), so the peak of forward + backward above the
    inputs and the output gradient is two outputs' size."""
    return v * 2


def holds_twenty_mib_if_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hold a 20 MiB buffer when a key padding mask is passed: a peak that tells whether
    the measured call got the mask."""
    if key_padding_mask is None:
        return v.clone()
    held = torch.ones(20 * MIB // 4)
    return v + held[:1]
