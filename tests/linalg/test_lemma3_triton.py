"""The Lemma 3 inverse in one Triton launch against the plain equations.

``naive_lemma3_inverse`` (explicit diagonal matrices, autograd through the Razavi steps)
is the reference for W and for the gradient of the landmark matrix; float64 under the
interpreter checks the hand-written adjoint to rounding, float32 (CPU interpreter or
CUDA) checks the kernel as the methods run it. Odd sizes (m = 1, m not a power of
two, m = 128), slots that hold no landmark, one and six iterations, vmap, compile.
"""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import (
    gaussian_kernel_block,
    half_sq_norm,
    landmark_inverse,
    lemma3_inverse,
)
from skyformer.linalg.kernel_backend import interpreter_on
from skyformer.ops.shared.nystrom_naive import naive_lemma3_inverse
from tests.devices import captured_in_graph, cuda_only, devices, relative_error
from tests.dispatch import Recorder

pytest.importorskip("triton")

CASES = [(1, 1, 1), (2, 3, 5), (1, 2, 16), (2, 1, 37), (1, 1, 128)]  # B, H, m
GAMMA = 0.1


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    callspec = getattr(request.node, "callspec", None)
    on_cpu = callspec is None or callspec.params.get("device", "cpu") == "cpu"
    if on_cpu and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")


def _landmark_matrix(b, h, m, dtype, device, *, dead=True, seed=0):
    """A Gaussian landmark kernel matrix [B, H, m, m] and its live slots [B, m]."""
    gen = torch.Generator().manual_seed(seed)
    x = 0.6 * torch.randn(b, h, m, 8, generator=gen, dtype=torch.float64)
    live = torch.rand(b, m, generator=gen) > 0.25 if dead else torch.ones(b, m, dtype=torch.bool)
    live[:, 0] = True
    norm = torch.where(live[:, None, :], half_sq_norm(x), torch.tensor(float("inf")).double())
    mat = gaussian_kernel_block(x, x, norm, norm)
    return mat.to(device, dtype), live.to(device)


def _reference(mat, live, iterations):
    """W by the naive equations, float64 on the CPU: dead slots get ridge 1."""
    mat, live = mat.double().cpu(), live.cpu()
    ridge = torch.where(live, torch.tensor(GAMMA, dtype=torch.float64), 1.0)[:, None, :]
    return naive_lemma3_inverse(mat + torch.diag_embed(ridge), 0.0, "iterative",
                                iterations, "identity")


def _value_and_grad(fn, mat, weights):
    leaf = mat.detach().clone().requires_grad_(True)
    w = fn(leaf)
    (grad,) = torch.autograd.grad((w * weights.to(w)).sum(), leaf)
    return w, grad


def _live_block(grad, live):
    """Gradient entries between live slots (the others multiply an exact zero of M,
    whose gradient reaches no input; the CPU path flushes them)."""
    keep = (live[:, None, :, None] & live[:, None, None, :]).to(grad.device)
    return torch.where(keep, grad, 0.0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("iterations", [1, 6])
def test_fused_lemma3_equals_the_equations(device, dtype, case, iterations):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 takes the PyTorch path on CUDA (lemma3_triton)")
    b, h, m = case
    mat, live = _landmark_matrix(b, h, m, dtype, device)
    weights = torch.randn(mat.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    w, grad = _value_and_grad(lambda t: lemma3_inverse(
        t, gamma=GAMMA, iterations=iterations, live=live, kernel="triton"), mat, weights)
    w_ref, grad_ref = _value_and_grad(lambda t: _reference(t, live, iterations),
                                      mat.double().cpu(), weights)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-4
    assert relative_error(w, w_ref) < tolerance
    assert relative_error(_live_block(grad, live), _live_block(grad_ref, live)) < tolerance


def _rows(b, h, m, d, dtype, device, seed=0):
    """Scaled landmark rows [B, H, m, D] and live slots [B, m] (one always live)."""
    gen = torch.Generator().manual_seed(seed)
    x = 1.2 / d**0.5 * torch.randn(b, h, m, d, generator=gen, dtype=torch.float64)
    live = torch.rand(b, m, generator=gen) > 0.25  # |x_i - x_j|^2 ~ 3: entries ~ 0.2
    live[:, 0] = True
    return x.to(device, dtype), live.to(device)


def _inverse_of_rows(x, live, kernel, iterations=6):
    # inf as a Python number: a tensor made from it on CUDA would be a host copy, which
    # a CUDA graph capture refuses
    norm = torch.where(live[:, None, :], half_sq_norm(x), float("inf"))
    return landmark_inverse(x, norm, gamma=GAMMA, iterations=iterations, live=live,
                            kernel=kernel)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("case", "dtype"), [
    *[(case, dtype) for case in [(1, 1, 1, 16), (2, 3, 5, 8), (1, 2, 37, 64), (1, 2, 37, 48)]
      for dtype in (torch.float64, torch.float32)],
    ((1, 1, 100, 100), torch.float64), ((1, 1, 128, 128), torch.float32)])
def test_fused_landmark_inverse_equals_the_equations(device, dtype, case):
    """From the landmark rows: the kernel forms C(X, X) too; W and the gradient of X
    (through the block and the norms) as the equations give them. The two largest sizes
    in one dtype each (under the interpreter they took 11 s a call): float64's exact
    check at m = 100, and at the kernel's largest m the GPU's float32."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 takes the PyTorch path on CUDA (lemma3_triton)")
    x, live = _rows(*case, dtype, device)
    weights = torch.randn(*case[:2], case[2], case[2], dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    w, grad = _value_and_grad(lambda t: _inverse_of_rows(t, live, "triton"), x, weights)

    def reference(t):
        t, lv = t.double().cpu(), live.cpu()
        norm = torch.where(lv[:, None, :], half_sq_norm(t), torch.tensor(float("inf")).double())
        return _reference(gaussian_kernel_block(t, t, norm, norm), lv, 6)

    w_ref, grad_ref = _value_and_grad(reference, x.double().cpu(), weights)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-4
    assert relative_error(w, w_ref) < tolerance
    assert relative_error(grad, grad_ref) < tolerance


def _chain_case(case, dtype, device, from_rows):
    """(call, source, reference, weights, live) of ``_chain`` for landmark rows of
    shape ``case`` (B, H, m, D) and weights of W; float64 on CUDA skipped."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 takes the PyTorch path on CUDA (lemma3_triton)")
    x, live = _rows(*case, dtype, device)
    weights = torch.randn(*case[:2], case[2], case[2], dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    return (*_chain(x, live, from_rows), weights, live)


def _chain(x, live, from_rows):
    """(call, source, reference) for the Lemma 3 chain of landmark rows ``x``: from the
    rows themselves (``from_rows``) or from their kernel block; the reference is the
    naive equations in float64."""
    if from_rows:
        def reference(t):
            t, lv = t.double().cpu(), live.cpu()
            n = torch.where(lv[:, None, :], half_sq_norm(t), torch.tensor(float("inf")).double())
            return _reference(gaussian_kernel_block(t, t, n, n), lv, 6)
        return (lambda t: _inverse_of_rows(t, live, "triton")), x, reference
    norm = torch.where(live[:, None, :], half_sq_norm(x), float("inf"))
    return ((lambda t: lemma3_inverse(t, gamma=GAMMA, live=live, kernel="triton")),
            gaussian_kernel_block(x, x, norm, norm), lambda t: _reference(t, live, 6))


def _assert_the_equations(w, grad, source, weights, live, reference, from_rows, dtype):
    """W and the gradient as the equations give them (float64: to rounding)."""
    w_ref, grad_ref = _value_and_grad(reference, source.double().cpu(), weights)
    assert relative_error(w, w_ref) < (1e-10 if dtype == torch.float64 else 2e-4)
    live_grad = grad if from_rows else _live_block(grad, live)
    live_ref = grad_ref if from_rows else _live_block(grad_ref, live)
    assert relative_error(live_grad, live_ref) < (1e-10 if dtype == torch.float64 else 2e-4)


def _launch_per_pass(monkeypatch, rows):
    """Both Lemma 3 kernels launched a pass at a time, ``rows`` rows a program."""
    from skyformer.linalg import triton_lemma3, triton_lemma3_backward

    default = triton_lemma3.launch_options

    def per_pass(m, backward=False, graphed=False, family="default"):
        option = default(m, backward, graphed, family)
        tile = min(rows, option["BLOCK"])
        return {**option, "ROWS": tile, "KC": tile, "PER_PASS": True}

    monkeypatch.setattr(triton_lemma3, "launch_options", per_pass)
    monkeypatch.setattr(triton_lemma3_backward, "launch_options", per_pass)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case, rows, from_rows, dtype", [
    ((1, 1, 1, 16), 16, True, torch.float64), ((2, 3, 5, 8), 16, False, torch.float64),
    ((1, 2, 37, 40), 16, True, torch.float64), ((2, 1, 37, 8), 32, False, torch.float32),
    ((1, 1, 65, 16), 32, True, torch.float32), ((1, 1, 65, 16), 32, False, torch.float64)])
def test_a_launch_per_pass_equals_one_program_per_matrix(monkeypatch, device, case, rows,
                                                         from_rows, dtype):
    """The chain as one launch a pass (a program per block of rows, the passes ordered
    by the stream) gives one program per matrix's W and gradient (the same products
    of the same tiles: to rounding) and the equations'."""
    call, source, reference, weights, live = _chain_case(case, dtype, device, from_rows)
    w_program, grad_program = _value_and_grad(call, source, weights)
    _launch_per_pass(monkeypatch, rows)
    with _operator_names() as calls:
        w, grad = _value_and_grad(call, source, weights)
    assert "skyformer::lemma3_inverse_backward" in calls.items
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(w, w_program) < tolerance
    assert relative_error(grad, grad_program) < tolerance
    _assert_the_equations(w, grad, source, weights, live, reference, from_rows, dtype)


@cuda_only
@pytest.mark.parametrize("per_pass", [False, True])
def test_a_cuda_graph_replays_the_kernels_as_captured(monkeypatch, per_pass):
    """Forward and backward captured in a CUDA graph (launch options read at capture)
    and replayed on new rows give what an eager call gives."""
    if per_pass:
        _launch_per_pass(monkeypatch, 16)
    x, live = _rows(2, 4, 128, 64, torch.float32, "cuda")
    leaf = x.clone().requires_grad_(True)
    weights = torch.randn(2, 4, 128, 128, device="cuda")

    def step():
        w = _inverse_of_rows(leaf, live, "triton")
        return w, torch.autograd.grad(w, leaf, weights)[0]

    graph, (w_graph, grad_graph) = captured_in_graph(step)
    with torch.no_grad():
        leaf.copy_(_rows(2, 4, 128, 64, torch.float32, "cuda", seed=3)[0])
    graph.replay()
    w, grad = step()
    assert relative_error(w_graph, w) < 1e-6
    assert relative_error(grad_graph, grad) < 1e-6


def test_rows_take_the_kernel_with_the_products():
    x, live = _rows(2, 2, 9, 8, torch.float32, "cpu")
    with _operator_names() as calls:
        _inverse_of_rows(x, live, "triton")
    assert "skyformer::lemma3_inverse_forward" in calls.items
    assert "aten::exp" not in calls.items  # C(X, X) formed in the kernel
    with _operator_names() as calls:
        _inverse_of_rows(x, live, "torch")
    assert "skyformer::lemma3_inverse_forward" not in calls.items


def _operator_names() -> Recorder:
    """Records the name of every operator dispatched (``.items``)."""
    return Recorder(lambda func, args, out: func.name())


@pytest.mark.parametrize("options, fused", [
    ({}, True),
    ({"init": "scaled_transpose"}, False),
    ({"pinv": "exact"}, False),
    ({"iterations": 0}, False),
])
def test_which_calls_take_the_kernel(options, fused):
    mat, live = _landmark_matrix(1, 2, 9, torch.float32, "cpu")
    with _operator_names() as calls:
        lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="triton", **options)
    assert ("skyformer::lemma3_inverse_forward" in calls.items) == fused
    with _operator_names() as calls:
        lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="torch", **options)
    assert "skyformer::lemma3_inverse_forward" not in calls.items


def test_an_unknown_kernel_is_refused_whatever_the_other_options():
    mat, live = _landmark_matrix(1, 1, 4, torch.float32, "cpu")
    for options in ({}, {"pinv": "exact"}, {"init": "scaled_transpose"}):
        with pytest.raises(ValueError, match="kernel must be one of"):
            lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="cuda", **options)


@pytest.mark.parametrize("m", [64, 65, 128])
def test_a_differentiated_call_takes_both_kernels_up_to_the_largest_size(m):
    """Forward and backward kernels up to MAX_M, with or without a gradient (the
    backward kernel keeps its matrices in scratch memory, not in registers)."""
    mat, live = _landmark_matrix(1, 1, m, torch.float32, "cpu", dead=False)
    with torch.no_grad(), _operator_names() as calls:
        w = lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="triton")
    assert "skyformer::lemma3_inverse_forward" in calls.items
    assert relative_error(w, _reference(mat, live, 6)) < 2e-4
    weights = torch.randn(mat.shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)
    with _operator_names() as calls:
        w, grad = _value_and_grad(lambda t: lemma3_inverse(
            t, gamma=GAMMA, live=live, kernel="triton"), mat, weights)
    assert "skyformer::lemma3_inverse_forward" in calls.items
    assert "skyformer::lemma3_inverse_backward" in calls.items
    _, grad_ref = _value_and_grad(lambda t: _reference(t, live, 6), mat.double(), weights)
    assert relative_error(grad, grad_ref) < 2e-4


def test_a_gradient_inside_vmap_reaches_the_backward_kernel():
    """Inside vmap a batched tensor does not say it requires a gradient; the backward
    pass of the mapped call takes the kernel and equals the PyTorch path's."""
    x, live = _rows(2, 3, 20, 8, torch.float32, "cpu")
    norm = torch.where(live[:, None, :], half_sq_norm(x), float("inf"))
    weights = torch.randn(2, 3, 20, 20, generator=torch.Generator().manual_seed(3))

    def mapped(rows):
        return torch.func.vmap(lambda r, n, lv: landmark_inverse(
            r[None], n[None], gamma=GAMMA, live=lv[None], kernel="triton")[0])(
            rows, norm, live)

    leaf = x.clone().requires_grad_(True)
    with _operator_names() as calls:
        (mapped(leaf) * weights).sum().backward()
    assert "skyformer::lemma3_inverse_forward" in calls.items
    assert "skyformer::lemma3_inverse_backward" in calls.items
    ref = x.clone().requires_grad_(True)
    (landmark_inverse(ref, norm, gamma=GAMMA, live=live, kernel="torch") * weights).sum() \
        .backward()
    assert relative_error(leaf.grad, ref.grad) < 2e-4


def test_vmap_over_single_matrices_and_rows_equals_a_loop():
    """vmap of a function of one [m, m] matrix (or [m, D] rows): the vmap rule folds
    the mapped dim into a batch dim, which a single matrix gets first."""
    x, _ = _rows(1, 3, 9, 4, torch.float64, "cpu")
    rows = x[0]  # [3, m, D]
    norms = half_sq_norm(rows)
    mats = gaussian_kernel_block(rows, rows, norms, norms)

    def from_matrix(m):
        return lemma3_inverse(m, gamma=GAMMA, kernel="triton")

    def from_rows(r, n):
        return landmark_inverse(r, n, gamma=GAMMA, kernel="triton")

    torch.testing.assert_close(torch.func.vmap(from_matrix)(mats),
                               torch.stack([from_matrix(m) for m in mats]))
    torch.testing.assert_close(torch.func.vmap(from_rows)(rows, norms),
                               torch.stack([from_rows(r, n) for r, n in zip(rows, norms,
                                                                            strict=True)]))


def test_more_landmarks_than_the_kernel_holds_take_pytorch():
    mat, live = _landmark_matrix(1, 1, 130, torch.float32, "cpu", dead=False)
    with _operator_names() as calls:
        w = lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="triton")
    assert "skyformer::lemma3_inverse_forward" not in calls.items
    assert relative_error(w, _reference(mat, live, 6)) < 1e-4


@pytest.mark.parametrize("device", devices())
def test_vmap_and_compile_see_the_same_kernel(device):
    mat, live = _landmark_matrix(3, 2, 12, torch.float32, device)
    direct = lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="triton")
    mapped = torch.func.vmap(lambda t, lv: lemma3_inverse(
        t[None], gamma=GAMMA, live=lv[None], kernel="triton")[0])(mat, live)
    torch.testing.assert_close(mapped, direct, rtol=0, atol=0)
    leaf = mat.clone().requires_grad_(True)
    compiled = torch.compile(lambda t: lemma3_inverse(t, gamma=GAMMA, live=live,
                                                      kernel="triton"), fullgraph=True)
    out = compiled(leaf)
    out.sum().backward()
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    _, grad = _value_and_grad(lambda t: lemma3_inverse(t, gamma=GAMMA, live=live,
                                                       kernel="triton"),
                              mat, torch.ones(mat.shape, dtype=torch.float64))
    torch.testing.assert_close(leaf.grad, grad, rtol=0, atol=0)


@pytest.mark.parametrize("fails", ["forward", "backward"])
def test_a_failing_kernel_under_auto_warns_once_and_falls_back(monkeypatch, fails):
    """Triton installed but unable to compile or launch the core (forward or backward):
    "auto" warns, gives the PyTorch path's W and gradient, and stays on PyTorch."""
    from skyformer.linalg import lemma3_triton, triton_lemma3, triton_lemma3_backward

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(lemma3_triton.CORE_FALLBACK, "failures", set())
    monkeypatch.setattr(lemma3_triton, "use_triton", lambda kernel, t: kernel != "torch")
    module = triton_lemma3 if fails == "forward" else triton_lemma3_backward
    monkeypatch.setattr(module, f"lemma3_{fails}", broken)
    mat, live = _landmark_matrix(2, 2, 9, torch.float32, "cpu")
    weights = torch.randn(mat.shape, dtype=torch.float64)
    want = _value_and_grad(lambda t: lemma3_inverse(t, gamma=GAMMA, live=live, kernel="torch"),
                           mat, weights)
    with pytest.warns(RuntimeWarning, match="Lemma 3 kernel failed"):
        got = _value_and_grad(lambda t: lemma3_inverse(t, gamma=GAMMA, live=live,
                                                       kernel="auto"), mat, weights)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert lemma3_triton.CORE_FALLBACK.failed
    assert not lemma3_triton.fused_lemma3_applies("auto", mat, 9, "iterative", "identity", 6)
    with pytest.raises(RuntimeError, match="out of resources"):  # "triton" insists
        _value_and_grad(lambda t: lemma3_inverse(t, gamma=GAMMA, live=live, kernel="triton"),
                        mat, weights)


def test_running_out_of_gpu_memory_is_not_a_kernel_failure(monkeypatch):
    """An out-of-memory error propagates under "auto" (the PyTorch path would need
    more memory) and leaves the kernel in use for later calls."""
    from skyformer.linalg import lemma3_triton, triton_ops

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(lemma3_triton.CORE_FALLBACK, "failures", set())
    monkeypatch.setattr(lemma3_triton, "use_triton", lambda kernel, t: kernel != "torch")
    monkeypatch.setattr(triton_ops, "lemma3_forward", out_of_memory)
    mat, live = _landmark_matrix(1, 1, 9, torch.float32, "cpu")
    with pytest.raises(torch.OutOfMemoryError):
        lemma3_inverse(mat, gamma=GAMMA, live=live, kernel="auto")
    assert not lemma3_triton.CORE_FALLBACK.failed


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_the_core_backward_runs_before_the_key_products_backward(method):
    """W is formed after C(X_S, K) V (``NystromCore.inverse``), so autograd runs the
    Lemma 3 backward, with its scratch and saved iterates, before that product's
    backward makes the gradients of k and v: not on top of them (the peak of a call)."""
    import skyformer

    q, k, v = (torch.randn(1, 2, 48, 16, generator=torch.Generator().manual_seed(i))
               .requires_grad_(True) for i in range(3))
    out = skyformer.attention(q, k, v, method, num_features=8, kernel="triton",
                              generator=skyformer.random_key(1))
    order = Recorder(lambda func, args, out: func.overloadpacket.__name__
                     if func.namespace == "skyformer" else None)
    with order:
        out.square().sum().backward()
    core = order.items.index("lemma3_inverse_backward")
    # two launches (rows, cols) for each product's backward: C(Q, X_S) Z's, then C^T V's
    assert order.items[:core] == ["gaussian_rows_product", "gaussian_cols_product"]
    assert order.items[core + 1:] == ["gaussian_rows_product", "gaussian_cols_product"]
