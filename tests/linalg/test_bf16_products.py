"""One bfloat16 pass for the Gaussian block products of half-type rows where PyTorch
allows bfloat16 products (``torch.set_float32_matmul_precision("medium")``,
``triton_kernels._precision``): which dots take it, and the accuracy it keeps against
float64, outputs and gradients, products and whole calls."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg.kernel_backend import interpreter_on
from skyformer.linalg.triton_kernels import _precision
from tests.devices import devices, relative_error
from tests.linalg.test_kernel_matmul_triton import _product

pytest.importorskip("triton")


@pytest.fixture
def precision():
    """Sets PyTorch's float32 matmul precision for the test, and restores it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def _skip_without_kernels(device):
    if device == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")


@pytest.mark.parametrize("device", devices())
def test_medium_precision_takes_one_bfloat16_pass_for_half_rows_only(precision, device):
    _skip_without_kernels(device)
    suffix = "-interpreted" if interpreter_on() else ""
    on = torch.device(device)
    for setting, half_rows in (("highest", "bf16x3"), ("high", "bf16x3"), ("medium", "bf16")):
        precision(setting)
        for half in (torch.bfloat16, torch.float16):
            assert _precision(torch.float32, half, on) == half_rows + suffix
    precision("medium")  # float32 rows and the Lemma 3 kernels (no rows): one TF32 pass
    assert _precision(torch.float32, torch.float32, on) == "tf32"
    assert _precision(torch.float32) == "tf32"
    assert _precision(torch.float64, torch.bfloat16, on) == "ieee"


def _rows_data(transpose, device):
    g = torch.Generator().manual_seed(11)
    y = torch.randn(2, 70, 64, generator=g).to(torch.bfloat16)
    x = (torch.randn(2, 33, 64, generator=g) * 0.7).to(torch.bfloat16).float()  # x_bf16
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, 70 if transpose else 33, 24, generator=g)
    if transpose:
        rhs = rhs.to(torch.bfloat16)
    return [t.to(device) for t in (y, x, b, rhs)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
def test_one_bfloat16_pass_keeps_the_half_types_accuracy(precision, device, transpose):
    """C Z and C^T V of bfloat16 rows, outputs and gradients, against float64: within a
    few bfloat16 roundings (2^-9 = 2e-3) under "medium", and further from float64 than
    bf16x3 (the dots do round)."""
    _skip_without_kernels(device)
    y, x, b, rhs = _rows_data(transpose, device)
    exact = _product("torch", *(t.double() for t in (y, x, b, rhs)), scale=0.35,
                     transpose=transpose)
    errors = {}
    for setting in ("highest", "medium"):
        precision(setting)
        got = _product("triton", y, x, b, rhs, scale=0.35, transpose=transpose)
        errors[setting] = [relative_error(a, e) for a, e in zip(got, exact, strict=True)]
    for name, three, one in zip(("out", "dy", "dx", "db", "drhs"), errors["highest"],
                                errors["medium"], strict=True):
        assert one < 2e-2, (name, one)
        assert three < 6e-3, (name, three)
    assert sum(errors["medium"]) > 1.2 * sum(errors["highest"])


@pytest.mark.parametrize("device", devices())
def test_skyformer_calls_under_medium_precision(precision, device):
    """A whole Skyformer call on bfloat16 inputs, output and gradients, against the same
    call in float64 (PyTorch path): the bfloat16 tolerance of the method contract."""
    _skip_without_kernels(device)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    key = skyformer.random_key(3)
    precision("medium")

    def call(kernel, dtype, on):
        leaves = [t.to(on, dtype).requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, "skyformer", kernel=kernel, num_features=32,
                                  generator=key)
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    got = call("triton", torch.bfloat16, device)
    for a, e in zip(got, call("torch", torch.float64, "cpu"), strict=True):
        assert relative_error(a, e) < 3e-2
