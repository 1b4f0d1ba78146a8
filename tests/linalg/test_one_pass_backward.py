"""The products' backward pass in one pass over the rows (``triton_one_pass``, opt-in
through ``kernel_matmul_triton.ONE_PASS_BACKWARD``) against the PyTorch path: outputs
and the gradients of y, x, the column offsets and rhs, odd sizes (m = 1 to 128, head
dims 16 to 128), invalid rows, dead columns, excluded entries, row norms, half-type
rows, whole methods; and that it is the one kernel launched where it applies."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg import kernel_matmul_triton
from skyformer.linalg.kernel_backend import interpreter_on
from tests.devices import devices, needs_interpreter, relative_error
from tests.linalg.test_kernel_matmul_triton import (
    CASES,
    TOLERANCE,
    _assert_products_close,
    _exact_dtype,
    _method_calls,
    _product,
    _record_product_launches,
)

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def one_pass(request, monkeypatch):
    """The option on; the product kernels' launches recorded by name."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")
    monkeypatch.setattr(kernel_matmul_triton, "ONE_PASS_BACKWARD", True)
    monkeypatch.setattr(kernel_matmul_triton.ONE_PASS_FALLBACK, "failures", set())
    launched: list[str] = []
    _record_product_launches(monkeypatch, lambda grid, kwargs, name: launched.append(name),
                             one_pass=True)
    return launched


def _data(n, m, d, r, transpose, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(2, n, d, generator=g, dtype=torch.float64).to(device, dtype)
    x = (torch.randn(2, m, d, generator=g, dtype=torch.float64) * 0.7).to(device, dtype)
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=torch.float64).to(
        device, dtype)
    return y, x, b, rhs


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transpose", [False, True])
def test_one_pass_equals_torch(one_pass, device, dtype, case, transpose):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 takes the PyTorch path on CUDA (kernel_backend.use_triton)")
    n, m, d, r = case
    y, x, b, rhs = _data(n, m, d, r, transpose, dtype, device, n * m + d)
    ours = _product("triton", y, x, b, rhs, scale=d ** -0.25, transpose=transpose)
    forward = "_cols_kernel" if transpose else "_rows_kernel"
    backward = (["_one_pass_kernel"] if kernel_matmul_triton.one_pass_applies(m, d, r)
                else ["_rows_kernel", "_cols_kernel"])  # tiles over 64 wide: two kernels
    assert one_pass == [forward, *backward]
    ref = _product("torch", y, x, b, rhs, scale=d ** -0.25, transpose=transpose)
    for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), ours, ref, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("row_norm", [False, True])
def test_one_pass_masks_and_norms(one_pass, device, transpose, row_norm):
    """Invalid rows, a dead (+inf) column, excluded entries (a transposed view), the row
    norms' terms of dy."""
    n, m, d, r = 53, 19, 16, 12
    dtype = torch.float64 if device == "cpu" else torch.float32
    y, x, b, rhs = _data(n, m, d, r, transpose, dtype, device, 7)
    b[:, 4] = float("inf")
    g = torch.Generator().manual_seed(8)
    options = {"scale": 0.6, "row_norm": row_norm, "transpose": transpose,
               "row_valid": (torch.rand(2, n, generator=g) > 0.3).to(device),
               "exclude": (torch.rand(2, m, n, generator=g) > 0.8).to(device).transpose(-1, -2)}
    ours = _product("triton", y, x, b, rhs, **options)
    assert "_one_pass_kernel" in one_pass
    ref = _product("torch", y, x, b, rhs, **options)
    _assert_products_close(ours, ref, dtype)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
def test_one_pass_reads_half_rows_as_the_two_kernels_do(one_pass, device, transpose):
    """bfloat16 y and N-row rhs: the same gradients as the two kernels (bf16x3 dots)."""
    y, x, b, rhs = _data(70, 33, 24, 40, transpose, torch.float32, device, 3)
    y = y.to(torch.bfloat16)
    if transpose:
        rhs = rhs.to(torch.bfloat16)
    ours = _product("triton", y, x, b, rhs, scale=0.5, transpose=transpose)
    assert "_one_pass_kernel" in one_pass
    kernel_matmul_triton.ONE_PASS_BACKWARD = False  # the fixture restores it
    two = _product("triton", y, x, b, rhs, scale=0.5, transpose=transpose)
    for a, e in zip(ours, two, strict=True):
        # on a GPU the kernels sum in different orders: a bfloat16 result's rounding can
        # then flip by 2^-8 in a few entries (1.4e-4 of the norm seen on an H100)
        assert relative_error(a, e) < (2e-3 if a.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "skyformer_multipole"])
def test_methods_with_one_pass(one_pass, device, method):
    """Whole calls with a padding mask: the PyTorch path's outputs and gradients."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    results = _method_calls(device, dtype, method)
    assert "_one_pass_kernel" in one_pass
    for a, e in zip(*results, strict=True):
        assert relative_error(a, e) < (1e-9 if dtype == torch.float64 else 2e-3)


@pytest.mark.parametrize("device", devices())
def test_more_columns_than_a_tile_take_the_two_kernels(one_pass, device):
    dtype = _exact_dtype(device)
    y, x, b, rhs = _data(40, 129, 8, 8, False, dtype, device, 1)
    ours = _product("triton", y, x, b, rhs, scale=0.5)
    assert one_pass == ["_rows_kernel", "_rows_kernel", "_cols_kernel"]
    ref = _product("torch", y, x, b, rhs, scale=0.5)
    for a, e in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE[dtype])


@needs_interpreter  # aot_eager on CPU tensors
def test_compile_fullgraph_equals_eager_with_one_pass(one_pass):
    """``torch.compile`` traces the backward pass's one operator (its fake shapes)."""
    from tests.pt2.test_stack_matrix import _assert_compiled_equals_eager

    _assert_compiled_equals_eager(skyformer.get_method("skyformer").bind(kernel="triton"), 20)
    assert "_one_pass_kernel" in one_pass


@pytest.mark.parametrize("device", devices())
def test_a_failing_one_pass_runs_the_two_kernels_with_a_warning(one_pass, monkeypatch, device):
    """A one-pass launch that fails to compile gives way to the rows and cols kernels
    (``ONE_PASS_FALLBACK``), once with a warning, then without trying it again."""
    from skyformer.linalg import triton_one_pass

    tried = []

    def broken(*args, **kwargs):
        tried.append(1)
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(triton_one_pass, "one_pass_product", broken)
    dtype = _exact_dtype(device)
    y, x, b, rhs = _data(37, 5, 16, 16, False, dtype, device, 2)
    with pytest.warns(RuntimeWarning, match="one-pass backward kernel.*simulated"):
        got = _product("triton", y, x, b, rhs, scale=0.5)
    assert one_pass == ["_rows_kernel", "_rows_kernel", "_cols_kernel"]
    again = _product("triton", y, x, b, rhs, scale=0.5)
    assert tried == [1]
    want = _product("torch", y, x, b, rhs, scale=0.5)
    for a, e, f in zip(got, again, want, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
        torch.testing.assert_close(a, f, **TOLERANCE[dtype])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_calls_with_row_norms_and_bfloat16_landmarks(one_pass, device, half):
    """Whole Skyformer calls on half inputs (the row norms, and for bfloat16 the landmark
    rows read as bfloat16 numbers, ``x_bf16``): the two kernels' gradients."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=g).to(device, half) for _ in range(3))
    results = []
    for on in (True, False):
        kernel_matmul_triton.ONE_PASS_BACKWARD = on  # the fixture restores it
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, "skyformer", kernel="triton", num_features=16,
                                  generator=skyformer.random_key(2))
        results.append([out, *torch.autograd.grad(out.float().square().sum(), leaves)])
    assert one_pass.count("_one_pass_kernel") == 2
    for a, e in zip(*results, strict=True):
        assert relative_error(a, e) < 1e-2  # half-type gradients, rounded differently


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backward", ["one pass", "two kernels", "rows kernel alone"])
def test_mixed_dtypes_give_the_value_gradient_in_its_dtype(one_pass, device, backward):
    """C^T V with bfloat16 keys and float32 values, no key gradient: dV (the rows' C V_M)
    in V's dtype, as the operators' fake shapes say, and as close to the float64 values
    as dx (bf16x3 products), never rounded through the keys' bfloat16 on the way: from
    the one pass, from the rows kernel beside the cols kernel (dx asked for, the one pass
    off), and from the rows kernel alone (only V's gradient asked for)."""
    y, x, b, rhs = _data(40, 12, 16, 8, True, torch.float32, device, 4)
    kernel_matmul_triton.ONE_PASS_BACKWARD = backward == "one pass"  # the fixture restores it
    with_x = backward != "rows kernel alone"

    def grads(kernel, dtype, rows):
        leaves = [t.to(dtype).requires_grad_(True) for t in ((x, rhs) if with_x else (rhs,))]
        out = skyformer.linalg.gaussian_kernel_matmul(
            rows, leaves[0] if with_x else x.to(dtype), leaves[-1], b.to(dtype), scale=0.5,
            transpose=True, kernel=kernel)
        return torch.autograd.grad(out.square().sum(), leaves)

    rows = y.to(torch.bfloat16)
    got = grads("triton", torch.float32, rows)
    assert ("_one_pass_kernel" in one_pass) == (backward == "one pass")
    assert got[-1].dtype == torch.float32
    for a, e in zip(got, grads("torch", torch.float64, rows.double()), strict=True):
        assert relative_error(a, e) < 3e-4
