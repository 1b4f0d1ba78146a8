"""Compiled autograd (``torch._dynamo.compiled_autograd``), which traces the backward
graph through dynamo, custom Functions' ``backward`` included: the gradients are
eager's, with the Triton kernels (under the interpreter, float64: to rounding) and
their ``"auto"`` safety net (``KernelFallback``), which must run inside the operators
there, as under ``torch.compile``: a ``try`` around an operator is traced away.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import skyformer
from skyformer.linalg import gaussian_kernel_block, half_sq_norm, lemma3_inverse
from tests.conftest import gen, make_qkv
from tests.devices import needs_interpreter

pytest.importorskip("triton")
_compiled_autograd = getattr(torch._dynamo, "compiled_autograd", None)
pytestmark = [needs_interpreter, pytest.mark.skipif(
    not hasattr(_compiled_autograd, "_enable"),
    reason="this torch has no torch._dynamo.compiled_autograd._enable")]

TIGHT = {"rtol": 1e-10, "atol": 1e-12}
FAILURE = "simulated compile failure"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No compiled code, and no kernel failure, kept between tests."""
    from skyformer.linalg import lemma3_triton

    monkeypatch.setattr(lemma3_triton.CORE_FALLBACK, "failures", set())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(fn, inputs, compiled_autograd, before_backward=lambda: None):
    """([fn's output, its inputs' gradients for fixed weights], the RuntimeWarnings'
    messages), the gradients by ``backward()`` (compiled autograd does not trace
    ``torch.autograd.grad``), under compiled autograd (``aot_eager``) where asked;
    ``before_backward`` runs between the two passes. Checks that one backward graph
    was captured."""
    from torch._dynamo.utils import counters

    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*leaves)
        before_backward()
        weights = torch.randn(out.shape, generator=gen(5), dtype=out.dtype)
        if compiled_autograd:
            with _compiled_autograd._enable(torch.compile(backend="aot_eager")):
                (out * weights).sum().backward()
        else:
            (out * weights).sum().backward()
    assert counters["compiled_autograd"]["captures"] == int(compiled_autograd)
    return ([out, *(t.grad for t in leaves)],
            [str(w.message) for w in caught if w.category is RuntimeWarning])


def _all_close(got, want) -> bool:
    """Whether each tensor of ``got`` equals its ``want`` to rounding (``TIGHT``)."""
    return all(torch.allclose(a, e, **TIGHT) for a, e in zip(got, want, strict=True))


@pytest.mark.parametrize("method", ["skyformer", "kernelized"])
def test_compiled_autograd_of_a_compiled_forward_gives_eager_gradients(method):
    """A padded call with the Triton kernels, compiled forward, its backward graph
    traced by compiled autograd: the products' and the Lemma 3 core's backward
    operators (Skyformer), the flash kernels' (kernelized)."""
    q, k, v = make_qkv(1, 2, 24, 16, seed=3)
    mask = torch.ones(1, 24, dtype=torch.bool)
    mask[0, 19:] = False
    extra = {"num_features": 8, "generator": skyformer.random_key(0)} \
        if method == "skyformer" else {}

    def attention(q, k, v):
        return skyformer.attention(q, k, v, method, key_padding_mask=mask, kernel="triton",
                                   **extra)

    want, _ = _grads(attention, (q, k, v), False)
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    got, _ = _grads(compiled, (q, k, v), True)
    assert _all_close(got, want)


def test_a_failing_lemma3_backward_kernel_falls_back_under_compiled_autograd(monkeypatch):
    """``"auto"`` took the Lemma 3 kernel in eager code; its backward kernel fails inside
    the graph that compiled autograd traced: the PyTorch path's gradient, one warning,
    not the kernel's error."""
    from skyformer.linalg import lemma3_triton, triton_lemma3_backward

    def broken(*args, **kwargs):
        raise RuntimeError(FAILURE)

    monkeypatch.setattr(lemma3_triton, "use_triton", lambda kernel, t: kernel != "torch")
    x = 0.6 * torch.randn(1, 2, 9, 8, generator=gen(6), dtype=torch.float64)
    norm = half_sq_norm(x)
    mat = gaussian_kernel_block(x, x, norm, norm)

    def inverse(kernel):
        return lambda t: lemma3_inverse(t, gamma=0.1, kernel=kernel)

    want, _ = _grads(inverse("torch"), (mat,), False)
    got, warned = _grads(
        inverse("auto"), (mat,), True,
        lambda: monkeypatch.setattr(triton_lemma3_backward, "lemma3_backward", broken))
    assert _all_close(got, want)
    assert len(warned) == 1 and FAILURE in warned[0]
    assert lemma3_triton.CORE_FALLBACK.failed_on(mat)
