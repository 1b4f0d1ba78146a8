"""The Triton kernels of the Gaussian block products against the PyTorch path.

On the CPU they run under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), on CUDA with ``SKYFORMER_TEST_CUDA=1``. Outputs and the
gradients of y, x, the column offsets and rhs; odd sizes (N not a multiple of the
block, m = 1, m = 0, head dims 16..128), invalid rows, excluded entries, row shifts.
"""

from __future__ import annotations

import math

import pytest
import torch

import skyformer
from skyformer.linalg import gaussian_kernel_matmul
from skyformer.linalg.kernel_backend import interpreter_on
from tests.conftest import make_qkv
from tests.devices import cuda_only, devices, needs_interpreter, relative_error
from tests.dispatch import Recorder

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
triton_kernels = pytest.importorskip("skyformer.linalg.triton_kernels")


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    """CPU cases need the interpreter, which is off where the GPU runs the kernels."""
    device = getattr(request.node, "callspec", None)
    if device is not None and device.params.get("device") == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")

CASES = [  # n, m, d, r
    (37, 5, 16, 16),
    (130, 1, 32, 8),
    (70, 33, 24, 40),
    (65, 70, 128, 64),
    (20, 128, 64, 128),
    (37, 0, 16, 16),  # no landmark rows: zeros (an empty [m, R] output is not "absent")
]
TOLERANCE = {torch.float64: {"rtol": 1e-10, "atol": 1e-12},
             torch.float32: {"rtol": 2e-4, "atol": 2e-5}}  # tf32x3 on GPUs: ~float32


def _exact_dtype(device: str) -> torch.dtype:
    """float64 where the kernels run it (the interpreter: exact checks); float32 on CUDA,
    where float64 takes the PyTorch path (``kernel_backend.use_triton``)."""
    return torch.float64 if device == "cpu" else torch.float32


def _record_product_launches(monkeypatch, record, one_pass=False):
    """Calls ``record(grid, keyword arguments, kernel name)`` at every launch of the
    product kernels (``one_pass``: the one-pass backward kernel too), which then run as
    they are."""
    from skyformer.linalg import triton_kernels, triton_one_pass

    class Recording:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                record(grid, kwargs, self.name)
                return self.kernel[grid](*args, **kwargs)
            return launch

    kernels = [(triton_kernels, "_rows_kernel"), (triton_kernels, "_cols_kernel")]
    for module, name in kernels + ([(triton_one_pass, "_one_pass_kernel")] if one_pass else []):
        monkeypatch.setattr(module, name, Recording(name, getattr(module, name)))


def _assert_products_close(ours, ref, dtype):
    """``_product``'s results of two paths, to ``TOLERANCE``; a dead column's offset gets
    no gradient on either path (NaN)."""
    for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), ours, ref, strict=True):
        if name == "db":
            a, e = a.nan_to_num(), e.nan_to_num()
        torch.testing.assert_close(a, e, **TOLERANCE[dtype], msg=name)


def _product(kernel, y, x, b, rhs, **options):
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, b, rhs)]
    out = gaussian_kernel_matmul(leaves[0], leaves[1], leaves[3], leaves[2], kernel=kernel,
                                 **options)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16).to(out.device, out.dtype)  # the same values in any dtype
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return [out, *grads]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transpose", [False, True])
def test_triton_equals_torch(device, dtype, case, transpose):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 takes the PyTorch path on CUDA (kernel_backend.use_triton)")
    n, m, d, r = case
    g = torch.Generator().manual_seed(n * m + d)
    y = torch.randn(2, n, d, generator=g, dtype=dtype).to(device)
    x = (torch.randn(2, m, d, generator=g, dtype=dtype) * 0.7).to(device)
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=dtype).to(device)
    scale = d ** -0.25
    ours = _product("triton", y, x, b, rhs, scale=scale, transpose=transpose)
    ref = _product("torch", y, x, b, rhs, scale=scale, transpose=transpose)
    for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), ours, ref, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transpose", [False, True])
def test_half_rows_are_read_without_a_float32_copy(device, half, transpose):
    """bfloat16 / float16 y (and N-row rhs) go into the kernels as they are: every result
    is the PyTorch path's on the same values converted to float32, N-row results
    rounded once to the half type (one unit in their last place)."""
    n, m, d, r = 70, 33, 24, 40
    g = torch.Generator().manual_seed(11)
    y = torch.randn(2, n, d, generator=g).to(device, half)
    x = (torch.randn(2, m, d, generator=g) * 0.7).to(device)
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g).to(device)
    if transpose:
        rhs = rhs.to(half)
    options = {"scale": d ** -0.25, "transpose": transpose,
               "row_valid": (torch.rand(2, n, generator=g) > 0.2).to(device)}
    ours = _product("triton", y, x, b, rhs, **options)
    ref = _product("torch", y.float(), x, b, rhs.float(), **options)
    eps = torch.finfo(half).eps
    for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), ours, ref, strict=True):
        n_rows = name == "dy" or (name == "out" and not transpose) or (name == "drhs"
                                                                      and transpose)
        assert a.dtype == (half if n_rows else torch.float32), name
        rtol = eps if n_rows else 2e-4  # one rounding of the result / float32 sums
        torch.testing.assert_close(a.float(), e, rtol=rtol, atol=rtol * e.abs().max().item(),
                                   msg=name)



@cuda_only
def test_float64_on_cuda_takes_the_pytorch_path():
    """Triton passes float arguments as float32 on a GPU, which would cost float64 its
    accuracy: kernel="triton" computes float64 CUDA tensors by the PyTorch path (the
    same numbers as kernel="torch")."""
    from skyformer.linalg.kernel_backend import use_triton

    y = torch.randn(2, 9, 4, dtype=torch.float64, device="cuda")
    assert not use_triton("triton", y) or interpreter_on()
    assert use_triton("triton", y.float())


@needs_interpreter
def test_the_output_with_n_rows_is_not_kept_for_the_backward_pass():
    """C Z keeps no [N, R] copy of its output alive until backward (the attention
    output: the next layer usually saves its own contiguous copy)."""
    n, m, d, r = 50, 7, 16, 24
    y = torch.randn(2, n, d, requires_grad=True)
    x = torch.randn(2, m, d) * 0.5
    z = torch.randn(2, m, r, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gaussian_kernel_matmul(y, x, z, 0.5 * (x * x).sum(-1), kernel="triton")
    assert out.shape == (2, n, r) and (2, n, r) not in saved, saved
    out.sum().backward()
    assert y.grad is not None and z.grad is not None


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_a_column_of_ones_appended_inside_is_the_same_product_saving_rhs(device, kernel,
                                                                         transpose, masked):
    """``ones_column``: C [rhs, 1] (or C^T [rhs, 1]) and every gradient as with the
    column appended by the caller, on both paths, with invalid rows, in vmap and as
    plain operators (``functional_ops``); the product saves rhs itself for the backward
    pass, not a copy with the column."""
    from unittest import mock

    from skyformer.linalg import kernel_matmul

    dtype = _exact_dtype(device)
    n, m, d, r = 37, 5, 16, 8
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, n, d, generator=g, dtype=dtype).to(device)
    x = (torch.randn(2, m, d, generator=g, dtype=dtype) * 0.7).to(device)
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=dtype).to(device)
    with_ones = torch.cat([rhs, torch.ones_like(rhs[..., :1])], dim=-1)
    options = {"scale": d ** -0.25, "transpose": transpose}
    if masked:  # rows of y that are padding: zero rows (or columns) of C
        options["row_valid"] = (torch.rand(2, n, generator=g) > 0.3).to(device)

    def product(leaves, ones):
        return gaussian_kernel_matmul(leaves[0], leaves[1], leaves[3], leaves[2],
                                      kernel=kernel, ones_column=ones, **options)

    leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, b, rhs)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = product(leaves, True)
    assert out.shape[-1] == r + 1
    assert not [t for t in saved if t.shape[-2:] == with_ones.shape[-2:]]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4),
                          dtype=dtype).to(device)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, b, with_ones)]
    ref = product(ref_leaves, False)
    ref_grads = torch.autograd.grad((ref * weights).sum(), ref_leaves)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, **tolerance)
    for name, a, e in zip(("dy", "dx", "db"), grads[:3], ref_grads[:3], strict=True):
        torch.testing.assert_close(a, e, **tolerance, msg=name)
    torch.testing.assert_close(grads[3], ref_grads[3][..., :-1], **tolerance, msg="drhs")
    valid = options.pop("row_valid", torch.ones(2, n, dtype=torch.bool, device=device))
    mapped = torch.func.vmap(lambda *t: gaussian_kernel_matmul(
        t[0], t[1], t[3], t[2], row_valid=t[4], kernel=kernel, ones_column=True,
        **options))(y, x, b, rhs, valid)  # one matrix (and its valid rows) a batch entry
    torch.testing.assert_close(mapped, ref.detach(), **tolerance)
    options["row_valid"] = valid
    with mock.patch.object(kernel_matmul, "functional_ops_only", lambda: True):
        torch.testing.assert_close(product((y, x, b, rhs), True), ref.detach(), **tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("row_norm", [False, True])
def test_triton_masks_and_shifts(device, transpose, row_norm):
    """Invalid rows, +inf columns, excluded entries (a transposed view), row shifts."""
    n, m, d, r = 53, 19, 16, 12
    g = torch.Generator().manual_seed(7)
    dtype = _exact_dtype(device)
    y = torch.randn(3, n, d, generator=g, dtype=torch.float64).to(device, dtype)
    x = torch.randn(3, m, d, generator=g, dtype=torch.float64).to(device, dtype) * 0.5
    b = 0.5 * (x * x).sum(-1)
    b[:, 4] = float("inf")  # a dead column
    rhs = torch.randn(3, n if transpose else m, r, generator=g, dtype=torch.float64).to(
        device, dtype)
    row_valid = (torch.rand(3, n, generator=g) > 0.3).to(device)
    exclude = (torch.rand(3, m, n, generator=g) > 0.8).to(device).transpose(-1, -2)
    options = {"scale": 0.6, "row_norm": row_norm, "row_valid": row_valid, "transpose": transpose,
                   "exclude": exclude, "shift_rows": not transpose}
    ours = _product("triton", y, x, b, rhs, **options)
    ref = _product("torch", y, x, b, rhs, **options)
    _assert_products_close(ours, ref, dtype)


def _method_calls(device, dtype, method):
    """Output and dQ, dK, dV of ``method`` with a padding mask, ``kernel="torch"`` then
    ``kernel="triton"``."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 45, 16, generator=g, dtype=torch.float64).to(device, dtype)
               for _ in range(3))
    mask = torch.ones(2, 45, dtype=torch.bool, device=device)
    mask[1, 31:] = False
    results = []
    for kernel in ("torch", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, method, key_padding_mask=mask, kernel=kernel,
                                  num_features=12, generator=skyformer.random_key(5))
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    return results


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "skyformer_adaptive",
                                    "skyformer_multipole", "softmax_multipole"])
def test_methods_with_triton_kernels(device, method):
    """The option ``kernel="triton"`` gives the PyTorch path's outputs and gradients."""
    dtype = _exact_dtype(device)
    for a, e in zip(*_method_calls(device, dtype, method), strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-11)
        else:
            assert relative_error(a, e) < 2e-3


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_an_undefined_output_gradient_gives_no_input_gradient(device, kernel):
    """A gradient that reaches the output undefined (a custom Function upstream of the
    loss returning None, as ``gradcheck``'s ``check_undefined_grad`` sends) gives the
    inputs none on both paths; the Triton product read it as a tensor (AttributeError)."""

    class NoGradient(torch.autograd.Function):
        @staticmethod
        def forward(t):
            return t.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return None

    dtype = _exact_dtype(device)
    q, k, v = (t.to(device, dtype).requires_grad_(True) for t in make_qkv(1, 2, 6, 4))
    out = skyformer.attention(q, k, v, "skyformer", num_features=4, kernel=kernel,
                              generator=skyformer.random_key(0))
    grads = torch.autograd.grad(NoGradient.apply(out).sum() + q.sum(), (q, k, v),
                                allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(grads[0], torch.ones_like(q))
    assert not grads[1].any() and not grads[2].any()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("method", "dtype"), [
    ("skyformer", torch.float64), ("skyformer", torch.float32),  # float32: the fused core
    ("skyformer_multipole", torch.float64)])
def test_per_sample_gradients_and_jacrev_through_the_kernels(device, method, dtype):
    """``vmap(grad)`` and ``jacrev`` run the kernels' backward passes on batched
    tensors (folded into the batch dim): the PyTorch path's per-sample gradients."""
    dtype = dtype if device == "cpu" else _exact_dtype(device)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 1, 40, 8, generator=g, dtype=dtype).to(device)
               for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    mask[1, 31:] = False

    def run(kernel):
        def loss(q, k, v, mask):
            out = skyformer.attention(q[None], k[None], v[None], method, kernel=kernel,
                                      key_padding_mask=mask[None], num_features=12,
                                      generator=skyformer.random_key(5))
            return out.square().sum()

        per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)
        jacobian = torch.func.jacrev(lambda q: skyformer.attention(
            q, k, v, method, kernel=kernel, key_padding_mask=mask, num_features=12,
            generator=skyformer.random_key(5))[1, 0, 3, :2])(q)
        return [*per_sample, jacobian]

    tolerance = {"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64 else \
        {"rtol": 2e-3, "atol": 2e-5}
    for a, e in zip(run("triton"), run("torch"), strict=True):
        torch.testing.assert_close(a, e, **tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_jacrev_of_one_matrix(device, method):
    """B x H = 1: jacrev expands the saved tensors over its cotangents, which fold into a
    batch repeating one matrix (stride 0); the kernels read a batch as dense, so the
    fold copies it (the fused core's store, the products' row offsets)."""
    dtype = torch.float64 if device == "cpu" else _exact_dtype(device)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 9, 8, generator=g, dtype=dtype).to(device) for _ in range(3))
    mask = torch.ones(1, 9, dtype=torch.bool, device=device)
    mask[0, 7:] = False

    def jacobian(kernel):
        return torch.func.jacrev(lambda q: skyformer.attention(
            q, k, v, method, kernel=kernel, key_padding_mask=mask, num_features=4,
            generator=skyformer.random_key(1))[0, 0, 3, :3])(q)

    tolerance = {"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64 else \
        {"rtol": 2e-3, "atol": 2e-5}  # float32 on CUDA: the kernels' sums, not the torch's
    torch.testing.assert_close(jacobian("triton"), jacobian("torch"), **tolerance)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "kernelized"])
def test_batched_gradients_are_each_gradient(device, method):
    """``autograd.grad(..., is_grads_batched=True)`` (the legacy vmap over the backward
    pass) gives each cotangent's gradient: the kernels' operators are then called on
    batched tensors, which only the operator's batching fallback maps (the direct eager
    call and the in-place row gradient would read their storage)."""
    dtype = _exact_dtype(device)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=dtype).to(device)
               .requires_grad_(True) for _ in range(3))
    options = {} if method == "kernelized" else {"num_features": 4,
                                                 "generator": skyformer.random_key(2)}
    out = skyformer.attention(q, k, v, method, kernel="triton", **options)
    cotangents = torch.randn(3, *out.shape, generator=g, dtype=dtype).to(device)
    tolerance = ({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float64
                 else {"rtol": 1e-4, "atol": 1e-5})
    batched = torch.autograd.grad(out, (q, k, v), cotangents, is_grads_batched=True,
                                  retain_graph=True)
    for i, cotangent in enumerate(cotangents):
        each = torch.autograd.grad(out, (q, k, v), cotangent, retain_graph=True)
        for got, want in zip(batched, each, strict=True):
            # float32 on CUDA: batched and single PyTorch operations around the kernels
            # may round differently, which the Lemma 3 backward amplifies
            torch.testing.assert_close(got[i], want, **tolerance)


def _float32_copies() -> Recorder:
    """Records the shapes of every conversion to float32."""
    def conversion(func, args, out):
        if func.overloadpacket.__name__ in ("_to_copy", "to") and isinstance(out, torch.Tensor) \
                and out.dtype == torch.float32 and args[0].dtype != torch.float32:
            return tuple(out.shape)
        return None
    return Recorder(conversion)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_bfloat16_makes_no_float32_copy_of_the_inputs(device, method):
    """Half inputs on the Triton path: only the m landmark rows become float32; outputs
    and gradients are the PyTorch path's (which converts) to bfloat16 rounding. But
    ``nystrom_softmax`` reads its queries in float32 where gradients are on
    (``queries_for_gradient``): one copy of q, and its output's gradient in float32."""
    n, m = 96, 16
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g).to(device, torch.bfloat16)
               for _ in range(3))
    mask = torch.ones(2, n, dtype=torch.bool, device=device)
    mask[0, 70:] = False
    results = []
    for kernel in ("torch", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with _float32_copies() as copies:
            out = skyformer.attention(*leaves, method, key_padding_mask=mask,
                                      kernel=kernel, num_features=m,
                                      generator=skyformer.random_key(2))
            grads = torch.autograd.grad(out.square().sum(), leaves)
        assert out.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in grads)
        results.append([out, *grads])
        if kernel == "triton":
            n_rows = [s for s in copies.items if n in s]
            # nystrom_softmax: q, then its output's gradient [B, H, N, Dv]
            assert n_rows == ([] if method == "skyformer" else
                              [q.shape, (*q.shape[:-1], v.shape[-1])]), n_rows
    for a, e in zip(*results, strict=True):
        assert relative_error(a, e) < 2e-2
    with _float32_copies() as copies, torch.no_grad():  # no gradient: no copy at all
        skyformer.attention(q, k, v, method, key_padding_mask=mask, kernel="triton",
                            num_features=m, generator=skyformer.random_key(2))
    assert not [s for s in copies.items if n in s], copies.items


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_landmark_rows_read_as_such_give_the_same_product(device, transpose,
                                                                  y_dtype, monkeypatch):
    """x = c x_bf16 with x_bf16 bfloat16 numbers (landmark rows of bfloat16 q, k): the
    kernels read x_bf16 and leave out the products with its zero lo part; outputs and
    gradients (of x, not x_bf16) are those of reading x, and at least as close to the
    float64 product (the dots with x_bf16 are exact, bf16x3 of x is not)."""
    n, m, d, r = 70, 33, 24, 40
    g = torch.Generator().manual_seed(6)
    c = 64 ** -0.25
    x_bf16 = torch.randn(2, m, d, generator=g).to(torch.bfloat16).float()
    x = x_bf16 * c
    y = torch.randn(2, n, d, generator=g).to(y_dtype)
    b = 0.5 * x.square().sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g)
    options = {"scale": c, "transpose": transpose}
    moved = [t.to(device) for t in (y, x, b, rhs)]
    flags = []  # what every launch is told about x
    _record_product_launches(monkeypatch,
                             lambda grid, kwargs, _: flags.append(kwargs["X_BF16"]))
    read_x = _product("triton", *moved, **options)
    assert flags and not any(flags)
    flags.clear()
    read_bf16 = _product("triton", *moved, x_bf16=x_bf16.to(device), x_factor=c, **options)
    assert flags and all(flags)
    exact = _product("torch", *(t.double() for t in (y, x, b, rhs)), **options)
    for got, before, want in zip(read_bf16, read_x, exact, strict=True):
        half = got.dtype == torch.bfloat16
        assert relative_error(got, before) < (1e-2 if half else 1e-4)
        if not half:  # up to float32's rounding of the sums (their order differs on CUDA)
            assert relative_error(got, want) <= relative_error(before, want) * 1.01 + 1e-6
    with pytest.raises(ValueError, match="x_bf16 must have x's shape and dtype"):
        gaussian_kernel_matmul(moved[0], moved[1], moved[3], moved[2],
                               x_bf16=x_bf16.double().to(device), kernel="triton", **options)


def _fills_and_adds(n: int, size: int) -> Recorder:
    """Records zero fills of ``size`` elements or more and additions that write a
    tensor of ``n`` rows."""
    def record(func, args, out):
        name = func.overloadpacket.__name__
        if not isinstance(out, torch.Tensor):
            return None
        if name in ("zeros", "new_zeros", "zeros_like", "zero_", "fill_", "slice_backward") \
                and out.numel() >= size:  # a slice's backward writes zeros around it
            return "fill"
        if name in ("add", "add_") and out.dim() >= 2 and out.shape[-2] == n:
            return "add"
        return None
    return Recorder(record)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_the_backward_pass_fills_no_tensor_of_the_inputs_size(device, method):
    """The landmark rows' gradient joins the products' gradient of q and k in one
    index_add (``gather_rows_through``): no zero tensor of q's size, and in Skyformer
    no N-row addition at all (there were two of each, three passes over q-sized
    memory a side; ``nystrom_softmax`` splits its output rather than slicing it, and
    adds the two gradients of v)."""
    n = 80
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g).to(device, torch.bfloat16)
               .requires_grad_(True) for _ in range(3))
    mask = torch.ones(2, n, dtype=torch.bool, device=device)
    mask[1, 60:] = False
    out = skyformer.attention(q, k, v, method, key_padding_mask=mask, kernel="triton",
                              num_features=16, generator=skyformer.random_key(3))
    with _fills_and_adds(n, q.numel()) as recorded:
        grads = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    assert "fill" not in recorded.items
    if method == "skyformer":
        assert recorded.items == []
    assert all(t.shape == (2, 3, n, 16) and t.isfinite().all() for t in grads)
    # nor a copy of the gradient of q or k: the landmark rows' gradient is added in place
    # (the out-of-place index_add made the peak of the whole call)
    copies = Recorder(lambda func, args, out: func.overloadpacket.__name__
                      if func.overloadpacket.__name__ == "index_add" else None)
    with copies:
        again = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert copies.items == []
    for a, b in zip(again, grads, strict=True):  # the graph's gradients, not doubled
        assert torch.equal(a, b)


@pytest.fixture
def newer_precision_api():
    """Sets a backend's ``fp32_precision`` (the per-backend API) for the test, and
    restores every one it set: "none" again lets the legacy getter answer."""
    before = {}

    def set_precision(backend, value):
        before.setdefault(backend, backend.fp32_precision)
        backend.fp32_precision = value

    yield set_precision
    for backend, value in before.items():
        backend.fp32_precision = value


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="this torch has no per-backend fp32_precision")
@pytest.mark.parametrize("device", devices())
def test_the_newer_matmul_precision_api_is_read(newer_precision_api, device):
    """Once a program sets the per-backend API, ``torch.get_float32_matmul_precision()``
    raises (torch 2.13); the kernels read the setting itself (``tf32_allowed``), and
    calls run."""
    if device == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")
    from skyformer.linalg.triton_kernels import _precision

    q = torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(9)).to(device)
    cuda, mkldnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    # the CPU backend's setting alone also makes the legacy getter raise
    for backend, setting, precision in ((mkldnn, "bf16", "tf32x3"), (cuda, "tf32", "tf32"),
                                        (cuda, "ieee", "tf32x3")):
        newer_precision_api(backend, setting)
        assert _precision(torch.float32) == precision
        out = skyformer.attention(q, q, q, "skyformer", kernel="triton", num_features=8,
                                  generator=skyformer.random_key(1))
        assert out.isfinite().all()


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        skyformer.attention(q, q, q, "skyformer", kernel="triton")


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ((3, 6), (2, 4), True),   # the interpreter calls int(array)
    ((3, 6), (2, 3), False),  # NumPy only warns
    ((3, 7), (2, 5), False),  # Triton squeezes first
    (None, (2, 5), False),    # no metadata (e.g. a source build): let it try
])
def test_an_interpreter_that_cannot_run_with_this_numpy_says_so(
        monkeypatch, triton_version, numpy_version, refused):
    """Triton < 3.7's interpreter fails deep inside with NumPy >= 2.4; the library names
    both versions and the fix before any launch."""
    from skyformer.linalg import kernel_backend

    problem = kernel_backend.interpreter_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    from skyformer.versions import installed_version, major_minor

    assert installed_version("no-such-distribution", "numpy") is not None
    assert major_minor("2.11.0+cu130") == (2, 11) and major_minor("5.0.0rc1") == (5, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernel_backend, "INTERPRETER_PROBLEM", problem)
    q = torch.randn(1, 1, 8, 4)
    if refused:
        with pytest.raises(RuntimeError, match=r"Triton 3\.6.*NumPy 2\.4.*triton>=3\.7"):
            skyformer.attention(q, q, q, "skyformer", kernel="triton")


@needs_interpreter
def test_float64_with_a_triton_before_3_5_takes_the_pytorch_core(monkeypatch):
    """Triton < 3.5 has no float64 tl.dot, which the fused Lemma 3 kernels use (the
    product kernels multiply float64 by broadcast sums): under such a Triton a float64
    call with kernel="triton" takes the PyTorch core and still gives the same output."""
    from skyformer.linalg import kernel_backend, lemma3_triton

    x = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    args = ("triton", x, 6, "iterative", "identity", 6)
    assert lemma3_triton.fused_lemma3_applies(*args) == (interpreter_on()
                                                         and kernel_backend.float64_dots())
    q, k, v = (torch.randn(1, 1, 160, 8, dtype=torch.float64, generator=torch.Generator()
                           .manual_seed(i)) for i in range(3))
    want = skyformer.attention(q, k, v, "skyformer", num_features=16, kernel="torch",
                               generator=skyformer.random_key(0))
    monkeypatch.setattr(kernel_backend, "TRITON_VERSION", (3, 4))
    assert not lemma3_triton.fused_lemma3_applies(*args)
    got = skyformer.attention(q, k, v, "skyformer", num_features=16, kernel="triton",
                              generator=skyformer.random_key(0))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_forward_mode_takes_the_pytorch_path_under_auto_and_triton_says_so():
    """The kernels have no forward-mode derivative: ``torch.func.jvp`` through
    ``"auto"`` takes the PyTorch path (the tangent equals ``"torch"``'s), ``"triton"``
    refuses in a sentence that names the way out."""
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=torch.float64) for _ in range(3))
    tangent = torch.randn_like(q)

    def jvp(kernel):
        return torch.func.jvp(
            lambda q: skyformer.attention(q, k, v, "skyformer", kernel=kernel,
                                          generator=skyformer.random_key(0)), (q,), (tangent,))

    torch.testing.assert_close(jvp("auto"), jvp("torch"))
    with pytest.raises(RuntimeError, match=r'forward-mode derivative.*kernel="auto"'):
        jvp("triton")


def test_the_products_precision_follows_the_rows_dtype_the_gpu_and_the_interpreter(monkeypatch):
    """bf16x3 for half rows on GPUs with bfloat16 tensor cores, its float32 form under
    the interpreter (whose bfloat16 tl.dot is wrong) whatever the tensors' device,
    tf32x3 / tf32 for float32 rows by PyTorch's matmul precision, IEEE for float64 and
    on GPUs without TF32 (before compute capability 8.0)."""
    from skyformer.linalg import triton_kernels

    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_kernels._precision(torch.float32, torch.bfloat16, cuda) == \
        "bf16x3-interpreted"
    assert triton_kernels._precision(torch.float32, torch.float32, cuda) == "tf32x3"
    assert triton_kernels._precision(torch.float64, torch.float64, cuda) == "ieee"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for capability, half, single in (((9, 0), "bf16x3", "tf32x3"), ((8, 0), "bf16x3", "tf32x3"),
                                     ((7, 5), "ieee", "ieee"), ((7, 0), "ieee", "ieee")):
        monkeypatch.setattr(triton_kernels, "_capability", lambda index, c=capability: c)
        assert triton_kernels._precision(torch.float32, torch.float16, cuda) == half
        # no TF32 before 8.0: three passes would be three float32 products
        assert triton_kernels._precision(torch.float32, torch.float32, cuda) == single
    monkeypatch.setattr(triton_kernels, "_capability", lambda index: (9, 0))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert triton_kernels._precision(torch.float32, torch.float32, cuda) == "tf32"
        assert triton_kernels._precision(torch.float32, torch.bfloat16, cuda) == "bf16x3"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_tiles_follow_the_gpu_generation():
    """sm_90's tiles by default (sm_90, sm_100); 32 x 32 where dots
    compile to mma.sync (Ampere, Ada, consumer Blackwell), 16 x 16 with eight warps
    where no MMA is used (before 8.0): compiled for those GPUs they spill nothing where
    sm_90's spill in the backward launches; float64 alike everywhere."""
    from skyformer.linalg import triton_kernels as tk

    for capability in (None, (9, 0), (10, 0)):
        assert tk.dot_family(capability) == "default"
        assert tk._row_tiles(64, 64, torch.float32, True, capability) == (64, 32, 4, 1)
        assert tk._col_tiles(64, 64, torch.float32, True, capability) == (64, 64, 4, 1)
    for capability, family, tiles in (((8, 0), "mma_sync", (32, 32, 4, 1)),
                                      ((8, 9), "mma_sync", (32, 32, 4, 1)),
                                      ((12, 0), "mma_sync", (32, 32, 4, 1)),
                                      ((7, 5), "fma", (16, 16, 8, 1)),
                                      ((7, 0), "fma", (16, 16, 8, 1))):
        assert tk.dot_family(capability) == family
        assert tk._row_tiles(64, 64, torch.float32, True, capability) == tiles
        assert tk._col_tiles(32, 32, torch.float32, False, capability) == tiles
        assert tk._row_tiles(64, 64, torch.float64, False, capability) == (16, 16, 4, 1)
    assert tk.device_capability(torch.device("cpu")) is None


@pytest.mark.parametrize("capability", [(8, 0), (7, 5)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]])
@pytest.mark.parametrize("transpose", [False, True])
def test_the_tiles_of_other_gpus_give_the_same_products(monkeypatch, triton_interpreter,
                                                        capability, case, transpose):
    """The products and their gradients with the tiles (and precision) chosen for an
    sm_80 and an sm_75 GPU, under the interpreter, against the PyTorch path."""
    from skyformer.linalg import triton_kernels

    n, m, d, r = case
    g = torch.Generator().manual_seed(n + m)
    y = torch.randn(2, n, d, generator=g)
    x = torch.randn(2, m, d, generator=g) * 0.7
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g)
    options = {"scale": d ** -0.25, "transpose": transpose}
    ref = _product("torch", y, x, b, rhs, **options)
    tiles = []
    original = triton_kernels._row_tiles if not transpose else triton_kernels._col_tiles

    def recording(*args):
        tiles.append(original(*args))
        return tiles[-1]

    monkeypatch.setattr(triton_kernels, "device_capability", lambda device: capability)
    monkeypatch.setattr(triton_kernels, "_col_tiles" if transpose else "_row_tiles",
                        recording)
    ours = _product("triton", y, x, b, rhs, **options)
    family = triton_kernels.dot_family(capability)
    width = max(triton_kernels.tile_width(d), triton_kernels.tile_width(r))
    assert tiles and tiles[0] == (triton_kernels.FAMILY_TILES[family] if width <= 64
                                  or family == "fma" else triton_kernels.WIDE_TILES[
                                      ("cols" if transpose else "rows", width, False)])
    _assert_products_close(ours, ref, torch.float32)


@pytest.mark.parametrize("capability", [(8, 0), (7, 5)])
@pytest.mark.parametrize("method", ["skyformer", "kernelized"])
@pytest.mark.parametrize(("d", "dtype"), [(64, torch.bfloat16), (32, torch.float32)])
def test_methods_with_the_tiles_of_other_gpus(monkeypatch, triton_interpreter, capability,
                                              method, d, dtype):
    """Skyformer's products and exact kernelized's flash kernels (which take other
    blocks there) with an sm_80 and an sm_75 GPU's choices, against the same call on
    the PyTorch path: outputs and gradients."""
    from skyformer.linalg import triton_kernels
    from skyformer.ops.kernelized import triton_flash

    q, k, v = (t.to(dtype) for t in make_qkv(1, 2, 70, d, seed=5, dtype=torch.float32))
    options = {} if method == "kernelized" else {"num_features": 16}

    def run(kernel):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, method, kernel=kernel,
                                  generator=skyformer.random_key(3), **options)
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    want = run("torch")
    monkeypatch.setattr(triton_kernels, "device_capability", lambda device: capability)
    if method == "kernelized":  # its key-gradient kernel takes other blocks there
        assert triton_flash.flash_tiles(dtype, d, "keys", capability) != \
            triton_flash.flash_tiles(dtype, d, "keys")
    got = run("triton")
    for a, e in zip(got, want, strict=True):
        assert relative_error(a.double(), e.double()) < (3e-2 if dtype == torch.bfloat16
                                                         else 2e-4)


def test_more_matrices_than_a_cuda_grid_holds_go_in_slices(monkeypatch, triton_interpreter):
    """CUDA grids hold at most 65535 along their second dimension, where the product
    kernels put the matrix index: a call with more matrices is launched in slices (here
    with the limit lowered to 4 for 6 matrices), with the same results."""
    from skyformer.linalg import triton_kernels

    q, k, v = (torch.randn(3, 2, 40, 16, generator=torch.Generator().manual_seed(i),
                           dtype=torch.float64) for i in range(3))

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, "skyformer", kernel="triton", num_features=8,
                                  generator=skyformer.random_key(1))
        return [out, *torch.autograd.grad(out.square().sum(), leaves)]

    expected = run()
    grids = []
    monkeypatch.setattr(triton_kernels, "MAX_GRID_YZ", 4)
    _record_product_launches(monkeypatch, lambda grid, kwargs, _: grids.append(grid))
    for a, e in zip(run(), expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert grids and max(grid[1] for grid in grids) == 4 and min(g[1] for g in grids) == 2


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
@pytest.mark.parametrize("selective", [False, True])
def test_activation_checkpointing_on_the_triton_path(method, selective):
    """Non-reentrant and selective activation checkpointing recompute the forward in
    the backward pass: the fused backward passes read each saved tensor once, and a
    policy that keeps the matrix products gets them unchanged."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).requires_grad_(True) for _ in range(3))

    def attend(q, k, v):
        return skyformer.attention(q, k, v, method, kernel="triton", num_features=8,
                                   generator=skyformer.random_key(3))

    def policy(ctx, op, *args, **kwargs):
        aten = torch.ops.aten
        return (CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.bmm.default,
                                                     aten.addmm.default, aten.baddbmm.default)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    want = torch.autograd.grad(attend(q, k, v).square().sum(), (q, k, v))
    options = {"context_fn": lambda: create_selective_checkpoint_contexts(policy)} \
        if selective else {}
    out = checkpoint(attend, q, k, v, use_reentrant=False, **options)
    for got, expected in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), want,
                             strict=True):
        torch.testing.assert_close(got, expected)


@triton.jit
def _exclude_offsets(OUT, s_rows, s_cols, BLOCK: tl.constexpr):
    """``triton_kernels.strided_offsets`` of rows and columns 0..BLOCK-1 (int32 index
    vectors, as the kernels' column blocks) into ``OUT [BLOCK, BLOCK]``."""
    index = tl.arange(0, BLOCK)
    tl.store(OUT + index[:, None] * BLOCK + index[None, :],
             triton_kernels.strided_offsets(index, s_rows, index, s_cols))


def test_exclude_offsets_past_2_31_are_int64(triton_interpreter):
    """The kernels read ``exclude`` at any strides: a transposed ``[m, N]`` mask has
    column stride N, so column j of it lies at j N, past 2^31 from m N = 2^31 (m = 128,
    N = 2^24: a 2 GiB mask) on, where int32 products wrapped to a wrong address (here
    the offsets alone, computed by the kernels' own function, with a stride of 2^28)."""
    out = torch.zeros(16, 16, dtype=torch.int64)
    _exclude_offsets[(1,)](out, 1, 2**28, BLOCK=16)
    rows, cols = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    assert torch.equal(out, rows + cols * 2**28)


def test_the_cols_kernel_slices_the_rows_for_eight_programs_per_multiprocessor(monkeypatch):
    """On a GPU of 132 SMs, Skyformer's cols launches at m = 128 (two column blocks) and
    B x H = 64 get ceil(8 x 132 / 128) = 9 row slices, each a whole number of row blocks;
    never more slices than row blocks; four programs per SM (``per_sm=4``, what the
    one-pass kernel asks for) give five."""
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    cuda = torch.device("cuda")
    assert triton_kernels.COLS_PROGRAMS_PER_SM == 8
    assert triton_kernels.row_slices(32768, 2 * 64, 64, cuda) == (9, 3648)
    assert triton_kernels.row_slices(32768, 2 * 64, 64, cuda, per_sm=4) == (5, 6592)
    assert triton_kernels.row_slices(300, 2 * 64, 64, cuda) == (5, 64)  # one block each
    slices, rows = triton_kernels.row_slices(1000, 2, 64, cuda)
    assert slices * rows >= 1000 > (slices - 1) * rows and rows % 64 == 0


@needs_interpreter
@pytest.mark.parametrize("slices", [1, 7, 64])
@pytest.mark.parametrize("transpose", [False, True])
def test_any_number_of_row_slices_gives_the_same_products(monkeypatch, slices, transpose):
    """The cols kernel's partial sums over row slices, however many a GPU's size asks for
    (one row block each, or the last one part-filled), add up to the PyTorch path's
    products and gradients; on the CPU the slices are otherwise at most two."""
    monkeypatch.setattr(triton_kernels, "_splits", lambda n, blocks, block_n, device,
                        per_sm=8: slices)
    n, m, d, r = 150, 20, 32, 16
    g = torch.Generator().manual_seed(slices)
    y = torch.randn(2, n, d, generator=g, dtype=torch.float64)
    x = torch.randn(2, m, d, generator=g, dtype=torch.float64) * 0.7
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=torch.float64)
    launches = []
    _record_product_launches(monkeypatch, lambda grid, kwargs, name: launches.append(
        (name, grid)))
    ours = _product("triton", y, x, b, rhs, scale=d ** -0.25, transpose=transpose)
    ref = _product("torch", y, x, b, rhs, scale=d ** -0.25, transpose=transpose)
    _assert_products_close(ours, ref, torch.float64)
    cols = [grid for name, grid in launches if name == "_cols_kernel"]
    rows = math.ceil(math.ceil(n / slices) / 16) * 16  # whole row blocks of 16 (float64)
    assert cols and all(grid[2] == math.ceil(n / rows) for grid in cols)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("row_norm", [False, True])
def test_row_offsets_scale_each_row_by_a_constant(device, transpose, row_norm):
    """``row_offset`` r_i multiplies row i of C by exp(-r_i) (+inf: a zero row), with or
    beside ``row_valid``, and passes no gradient: both paths give the block formed whole
    (``causal nystrom_softmax`` shifts its keys' rows so)."""
    dtype = _exact_dtype(device)
    n, m, d, r = 70, 24, 16, 8
    g = torch.Generator().manual_seed(11)
    y, x = (torch.randn(2, size, d, generator=g, dtype=dtype).to(device) * 0.7
            for size in (n, m))
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=dtype).to(device)
    offset = torch.rand(2, n, generator=g, dtype=dtype).to(device) * 3
    offset[0, 5] = float("inf")
    offset.requires_grad_(True)  # a constant all the same: no gradient reaches it
    valid = torch.ones(2, n, dtype=torch.bool, device=device)
    valid[1, 60:] = False
    scale = d ** -0.25

    def block(y, x, b, rhs):
        e = scale * y @ x.transpose(-1, -2) - b[:, None, :] - offset[..., None]
        if row_norm:
            e = e - 0.5 * scale * scale * (y * y).sum(-1, keepdim=True)
        c = torch.where(valid[..., None], e, float("-inf")).exp()
        return c.transpose(-1, -2) @ rhs if transpose else c @ rhs

    offset_ = offset
    offset = offset.detach()  # the reference's constant

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, b, rhs)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad((out * out.detach().sin()).sum(), leaves)]

    want = grads(block)
    for kernel in ("torch", "triton"):
        got = grads(lambda y, x, b, rhs, kernel=kernel: gaussian_kernel_matmul(
            y, x, rhs, b, scale=scale, row_norm=row_norm, row_valid=valid, row_offset=offset_,
            transpose=transpose, kernel=kernel))
        assert not got[0].requires_grad or torch.autograd.grad(
            got[0].sum(), offset_, allow_unused=True) == (None,)
        for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), got, want, strict=True):
            torch.testing.assert_close(a, e, **TOLERANCE[dtype], msg=f"{kernel} {name}")
