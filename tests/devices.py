"""Devices the tests run on, and the tolerances per dtype, in one place.

CPU always. CUDA when ``SKYFORMER_TEST_CUDA=1`` is set on a machine with a GPU: then
the contract test, the CUDA method checks (``tests/gpu``) and the Triton kernel tests
run there too; elsewhere those cases are skipped with the reason below. Setting the
variable without a GPU is an error, not a silent skip.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA_TESTS = os.environ.get("SKYFORMER_TEST_CUDA", "0") not in ("", "0")
if CUDA_TESTS and not torch.cuda.is_available():
    raise RuntimeError("SKYFORMER_TEST_CUDA=1 but torch.cuda.is_available() is False: "
                       "run the CUDA tests on a machine with a GPU and a CUDA build of torch.")
CUDA_SKIP_REASON = "CUDA tests are off: set SKYFORMER_TEST_CUDA=1 on a machine with a GPU"
cuda_only = pytest.mark.skipif(not CUDA_TESTS, reason=CUDA_SKIP_REASON)

# Relative error ||out - ref||_F / ||ref||_F allowed for a method's output (and its input
# gradients) computed in ``dtype`` on a device, against the same call in float64 on the
# CPU with the same random key. float32: the approximations' iterative inverses and
# normalisations amplify float32 rounding (2^-24) by up to ~1e4 on these small random
# inputs; bfloat16 keeps 8 mantissa bits (2^-9 = 2e-3) in the inputs and outputs, the
# methods compute in float32 (exact kernelized: SDPA's fused kernels on bfloat16, float32
# sums), so the error is the rounding of inputs, weights and outputs, amplified.
TOLERANCES = {torch.float64: 1e-9, torch.float32: 2e-3, torch.bfloat16: 5e-2}


def devices() -> list:
    """``["cpu", "cuda"]`` for ``pytest.mark.parametrize``; cuda skipped unless enabled."""
    return ["cpu", pytest.param("cuda", marks=cuda_only)]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 on the CPU (0 when both are 0)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff



def device_leaves(tensors, device, dtype) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``device`` in ``dtype`` that take gradients."""
    return [t.detach().to(device, dtype).requires_grad_(True) for t in tensors]


def backward_with_weights(out: torch.Tensor) -> None:
    """Backward of a weighted sum of ``out`` (weights -1..1 along its last dim), so that
    every gradient entry is exercised and none cancels by symmetry."""
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()


def assert_matches_reference(out, grads, ref, ref_grads, dtype) -> None:
    """``out`` (in ``dtype``) within ``TOLERANCES[dtype]`` of ``ref``, and each of the
    gradients of q, k, v within five times that (relative Frobenius errors)."""
    tol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert relative_error(out, ref) < tol
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert relative_error(g, g_ref) < 5 * tol, f"gradient of {name}"


# A test that runs Triton kernels on CPU tensors needs Triton's interpreter, which is off
# where a GPU runs the kernels (SKYFORMER_TEST_CUDA=1 leaves TRITON_INTERPRET unset): the
# fixture (conftest.py) skips it then, at setup, once conftest has set the variable.
needs_interpreter = pytest.mark.usefixtures("triton_interpreter")


def captured_in_graph(step):
    """(a CUDA graph of ``step()``, the outputs of the captured call): one warm-up call on
    a side stream first, as capture requires (it compiles and loads the kernels, which
    CUDA refuses during a capture). ``graph.replay()`` then writes into those outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
