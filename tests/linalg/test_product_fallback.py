"""``kernel="auto"``'s safety net for the Gaussian block products (``PRODUCT_FALLBACK``):
a product kernel that cannot compile or launch (made to fail here, as one that cannot
compile for an older GPU would), forward or backward, gives the PyTorch path's results
with one warning, and later calls do not try it; running out of memory propagates and
``"triton"`` insists. On CPU tensors under Triton's interpreter, the products' choice
forced onto the kernels where ``"auto"`` asks (it takes them on CUDA only).
"""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch

import skyformer
from skyformer.linalg import gaussian_kernel_matmul
from tests.conftest import gen, grads_and_warnings, make_qkv
from tests.devices import needs_interpreter

pytest.importorskip("triton")
pytestmark = needs_interpreter

FAILURE = "simulated compile failure"
TIGHT = {"rtol": 1e-10, "atol": 1e-12}  # float64: the same values up to rounding


@pytest.fixture(autouse=True)
def _auto_takes_the_kernels(monkeypatch):
    """``"auto"`` takes the product kernels for any CPU tensor; ``failures`` reset after."""
    from skyformer.linalg import kernel_matmul, kernel_matmul_triton

    monkeypatch.setattr(kernel_matmul, "use_triton", lambda kernel, t: kernel != "torch")
    monkeypatch.setattr(kernel_matmul_triton.PRODUCT_FALLBACK, "failures", set())


def _fallback():
    from skyformer.linalg.kernel_matmul_triton import PRODUCT_FALLBACK

    return PRODUCT_FALLBACK


def _break_kernels(monkeypatch, calls, error=None):
    """Both product kernels raise ``error`` (a compile failure by default), appending to
    ``calls``."""
    from skyformer.linalg import triton_kernels

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(FAILURE) if error is None else error

    for name in ("rows_product", "cols_product"):
        monkeypatch.setattr(triton_kernels, name, broken)


def _inputs():
    q, k, v = (torch.randn(2, 2, 21, 8, generator=gen(seed), dtype=torch.float64)
               for seed in (1, 2, 3))
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, 15:] = False
    return (q, k, v), mask


def _attention(kernel, mask):
    return lambda q, k, v: skyformer.attention(q, k, v, "skyformer", key_padding_mask=mask,
                                               kernel=kernel, num_features=6,
                                               generator=skyformer.random_key(5))


def _close(got, want):
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, **TIGHT)


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_a_failing_product_kernel_under_auto_warns_once_and_falls_back(monkeypatch, fails):
    """Skyformer's products: the PyTorch path's output and gradients, one warning,
    ``failed`` set, and a later call that does not try the kernels; ``"triton"``
    raises."""
    inputs, mask = _inputs()
    want, _ = grads_and_warnings(_attention("torch", mask), inputs, seed=7)
    calls = []

    def break_kernels():
        _break_kernels(monkeypatch, calls)

    if fails == "forward":
        break_kernels()
        got, warned = grads_and_warnings(_attention("auto", mask), inputs, seed=7)
    else:  # the kernels run forward, then fail in the backward pass
        got, warned = grads_and_warnings(_attention("auto", mask), inputs, break_kernels, seed=7)
    _close(got, want)
    assert len(warned) == 1 and FAILURE in warned[0], warned
    assert _fallback().failed and calls == [1]
    from skyformer.linalg import product_fallback

    used = []  # later calls take the chunked PyTorch path up front, not the operators
    for name in ("rows_product", "cols_product"):
        monkeypatch.setattr(product_fallback, name,
                            _counted(getattr(product_fallback, name), used))
    again, warned = grads_and_warnings(_attention("auto", mask), inputs, seed=7)
    _close(again, want)
    assert warned == [] and calls == [1] and used == []  # not tried again
    with pytest.raises(RuntimeError, match=FAILURE):  # "triton" insists
        grads_and_warnings(_attention("triton", mask), inputs, seed=7)


def test_a_failure_around_the_operators_falls_back_in_eager_code(monkeypatch):
    """Triton installed but failing to import (a broken install): an eager ``"auto"``
    call takes the PyTorch path, with one warning; ``"triton"`` raises."""
    from skyformer.linalg import kernel_matmul_triton

    def broken():
        raise ImportError("triton: undefined symbol")

    monkeypatch.setattr(kernel_matmul_triton, "_ops", broken)
    inputs, mask = _inputs()
    want, _ = grads_and_warnings(_attention("torch", mask), inputs, seed=7)
    got, warned = grads_and_warnings(_attention("auto", mask), inputs, seed=7)
    _close(got, want)
    assert len(warned) == 1 and "undefined symbol" in warned[0] and _fallback().failed
    with pytest.raises(ImportError, match="undefined symbol"):
        _attention("triton", mask)(*inputs)


def test_running_out_of_memory_in_a_product_kernel_propagates(monkeypatch):
    """Not the kernel's failure (the PyTorch path would need more memory): it propagates
    under ``"auto"`` and leaves the kernels in use."""
    calls = []
    _break_kernels(monkeypatch, calls, torch.OutOfMemoryError("CUDA out of memory"))
    inputs, mask = _inputs()
    with pytest.raises(torch.OutOfMemoryError):
        _attention("auto", mask)(*inputs)
    assert calls == [1] and not _fallback().failed


def _fail_in(monkeypatch, dtypes, calls):
    """Both product kernels fail for rows y in ``dtypes`` (as kernels that cannot compile
    in one dtype would) and run for the others; ``calls`` gets y's dtype at each
    launch."""
    from skyformer.linalg import triton_kernels

    def failing(kernel):
        def launch(y, *args, **kwargs):
            calls.append(y.dtype)
            if y.dtype in dtypes:
                raise RuntimeError(FAILURE)
            return kernel(y, *args, **kwargs)

        return launch

    for name in ("rows_product", "cols_product"):
        monkeypatch.setattr(triton_kernels, name, failing(getattr(triton_kernels, name)))


def _small_product(dtype, kernel="auto"):
    """C Z for 7 rows and 3 landmarks in ``dtype``, with leaves for its gradients."""
    g = gen(8)
    y, x, z = (torch.randn(1, rows, 4, generator=g, dtype=dtype).requires_grad_(True)
               for rows in (7, 3, 3))
    out = gaussian_kernel_matmul(y, x, z, 0.5 * (x * x).sum(-1), kernel=kernel)  # caller
    return out, (y, x, z)


def _line(function, marker="# caller"):
    """The line of ``function``'s source that ends in ``marker``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, text in enumerate(lines) if text.rstrip().endswith(marker))


def _warnings_of(call):
    """(call's result, the RuntimeWarnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [w for w in caught if w.category is RuntimeWarning]


def test_a_failure_in_one_dtype_leaves_the_kernels_to_the_others(monkeypatch):
    """Kernels that fail in float64 give way to PyTorch for float64 alone, with one
    warning naming it: float32 keeps them, and its own failure warns again."""
    calls = []
    _fail_in(monkeypatch, {torch.float64}, calls)
    (out, _), warned = _warnings_of(lambda: _small_product(torch.float64))
    torch.testing.assert_close(out, _small_product(torch.float64, "torch")[0], **TIGHT)
    assert len(warned) == 1 and "float64 tensors on cpu" in str(warned[0].message)
    assert calls == [torch.float64]
    (out, _), warned = _warnings_of(lambda: _small_product(torch.float32))
    torch.testing.assert_close(out, _small_product(torch.float32, "torch")[0])
    assert warned == [] and calls == [torch.float64, torch.float32]  # the kernel ran
    (_, _), warned = _warnings_of(lambda: _small_product(torch.float64))
    assert warned == [] and calls == [torch.float64, torch.float32]  # not tried again
    one64, one32 = torch.ones(1, dtype=torch.float64), torch.ones(1)
    assert _fallback().failed_on(one64) and not _fallback().failed_on(one32)
    _fail_in(monkeypatch, {torch.float32, torch.float64}, calls)
    (_, _), warned = _warnings_of(lambda: _small_product(torch.float32))
    assert len(warned) == 1 and "float32 tensors on cpu" in str(warned[0].message)
    assert _fallback().failed_on(one32)


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_the_warning_points_at_the_callers_line(monkeypatch, fails):
    """Raised inside a custom operator (and autograd's engine, for a backward kernel),
    the warning names the caller's line: the call of the product, or of its gradient."""
    calls = []
    if fails == "forward":
        _fail_in(monkeypatch, {torch.float64}, calls)
        _, warned = _warnings_of(lambda: _small_product(torch.float64))
        line = _line(_small_product)
    else:
        out, leaves = _small_product(torch.float64)
        _fail_in(monkeypatch, {torch.float64}, calls)
        _, warned = _warnings_of(lambda: torch.autograd.grad(out.sum(), leaves))  # caller
        line = _line(test_the_warning_points_at_the_callers_line)
    assert len(warned) == 1 and calls == [torch.float64]
    assert (warned[0].filename, warned[0].lineno) == (__file__, line)


def _counted(function, calls):
    """``function``, appending to ``calls`` at each call."""
    def run(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return run


def _product(kernel, y, x, b, rhs, **options):
    leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, b, rhs)]
    out = gaussian_kernel_matmul(leaves[0], leaves[1], leaves[3], leaves[2], kernel=kernel,
                                 **options)
    weights = torch.randn(out.shape, generator=gen(1), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return [t.double().nan_to_num() for t in (out, *grads)]  # a dead column's db: NaN


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("row_norm", [False, True])
@pytest.mark.parametrize("read", ["float64", "bfloat16 rows", "x_bf16"])
def test_the_fallback_computes_every_option_of_the_kernels(monkeypatch, transpose, row_norm,
                                                           read):
    """What the operators compute instead of a failing kernel (``product_fallback``),
    forward and backward, against the PyTorch path: invalid rows, a dead column,
    excluded entries, row shifts, a column of ones, half-type rows, x read as bfloat16
    numbers."""
    from skyformer.linalg import product_fallback

    _break_kernels(monkeypatch, [])
    used = []
    for name in ("rows_product", "cols_product"):
        monkeypatch.setattr(product_fallback, name,
                            _counted(getattr(product_fallback, name), used))
    n, m, d, r = 40, 9, 8, 5
    g = gen(4)
    y = torch.randn(2, n, d, generator=g, dtype=torch.float64)
    x = 0.5 * torch.randn(2, m, d, generator=g, dtype=torch.float64)
    b = 0.5 * (x * x).sum(-1)
    rhs = torch.randn(2, n if transpose else m, r, generator=g, dtype=torch.float64)
    options = {"scale": 0.7, "row_norm": row_norm, "transpose": transpose,
               "shift_rows": not transpose, "ones_column": True,
               "row_valid": torch.rand(2, n, generator=g) > 0.3,
               "exclude": (torch.rand(2, m, n, generator=g) > 0.8).transpose(-1, -2)}
    tolerance = TIGHT
    if read == "bfloat16 rows":  # read as they are, computed in float32
        y, x, b = y.bfloat16(), x.float(), b.float()
        rhs = rhs.bfloat16() if transpose else rhs.float()
        tolerance = {"rtol": 1e-2, "atol": 1e-2}  # N-row results rounded to bfloat16
    elif read == "x_bf16":
        options["x_bf16"] = x.bfloat16().double()
        x = 3.0 * options["x_bf16"]
        b = 0.5 * (x * x).sum(-1)
        options["x_factor"] = 3.0
    b[:, 4] = float("inf")  # a dead column
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _product("auto", y, x, b, rhs, **options)
    warned = [w for w in caught if w.category is RuntimeWarning]
    assert len(warned) == 1 and FAILURE in str(warned[0].message) and _fallback().failed
    assert len(used) >= 3  # the forward and backward products, computed in the operators
    options.pop("x_bf16", None)
    want = _product("torch", y.to(x.dtype), x, b, rhs.to(x.dtype), **options)
    for name, a, e in zip(("out", "dy", "dx", "db", "drhs"), got, want, strict=True):
        scale = e.abs().max().item()  # bfloat16 rows: relative to the largest entry
        torch.testing.assert_close(a, e, rtol=tolerance["rtol"],
                                   atol=tolerance["atol"] * max(scale, 1.0), msg=name)


class _WideTilesTooLarge:
    """A Triton kernel whose launches with tiles ``option`` = ``width`` (``BLOCK_R``, a
    product kernel's value tiles, by default) are refused as Triton refuses a kernel
    that needs more shared memory than the GPU has (``OutOfResources``, which the
    interpreter never raises: ``need`` bytes of ``limit``); others run. ``launches``
    counts the ``option`` of each launch tried."""

    def __init__(self, kernel, width, launches, option="BLOCK_R", need=(114688, 101376)):
        self.kernel, self.width, self.launches = kernel, width, launches
        self.option, self.need = option, need

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def launch(*args, **options):
            self.launches.append(options[self.option])
            if options[self.option] == self.width:
                raise OutOfResources(*self.need, "shared memory")
            return self.kernel[grid](*args, **options)

        return launch


def test_tiles_the_gpu_cannot_hold_take_pytorch_for_those_shapes_alone(monkeypatch):
    """A product kernel compiled for wide value tiles can need more shared memory a block
    than a GPU has (nystrom_softmax, float32, Dv = 128 on an RTX/L4 GPU: 112 KiB of 99).
    That refusal was taken for the kernel's own failure: every float32 product on the
    device then took the PyTorch path. Now those shapes alone do, with one warning;
    "triton" raises in a sentence."""
    from skyformer.linalg import triton_kernels, triton_limits
    from skyformer.linalg.kernel_backend import KernelTooLarge

    monkeypatch.setattr(triton_limits, "_TOO_LARGE", {})
    launches = []
    for name in ("_rows_kernel", "_cols_kernel"):
        monkeypatch.setattr(triton_kernels, name,
                            _WideTilesTooLarge(getattr(triton_kernels, name), 64, launches))
    y, x = (torch.randn(2, 21, 8, generator=gen(s), dtype=torch.float64) for s in (1, 2))
    wide, narrow = (torch.randn(2, 6, r, generator=gen(3), dtype=torch.float64)
                    for r in (40, 4))
    x = x[:, :6]

    def product(rhs, kernel):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = gaussian_kernel_matmul(y, x, rhs, None, kernel=kernel)
        return out, [str(w.message) for w in caught if w.category is RuntimeWarning]

    want = gaussian_kernel_matmul(y, x, wide, None, kernel="torch")
    got, warned = product(wide, "auto")
    torch.testing.assert_close(got, want, **TIGHT)
    assert len(warned) == 1 and re.search(
        r"the Triton rows product kernel for these shapes \(tiles of head dim 16 and value "
        r"width 64, torch\.float64 rows\) needs 112 KiB of shared memory a block, more "
        r"than the 99 KiB of cpu \(cpu\); computing the products with PyTorch operations "
        r"\(.*\) for these shapes from now on \(other shapes keep the Triton path\)\.$",
        warned[0]), warned
    assert launches == [64] and not _fallback().failed
    torch.testing.assert_close(product(wide, "auto")[0], want, **TIGHT)
    assert launches == [64]  # refused again without a launch, and without a warning
    out, warned = product(narrow, "auto")  # other shapes keep the kernel
    torch.testing.assert_close(out, gaussian_kernel_matmul(y, x, narrow, None,
                                                           kernel="torch"), **TIGHT)
    assert warned == [] and launches == [64, 16]
    # inside a CUDA graph capture too: the refusal comes before any CUDA call
    from skyformer.linalg import kernel_backend

    with monkeypatch.context() as capturing:
        capturing.setattr(kernel_backend, "_capturing", lambda on: True)
        torch.testing.assert_close(product(wide, "auto")[0], want, **TIGHT)
    with pytest.raises(KernelTooLarge, match=r"needs 112 KiB of shared memory .* "
                                             r"kernel=\"auto\" takes the PyTorch path for "
                                             r"these shapes, kernel=\"torch\" for every"):
        product(wide, "triton")
    # the rows' dtype is y's (bfloat16 rows compile other tiles), not the landmarks'
    with pytest.raises(KernelTooLarge, match=r"torch\.bfloat16 rows\) needs 112 KiB"):
        gaussian_kernel_matmul(y.bfloat16(), x.float(), wide.float(), None, kernel="triton")


def test_flash_tiles_the_gpu_cannot_hold_take_the_augmentation_for_those_shapes_alone(
        monkeypatch):
    """Exact kernelized attention's key-gradient kernel at a wide head dim can need more
    shared memory than a GPU has (float32, head dim 512: 192 KiB, an A100 holds 163).
    Under "auto" those shapes' gradients come from the SDPA augmentation, with one
    warning, and narrower heads keep the kernels; the dtype is not marked failed."""
    from skyformer.linalg import triton_limits
    from skyformer.ops.kernelized import flash, triton_flash

    monkeypatch.setattr(triton_limits, "_TOO_LARGE", {})
    monkeypatch.setattr(flash.FLASH_FALLBACK, "failures", set())
    launches = []
    monkeypatch.setattr(triton_flash, "_flash_key_grad_kernel", _WideTilesTooLarge(
        triton_flash._flash_key_grad_kernel, 32, launches, "BLOCK_D", (196608, 166912)))

    def gradients(d, auto):
        leaves = [t.requires_grad_(True) for t in make_qkv(1, 2, 9, d, seed=4)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flash.flash_kernelized(*leaves, None, d ** -0.5, False, auto).sum().backward()
        return [t.grad for t in leaves], [str(w.message) for w in caught
                                          if w.category is RuntimeWarning]

    def augmented(d):
        from skyformer.ops.kernelized.sdpa_augmentation import kernelized_by_sdpa

        leaves = [t.requires_grad_(True) for t in make_qkv(1, 2, 9, d, seed=4)]
        kernelized_by_sdpa(*leaves, d ** -0.5, key_valid=None, causal=False).sum().backward()
        return [t.grad for t in leaves]

    got, warned = gradients(32, True)
    _close(got, augmented(32))
    assert len(warned) == 1 and re.search(
        r"the Triton flash key gradient kernel for these shapes \(tiles of head dim 32 and "
        r"value width 32, torch\.float64 rows\) needs 192 KiB of shared memory a block, "
        r"more than the 163 KiB of cpu", warned[0]), warned
    assert launches == [32] and not flash.FLASH_FALLBACK.failed
    got, warned = gradients(16, True)  # other shapes keep the kernels
    _close(got, augmented(16))
    assert warned == [] and launches == [32, 16]
    from skyformer.linalg.kernel_backend import KernelTooLarge

    with pytest.raises(KernelTooLarge, match="needs 192 KiB of shared memory"):
        gradients(32, False)
