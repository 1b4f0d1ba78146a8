"""Non-finite rows marked where the Gaussian products read them
(``gaussian_kernel_matmul(show_nonfinite=True)``, ``linalg/nonfinite.py``), and
Skyformer's calls that rely on it instead of the guard's passes (``registry/guard.py``).

The products: C @ rhs marks row i where y_i holds a NaN or inf; C^T @ rhs marks every
entry where a valid row of y or rhs holds one; rows that ``row_valid`` drops carry no
mark; everything else is bit for bit the unmarked product. The inputs are chosen so
that the product's own arithmetic would not make the NaN (an infinite row whose
kernel entries are exact zeros), on each path: the Triton kernels (under the
interpreter), the PyTorch path, the operators' PyTorch fallback.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import skyformer
from skyformer.linalg import gaussian_kernel_matmul
from skyformer.registry import autocast, guard
from skyformer.sketch.landmarks import uniform_landmarks
from tests.conftest import gen
from tests.devices import cuda_only, needs_interpreter
from tests.reliability.test_guard import _expected_rows

pytest.importorskip("triton")

INF, NAN = float("inf"), float("nan")


def _product_inputs(dtype):
    """y [2, 2, 13, 8] whose row 4 of matrix (0, 1) is -inf in its first entry; x [.., 5, 8]
    with positive first entries, so that the row's kernel entries are exp(-inf) = 0 and the
    unmarked product hides it. Each first entry is a bfloat16 number h times 1 + 2^-12, so
    that the bf16x3 products of bfloat16 rows split it as h + h 2^-12, both parts
    positive: a negative low part would meet the -inf as +inf, and -inf + inf = NaN (to
    nearest, as a GPU splits, about half the entries have one)."""
    y = torch.randn(2, 2, 13, 8, generator=gen(1), dtype=torch.float64)
    x = torch.randn(2, 2, 5, 8, generator=gen(2), dtype=torch.float64) * 0.3
    x[..., 0] = (x[..., 0].abs() + 0.5).bfloat16().double() * (1 + 2 ** -12)
    y[0, 1, 4, 0] = -INF
    return y.to(dtype), x.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _product(path, monkeypatch, *args, **kwargs):
    """gaussian_kernel_matmul on ``path``: "triton", "torch", or "fallback" (the
    operators with the kernels made to fail, under "auto")."""
    if path != "fallback":
        return gaussian_kernel_matmul(*args, kernel=path, **kwargs)
    from skyformer.linalg import kernel_matmul, kernel_matmul_triton, triton_kernels

    def broken(*_, **__):
        raise RuntimeError("simulated compile failure")

    with monkeypatch.context() as patch:
        patch.setattr(kernel_matmul, "use_triton", lambda kernel, t: True)
        patch.setattr(kernel_matmul_triton.PRODUCT_FALLBACK, "failures", set())
        for name in ("rows_product", "cols_product"):
            patch.setattr(triton_kernels, name, broken)
        with pytest.warns(RuntimeWarning, match="simulated compile failure"):
            return gaussian_kernel_matmul(*args, kernel="auto", **kwargs)


PATHS = ["triton", "torch", "fallback"]


@needs_interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_rows_product_marks_each_non_finite_row(monkeypatch, path, dtype):
    y, x = _product_inputs(dtype)
    y[1, 0, 7, 3] = NAN
    z = torch.randn(2, 2, 5, 3, generator=gen(3), dtype=x.dtype)
    b = 0.5 * (x * x).sum(-1)
    plain = _product(path, monkeypatch, y, x, z, b, scale=0.7)
    assert plain[0, 1, 4].isfinite().all()  # the product alone hides the -inf
    marked = _product(path, monkeypatch, y, x, z, b, scale=0.7, show_nonfinite=True)
    rows = torch.zeros(2, 2, 13, dtype=torch.bool)
    rows[0, 1, 4] = rows[1, 0, 7] = True
    assert marked[rows].isnan().all()
    assert torch.equal(marked[~rows], plain[~rows])


@needs_interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bad", ["y", "rhs", "dropped"])
def test_the_transposed_product_marks_its_matrix_for_one_valid_non_finite_row(
        monkeypatch, path, dtype, bad):
    y, x = _product_inputs(dtype)
    y[0, 1, 4, 0] = 0.0
    v = torch.randn(2, 2, 13, 3, generator=gen(4), dtype=dtype)
    valid = torch.ones(2, 1, 13, dtype=torch.bool)
    valid[0, :, 11:] = False
    if bad == "y":
        y[0, 1, 4, 0] = -INF
    elif bad == "rhs":
        v[0, 1, 6, 2] = INF
    else:  # in a row that row_valid drops: no mark (its entries of C are 0 as it is)
        y[0, 1, 11, 0] = -INF
    b = 0.5 * (x * x).sum(-1)
    args = (y, x, v, b)
    options = {"scale": 0.7, "row_valid": valid, "transpose": True}
    plain = _product(path, monkeypatch, *args, **options)
    spoiled = torch.zeros(2, 2, dtype=torch.bool)
    spoiled[0, 1] = bad != "dropped"
    # the product alone hides the -inf; the value's inf it keeps in its column of the
    # one matrix, as inf (or NaN on the Triton path for bfloat16 rows, where the bf16x3
    # split of a weight has a negative low part: inf - inf)
    assert plain[..., :2].isfinite().all() and plain[~spoiled].isfinite().all()
    if bad == "rhs":
        assert not plain[0, 1, :, 2].isfinite().any()
    else:
        assert plain.isfinite().all()
    if dtype == torch.float64 or path != "triton":
        assert not plain.isnan().any()
    marked = _product(path, monkeypatch, *args, show_nonfinite=True, **options)
    assert marked[spoiled].isnan().all()
    assert torch.equal(marked[~spoiled], plain[~spoiled])


@needs_interpreter
@pytest.mark.parametrize("transpose", [False, True])
def test_marks_leave_the_gradients_of_finite_inputs_as_they_are(transpose):
    """The marks are constants to the backward pass (0 here)."""
    y, x = _product_inputs(torch.float64)
    y[0, 1, 4, 0] = 0.0
    rhs = torch.randn(2, 2, 13 if transpose else 5, 3, generator=gen(5), dtype=torch.float64)
    grads = []
    for marks in (False, True):
        inputs = [t.clone().requires_grad_() for t in (y, x, rhs)]
        out = gaussian_kernel_matmul(*inputs, None, scale=0.7, transpose=transpose,
                                     kernel="triton", show_nonfinite=marks)
        out.backward(torch.randn(out.shape, generator=gen(6), dtype=out.dtype))
        grads.append([t.grad for t in inputs])
    for plain, marked in zip(*grads, strict=True):
        assert torch.equal(plain, marked)


def _skyformer(q, k, v, mask, kernel="triton"):
    return skyformer.attention(q, k, v, "skyformer", num_features=4, kernel=kernel,
                               key_padding_mask=mask, generator=skyformer.random_key(3))


def _landmark_rows(b, nq, nk, mask):
    """[B, N] bool per side: the rows ``_skyformer`` draws as landmarks."""
    marks = uniform_landmarks(4, batch=b, query_len=nq, key_len=nk, query_valid=mask,
                              key_valid=mask, device=torch.device("cpu"),
                              generator=skyformer.random_key(3))
    sides = []
    for index, n in ((marks.query_index, nq), (marks.key_index, nk)):
        rows = torch.zeros(b, n, dtype=torch.bool)
        rows.scatter_(1, index, True)
        sides.append(rows)
    return sides


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_skyformer_marks_the_rows_the_guard_would_mark(request, seed, dtype, device):
    """Non-finite entries in rows that are not landmarks (a landmark's NaN spoils W,
    hence every row, whoever marks): the NaN rows of the guard's definition, every
    other row as the guard's call gives it, and no call of the guard."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = 2, 2, 12, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))
    mask = torch.rand(b, n, generator=g) > 0.25 if seed % 2 else None
    if device == "cpu":
        request.getfixturevalue("triton_interpreter")  # skips where it is off
    kernel = "triton" if device == "cpu" else "auto"  # "auto" takes the kernels on CUDA
    q_landmarks, k_landmarks = _landmark_rows(b, n, n, mask)
    values = torch.tensor([NAN, INF, -INF], dtype=dtype)
    for t, landmarks in ((q, q_landmarks), (k, k_landmarks), (v, None)):
        hits = torch.rand(t.shape, generator=g) < 0.02
        if landmarks is not None:
            hits &= ~landmarks[:, None, :, None]
        t[hits] = values[torch.randint(0, 3, (int(hits.sum()),), generator=g)]
    q, k, v = (t.to(device) for t in (q, k, v))
    mask = None if mask is None else mask.to(device)
    with mock.patch.object(autocast, "show_nonfinite", side_effect=AssertionError("called")):
        got = _skyformer(q, k, v, mask, kernel)
    with mock.patch.object(autocast, "marked_by_core", lambda *_: False):
        want = _skyformer(q, k, v, mask, kernel)
    zq, zk, zv = guard.zero_padding(q, k, v, mask, "auto")
    rows = _expected_rows(zq, zk, zv, mask)
    assert got[rows].isnan().all()
    assert torch.equal(got[~rows], want[~rows])


@needs_interpreter
def test_the_guard_runs_where_the_products_do_not_mark():
    """The PyTorch path on the CPU, and the causal form: the guard marks the rows."""
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen(seed)) for seed in (7, 8, 9))
    with mock.patch.object(autocast, "show_nonfinite", wraps=guard.show_nonfinite) as shown:
        _skyformer(q, k, v, None, kernel="torch")
        skyformer.attention(q, k, v, "skyformer", causal=True, num_features=4,
                            kernel="triton", generator=skyformer.random_key(3))
        _skyformer(q, k, v, None)  # the Triton products mark
    assert shown.call_count == 2


@needs_interpreter
@pytest.mark.parametrize("path", PATHS)
def test_a_row_whose_squared_norm_overflows_is_marked_not_lost(monkeypatch, path):
    """Float32 entries of 1e20: |y_i|^2 overflows, the row's kernel entries would all be
    exp(-inf) = 0 (the row silently zero); marked, it is NaN."""
    y, x = _product_inputs(torch.float32)
    y[0, 1, 4] = 1e20
    z = torch.randn(2, 2, 5, 3, generator=gen(3))
    plain = _product(path, monkeypatch, y, x, z, None, scale=0.7)
    assert torch.equal(plain[0, 1, 4], torch.zeros(3))
    marked = _product(path, monkeypatch, y, x, z, None, scale=0.7, show_nonfinite=True)
    assert marked[0, 1, 4].isnan().all()
    assert marked[0, 1, :4].isfinite().all()
