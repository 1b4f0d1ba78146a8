"""Functions and custom operators called without PyTorch's Python layers in plain
eager code (``linalg.eager_calls``): taken there, given up wherever those layers are
needed (an argument left to its default, tracing, ``torch.func``, dispatch modes,
tensor subclasses), and the same values and gradients either way."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import skyformer
from skyformer.linalg import eager_calls
from skyformer.linalg.eager_calls import apply, custom_op, through_pytorch
from tests.conftest import make_qkv
from tests.dispatch import Recorder


class _Scale(torch.autograd.Function):
    """x * factor, with a default factor (so that a call may leave it out)."""

    @staticmethod
    def forward(x: Tensor, factor: float = 2.0) -> Tensor:  # type: ignore[override]
        return x * factor

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None

    @staticmethod
    def vmap(info, in_dims, x, factor):
        return _Scale.apply(x, factor), in_dims[0]


_IMPLEMENTATION_CALLS = [0]


@custom_op("skyformer_tests::add_scaled")
def _add_scaled(x: Tensor, y: Tensor, factor: float) -> Tensor:
    _IMPLEMENTATION_CALLS[0] += 1
    return x + factor * y


@_add_scaled.register_fake
def _(x, y, factor):
    return torch.empty_like(x)


def _python_apply_refused():
    """``_Scale.apply`` (PyTorch's Python layer) raising if it is called."""
    return mock.patch.object(_Scale, "apply", side_effect=AssertionError("Python apply"))


def test_apply_skips_the_python_layer_in_plain_eager_code():
    x = torch.randn(5, requires_grad=True)
    with _python_apply_refused():
        out = apply(_Scale, x, 3.0)
    out.sum().backward()
    assert torch.equal(out, 3.0 * x.detach())
    assert torch.equal(x.grad, torch.full((5,), 3.0))
    assert type(out.grad_fn).__name__ == "_ScaleBackward"


@pytest.mark.parametrize("why", ["default", "switched off", "vmap", "subclass"])
def test_apply_takes_the_python_layer_where_it_is_needed(why):
    x = torch.randn(3, 5)
    with mock.patch.object(_Scale, "apply", wraps=_Scale.apply) as python_apply:
        if why == "default":  # the Python layer fills in the default factor
            out = apply(_Scale, x)
            assert torch.equal(out, 2.0 * x)
        elif why == "switched off":
            with through_pytorch():
                apply(_Scale, x, 3.0)
        elif why == "vmap":
            out = torch.func.vmap(lambda row: apply(_Scale, row, 3.0))(x)
            assert torch.equal(out, 3.0 * x)
        else:
            apply(_Scale, torch.nn.Parameter(x), 3.0)
    assert python_apply.called


def test_apply_under_torch_compile():
    x = torch.randn(5, requires_grad=True)
    out = torch.compile(lambda t: apply(_Scale, t, 3.0), fullgraph=True, backend="eager")(x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((5,), 3.0))


def test_an_operator_calls_its_implementation_in_plain_eager_code():
    x, y = torch.randn(4), torch.randn(4)
    seen = Recorder(lambda func, args, out: str(func))
    before = _IMPLEMENTATION_CALLS[0]
    assert torch.equal(_add_scaled(x, y, 0.5), x + 0.5 * y)
    assert _IMPLEMENTATION_CALLS[0] == before + 1
    with seen:  # a dispatch mode sees the operator itself
        assert torch.equal(_add_scaled(x, y, 0.5), x + 0.5 * y)
    assert seen.items[0] == "skyformer_tests.add_scaled.default"


def test_an_operator_goes_through_the_dispatcher_where_it_must():
    x, y = torch.randn(4), torch.randn(4)
    with mock.patch.object(_add_scaled, "implementation", side_effect=AssertionError):
        with FakeTensorMode() as fake:  # fake tensors: the registered fake runs
            out = _add_scaled(fake.from_tensor(x), fake.from_tensor(y), 0.5)
        assert out.shape == (4,)
        with through_pytorch():  # the operator's own (unpatched) implementation
            assert torch.equal(_add_scaled(x, y, 0.5), x + 0.5 * y)
        compiled = torch.compile(lambda a, b: _add_scaled(a, b, 0.5), fullgraph=True,
                                 backend="eager")
        assert torch.equal(compiled(x, y), x + 0.5 * y)
        traced = torch.jit.trace(lambda a, b: _add_scaled(a, b, 0.5), (x, y),
                                 check_trace=False)  # the check reruns it eagerly
        assert "skyformer_tests::add_scaled" in str(traced.graph)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "kernelized"])
def test_the_methods_give_the_same_values_and_gradients_either_way(method, triton_interpreter):
    q, k, v = make_qkv(1, 2, 40, 16, dtype=torch.float32)
    options = {} if method == "kernelized" else {"num_features": 8,
                                                 "generator": skyformer.random_key(3)}

    def run() -> list[Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, method, kernel="triton", **options)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    direct = run()
    with through_pytorch():
        layered = run()
    for a, b in zip(direct, layered, strict=True):
        assert torch.equal(a, b)


def test_a_profiled_operator_keeps_its_name_in_the_trace():
    x, y = torch.randn(4), torch.randn(4)
    with torch.profiler.profile() as prof:
        _add_scaled(x, y, 0.5)
    assert "skyformer_tests::add_scaled" in {event.name for event in prof.events()}


def test_the_cpp_apply_is_there():
    """Without it every call would take the full path, silently slower."""
    assert eager_calls._CPP_APPLY is not None
