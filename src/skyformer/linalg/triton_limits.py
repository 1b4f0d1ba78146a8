"""Launches of the product kernels (and of exact kernelized attention's flash kernels)
that a GPU's resources cannot hold, told apart from the kernels' other failures.

A kernel compiled for wide tiles can need more shared memory a block than a GPU has:
``nystrom_softmax`` in float32 with value width 128 (129 with its ones column, padded to
256) needs 112 KiB in one backward launch, where RTX 30xx/40xx and L4 GPUs allow 99;
width 256 (padded to 512) needs up to 224, more than an A100's 163 (compiled with
Triton 3.9, ``benchmarks/results/triton_resources_shared_memory/``). Triton refuses such a launch
(``OutOfResources``). Those shapes then take the PyTorch path under ``"auto"``, one
warning a kernel configuration, while every other shape on that GPU keeps the
kernels; ``KernelFallback`` would otherwise take the refusal for the kernel's own
failure and send every call of the dtype on that device to PyTorch. ``"triton"``
raises ``KernelTooLarge`` with a sentence. The flash kernels in float32 at head dim 512
need 192 KiB in their key-gradient launch (compiled for sm_90 by
``benchmarks/triton_resources.py --methods kernelized --configs 512:float32``,
``results/triton_resources_flash_d512.md``): an H100's 227 hold it, an A100's 163 do
not.

This module imports Triton (the kernels' modules import it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from triton.runtime.errors import OutOfResources

from .kernel_backend import KernelTooLarge

# (kernel, device, tensor dtypes, compile-time options) -> the sentence of a launch that
# did not fit; empty until one did not (a launch asks nothing of it until then)
_TOO_LARGE: dict[tuple, str] = {}


def launch_within_limits(kernel: Any, grid: tuple, args: tuple, options: dict[str, Any],
                         name: str) -> None:
    """``kernel[grid](*args, **options)``, or ``KernelTooLarge`` where the GPU cannot
    hold the kernel compiled for ``options`` (its tiles), now or at an earlier launch
    of the same configuration (``first`` says which: the caller warns once)."""
    if _TOO_LARGE:
        sentence = _TOO_LARGE.get(_configuration(name, args, options))
        if sentence is not None:
            raise KernelTooLarge(sentence, first=False)
    try:
        kernel[grid](*args, **options)
    except OutOfResources as error:
        sentence = _sentence(name, args, options, error)
        _TOO_LARGE[_configuration(name, args, options)] = sentence
        raise KernelTooLarge(sentence, first=True) from error


def _configuration(name: str, args: tuple, options: dict[str, Any]) -> tuple:
    """What the compiled kernel depends on: its tensors' dtypes and device, its
    compile-time options (tiles, flags, warps)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    return (name, tensors[0].device, tuple(t.dtype for t in tensors),
            tuple(sorted((key, repr(value)) for key, value in options.items())))


def _sentence(name: str, args: tuple, options: dict[str, Any], error: OutOfResources) -> str:
    device = next(a.device for a in args if isinstance(a, Tensor))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    unit = 1024 if "memory" in str(error.name) else 1
    amounts = (f"{error.required / unit:.0f} KiB", f"{error.limit / unit:.0f} KiB") \
        if unit > 1 else (str(error.required), str(error.limit))
    width = options.get("BLOCK_R", options.get("BLOCK_DV"))  # products' or flash kernels'
    return (f"the Triton {name} kernel for these shapes (tiles of head dim "
            f"{options.get('BLOCK_D')} and value width {width}, "
            f"{args[0].dtype} rows) needs {amounts[0]} of {error.name} a block, more than "
            f"the {amounts[1]} of {gpu} ({device})")
