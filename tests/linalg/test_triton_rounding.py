"""Conversions to bfloat16 inside the Triton kernels round to nearest, ties to even, as a
GPU's do, under the interpreter too (``linalg/triton_rounding.py``; the interpreter's own
conversion truncates): ``to_dtype`` bit for bit against PyTorch's conversion, and the
kernels' half-type results without truncation's bias toward zero."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg.kernel_backend import interpreter_on
from tests.devices import devices

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from skyformer.linalg.triton_rounding import to_dtype  # noqa: E402  (imports Triton)


@pytest.fixture(autouse=True)
def _kernels_run_here(request):
    callspec = getattr(request.node, "callspec", None)
    if (callspec is None or callspec.params.get("device") == "cpu") and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")


@triton.jit
def _convert_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(OUT + offsets, to_dtype(tl.load(X + offsets, mask=inside), OUT.dtype.element_ty),
             mask=inside)


def _hard_cases() -> torch.Tensor:
    """Float32 numbers whose rounding to bfloat16 is easy to get wrong: exact ties both
    ways (even and odd last kept bit), one bit past and short of a tie, the largest
    finite numbers (some round to inf), subnormals, signed zeros, inf and NaN."""
    kept = torch.tensor([0x3F80, 0x3F81, 0x4049, 0xC2F7, 0x0001, 0x7F7F], dtype=torch.int32)
    low = torch.tensor([0x8000, 0x8001, 0x7FFF, 0xFFFF, 0x0001], dtype=torch.int32)
    bits = (kept[:, None] << 16 | low[None, :]).flatten()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38,
                            1e-40, -1e-40, 1.17e-38])
    return torch.cat([bits.view(torch.float32), special])


@pytest.mark.parametrize("device", devices())
def test_to_dtype_rounds_as_pytorch_converts(device):
    """Every float32 number of a sample (random of many scales, and ``_hard_cases``)
    converts to the same bfloat16 bits as ``Tensor.to``; NaN stays NaN. Truncation
    differs on about half the random ones."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4000, generator=g) * torch.logspace(-30, 30, 4000)
    x = torch.cat([values, _hard_cases(), torch.tensor([float("nan")])]).to(device)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _convert_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    assert torch.isnan(out[-1])
    assert torch.equal(out[:-1].view(torch.int16), expected[:-1].view(torch.int16))


@pytest.mark.parametrize("method, one_pass", [("skyformer", False), ("skyformer", True),
                                              ("kernelized", False)])
@pytest.mark.parametrize("device", devices())
def test_half_results_have_no_bias_toward_zero(device, method, one_pass, monkeypatch):
    """Skyformer (the rows kernel's stores, and with ``one_pass`` the one-pass backward
    kernel's) and exact kernelized attention (the flash kernels' weight tiles and
    stores) on bfloat16 inputs, Triton path: the mean of (|got| - |exact|) / |exact|
    over the output's and the gradients' entries, against float64 on the same inputs.
    Rounded to nearest it is within 5e-4 here; truncated, as the interpreter's own
    conversion does, -2.6e-3 to -5.8e-3."""
    from skyformer.linalg import kernel_matmul_triton, triton_one_pass

    one_pass_calls = []
    if one_pass:
        monkeypatch.setattr(kernel_matmul_triton, "ONE_PASS_BACKWARD", True)
        launch = triton_one_pass.one_pass_product

        def counted(*args, **kwargs):
            one_pass_calls.append(1)
            return launch(*args, **kwargs)

        monkeypatch.setattr(triton_one_pass, "one_pass_product", counted)
    g = torch.Generator().manual_seed(0)
    q, k, v, weights = (torch.randn(1, 2, 96, 32, generator=g, dtype=torch.float64)
                        for _ in range(4))
    results = []
    for dtype, where, kernel in ((torch.float64, "cpu", "torch"),
                                 (torch.bfloat16, device, "triton")):
        leaves = [t.to(torch.bfloat16).to(where, dtype).requires_grad_(True)
                  for t in (q, k, v)]
        options = {} if method == "kernelized" else {
            "num_features": 16, "generator": skyformer.random_key(0, device=where)}
        out = skyformer.attention(*leaves, method, kernel=kernel, **options)
        grads = torch.autograd.grad((out.double() * weights.to(where)).sum(), leaves)
        results.append([t.detach().double().cpu() for t in (out, *grads)])
    assert bool(one_pass_calls) == one_pass  # the backward pass took the one-pass kernel
    exact, triton_path = results
    for name, got, want in zip(("out", "dq", "dk", "dv"), triton_path, exact, strict=True):
        large = want.abs() > 1e-3 * want.abs().max()  # relative errors that mean something
        bias = ((got.abs() - want.abs()) / want.abs())[large].mean().item()
        assert abs(bias) < 1.2e-3, (name, bias)
