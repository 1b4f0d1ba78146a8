"""``kernel="auto"``'s safety net (``KernelFallback``) inside ``torch.compile(fullgraph=
True)``: a Triton kernel made to fail at run time (as one that cannot compile for an
older GPU would) gives the PyTorch path's output and gradients, with one warning, or
is not taken at all; ``"triton"`` still raises. On CPU tensors under Triton's
interpreter, CUDA taken for the device where ``"auto"`` asks for it.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import skyformer
from skyformer import kernelized_attention
from skyformer.linalg import gaussian_kernel_block, half_sq_norm, lemma3_inverse
from skyformer.sketch import landmarks as lm
from skyformer.sketch.rng import random_key
from tests.conftest import gen, grads_and_warnings, make_qkv
from tests.devices import needs_interpreter

pytest.importorskip("triton")
pytestmark = needs_interpreter

FAILURE = "simulated compile failure"
INDUCTOR = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                              reason="inductor on CPU needs a C++ compiler")


def _broken(*args, **kwargs):
    raise RuntimeError(FAILURE)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Every fallback's failures (``failures``) forgotten afterwards (``monkeypatch`` restores it),
    and no compiled code kept between tests."""
    from skyformer.linalg import kernel_matmul_triton, lemma3_triton
    from skyformer.ops.kernelized import flash

    for fallback in (flash.FLASH_FALLBACK, lemma3_triton.CORE_FALLBACK, lm.DRAW_FALLBACK,
                     kernel_matmul_triton.PRODUCT_FALLBACK):
        monkeypatch.setattr(fallback, "failures", set())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(got, want, **tolerances):
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, **tolerances)


@pytest.mark.parametrize("fails, backend", [
    ("forward", "aot_eager"), ("backward", "aot_eager"),
    pytest.param("backward", "inductor", marks=INDUCTOR)])
def test_failing_flash_kernels_give_way_to_the_augmentation_when_compiled(
        monkeypatch, fails, backend):
    """The fallback runs inside the flash operators, which the compiled graph calls:
    the SDPA augmentation's output and gradients, one warning, ``failed`` set, and a
    second call without a warning."""
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import flash, triton_flash

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(triton_flash, f"flash_{fails}", _broken)
    q, k, v = make_qkv(2, 2, 12, 8, dtype=torch.float32, seed=4)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 9:] = False

    def attention(kernel):
        return lambda q, k, v: kernelized_attention(q, k, v, key_padding_mask=mask,
                                                    causal=True, kernel=kernel)

    want, _ = grads_and_warnings(attention("torch"), (q, k, v))
    compiled = torch.compile(attention("auto"), fullgraph=True, backend=backend)
    got, warned = grads_and_warnings(compiled, (q, k, v))
    _close(got, want)
    assert len(warned) == 1 and FAILURE in warned[0]
    assert flash.FLASH_FALLBACK.failed
    again, warned = grads_and_warnings(compiled, (q, k, v))
    _close(again, want)
    assert warned == []
    compiled = torch.compile(attention("triton"), fullgraph=True, backend=backend)
    with pytest.raises(RuntimeError, match=FAILURE):  # "triton" insists
        grads_and_warnings(compiled, (q, k, v))


def test_running_out_of_memory_in_a_compiled_flash_kernel_propagates(monkeypatch):
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import flash, triton_flash

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(triton_flash, "flash_forward", out_of_memory)
    compiled = torch.compile(kernelized_attention, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch.OutOfMemoryError):
        compiled(*make_qkv(1, 2, 8, 8, dtype=torch.float32))
    assert not flash.FLASH_FALLBACK.failed


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_failing_product_kernels_give_way_to_pytorch_when_compiled(monkeypatch, fails):
    """The Gaussian block products' fallback runs inside their operators, which the
    compiled graph calls: Skyformer's output and gradients are the PyTorch path's (the
    kernels failing from the first call, or from its backward pass), one warning,
    ``failed`` set, and a second call without a warning; ``"triton"`` still raises."""
    from skyformer.linalg import kernel_matmul, kernel_matmul_triton, triton_kernels

    monkeypatch.setattr(kernel_matmul, "use_triton", lambda kernel, t: kernel != "torch")

    def break_kernels():
        for name in ("rows_product", "cols_product"):
            monkeypatch.setattr(triton_kernels, name, _broken)

    q, k, v = make_qkv(2, 2, 21, 8, seed=4)  # float64: the same values up to rounding
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, 15:] = False

    def attention(kernel):
        return lambda q, k, v: skyformer.attention(
            q, k, v, "skyformer", key_padding_mask=mask, kernel=kernel, num_features=6,
            generator=skyformer.random_key(5))

    want, _ = grads_and_warnings(attention("torch"), (q, k, v))
    compiled = torch.compile(attention("auto"), fullgraph=True, backend="aot_eager")
    if fails == "forward":
        break_kernels()
        got, warned = grads_and_warnings(compiled, (q, k, v))
    else:
        got, warned = grads_and_warnings(compiled, (q, k, v), break_kernels)
    _close(got, want, rtol=1e-10, atol=1e-12)
    assert len(warned) == 1 and FAILURE in warned[0]
    assert kernel_matmul_triton.PRODUCT_FALLBACK.failed
    again, warned = grads_and_warnings(compiled, (q, k, v))
    _close(again, want, rtol=1e-10, atol=1e-12)
    assert warned == []
    compiled = torch.compile(attention("triton"), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=FAILURE):  # "triton" insists
        grads_and_warnings(compiled, (q, k, v))


def _landmark_matrix() -> torch.Tensor:
    x = 0.6 * torch.randn(2, 2, 9, 8, generator=gen(6))
    norm = half_sq_norm(x)
    return gaussian_kernel_block(x, x, norm, norm)


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_compiled_auto_leaves_the_lemma3_kernel_to_eager_code(monkeypatch, fails):
    """Under ``torch.compile`` ``"auto"`` computes the core with PyTorch operations
    (Inductor fuses them; ``lemma3_triton``): a kernel that fails there is not tried,
    so nothing warns; ``"triton"`` takes it and raises."""
    from skyformer.linalg import lemma3_triton, triton_lemma3, triton_lemma3_backward

    monkeypatch.setattr(lemma3_triton, "use_triton", lambda kernel, t: kernel != "torch")
    module = triton_lemma3 if fails == "forward" else triton_lemma3_backward
    monkeypatch.setattr(module, f"lemma3_{fails}", _broken)
    mat = _landmark_matrix()

    def inverse(kernel):
        return lambda t: lemma3_inverse(t, gamma=0.1, kernel=kernel)

    want, _ = grads_and_warnings(inverse("torch"), (mat,))
    compiled = torch.compile(inverse("auto"), fullgraph=True, backend="aot_eager")
    got, warned = grads_and_warnings(compiled, (mat,))
    _close(got, want, rtol=1e-5, atol=1e-6)
    assert warned == [] and not lemma3_triton.CORE_FALLBACK.failed
    compiled = torch.compile(inverse("triton"), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=FAILURE):  # "triton" insists
        grads_and_warnings(compiled, (mat,))


@pytest.mark.parametrize("draw", ["auto", "triton"])
def test_compiled_draws_take_the_pytorch_path(monkeypatch, draw):
    """The landmark draws are raw launches, which a compiled graph cannot record: under
    ``torch.compile`` both options compute the keys with PyTorch operations (the same
    numbers), so a failing kernel is not tried."""
    from skyformer.sketch import triton_draws

    monkeypatch.setattr(triton_draws, "selection_keys", _broken)
    key = random_key(torch.Generator().manual_seed(3))

    def keys(draw):
        return lambda key: lm.stream_selection_keys(key, lm.KEY_STREAM, None, 2, 30, draw=draw)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = torch.compile(keys(draw), fullgraph=True, backend="aot_eager")(key)
    assert torch.equal(got, keys("torch")(key)) and not lm.DRAW_FALLBACK.failed
