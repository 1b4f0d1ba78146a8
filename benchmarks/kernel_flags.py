"""The library's opt-in kernel switches, set for one measurement.

``kernel_matmul_triton.ONE_PASS_BACKWARD`` (the products' backward pass in one pass over
the rows) and ``triton_kernels.ROWS_ONE_BF16_PASS`` (the rows kernel's value products in
one bfloat16 pass) are module constants, off by default, which the benchmarks turn on
around the calls they time; ``two_nodes.TWO_NODES`` (Skyformer's eager call as two
autograd node) is on by default, and they turn it off (``composed``); ``tf32`` allows TF32
for float32 matmuls, which the kernels read at each launch, backward ones included."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch


class switched:
    """Inside: ``module.name`` set to ``on`` or left as it is set (``on=False``), unless
    ``force``: then exactly ``on``. Restored on the way out."""

    def __init__(self, module: str, name: str, on: bool, force: bool = False):
        self.module, self.name = importlib.import_module(module), name
        self.on, self.force = on, force

    def __enter__(self):
        self.before = getattr(self.module, self.name)
        setattr(self.module, self.name, self.on or (self.before and not self.force))

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.before)


def one_pass_backward(on: bool, force: bool = False) -> switched:
    """The products' backward pass in one pass over the rows
    (``kernel_matmul_triton.ONE_PASS_BACKWARD``, ``linalg/triton_one_pass.py``)."""
    return switched("skyformer.linalg.kernel_matmul_triton", "ONE_PASS_BACKWARD", on, force)


def rows_one_bf16_pass(on: bool, force: bool = False) -> switched:
    """The rows kernel's value products in one bfloat16 pass for half-type rows
    (``triton_kernels.ROWS_ONE_BF16_PASS``)."""
    return switched("skyformer.linalg.triton_kernels", "ROWS_ONE_BF16_PASS", on, force)


def composed(on: bool) -> switched:
    """Skyformer's eager call composed of its Functions, not as its two hand-chained autograd nodes
    (``ops/skyformer/two_nodes.py``, ``TWO_NODES`` off) where ``on``."""
    return switched("skyformer.ops.skyformer.two_nodes", "TWO_NODES", not on, force=True)


@contextmanager
def tf32(on: bool):
    """TF32 allowed for float32 matmuls (the kernels' float32 dots in one TF32 pass, not
    three) where ``on``, for the forward and backward launches inside alike; nothing
    touched otherwise. Through the per-backend setting where torch has it
    (``triton_kernels.tf32_allowed`` reads it first): the legacy
    ``get_float32_matmul_precision`` raises once a program has set that one."""
    if not on:
        yield
        return
    matmul = torch.backends.cuda.matmul
    if getattr(matmul, "fp32_precision", None) is None:  # a torch before the setting
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before
