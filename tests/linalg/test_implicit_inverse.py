"""``pinv_gradient="implicit"``: the Lemma 3 core run to the bound's number of steps and
differentiated as an inverse, against the ridge inverse (M + diag(ridge))^-1 formed by
``torch.linalg.inv`` and differentiated by autograd, on landmarks clustered so tightly
that 6 steps are far from it (the case the bound is about)."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg import (
    gaussian_kernel_block,
    half_sq_norm,
    implicit_inverse,
    implicit_iterations,
    implicit_pinv,
    inverse_residual,
    iterative_pinv,
    landmark_inverse,
    lemma3_inverse,
)
from skyformer.linalg.implicit_inverse import residual_bound
from skyformer.linalg.kernel_backend import interpreter_on
from skyformer.linalg.newton_inverse import (
    newton_floor,
    newton_lower_end,
    newton_residual_bound,
    newton_scales,
    newton_steps,
)
from tests.devices import devices, relative_error

GAMMA = 0.1


def _clustered_rows(b, h, m, d, dtype, device, *, spread=0.05, dead=True, seed=0):
    """Scaled landmark rows ``[B, H, m, D]`` within ``spread`` of one point (C(X, X)
    near the all-ones matrix: lambda_min(A) near gamma / (m + gamma)) and live slots."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen, dtype=torch.float64) \
        + spread * torch.randn(b, h, m, d, generator=gen, dtype=torch.float64)
    live = torch.rand(b, m, generator=gen) > 0.25 if dead else torch.ones(b, m, dtype=torch.bool)
    live[:, 0] = True
    return x.to(device, dtype), live.to(device)


def _norms(x, live):
    return torch.where(live[:, None, :], half_sq_norm(x), float("inf"))


def _ridge_matrix(x, live):
    """C(X, X) + diag(ridge), ridge gamma (1 on dead slots)."""
    norm = _norms(x, live)
    ridge = torch.where(live, torch.tensor(GAMMA, dtype=x.dtype),
                        torch.tensor(1.0, dtype=x.dtype))[:, None, :]
    return gaussian_kernel_block(x, x, norm, norm) + torch.diag_embed(ridge)


def _ridge_inverse(x, live):
    """(C(X, X) + diag(ridge))^-1 by ``torch.linalg.inv``."""
    return torch.linalg.inv(_ridge_matrix(x, live))


def _lemma3_matrix(x, live):
    """A = D^-1/2 (C(X, X) + diag(ridge)) D^-1/2, the matrix the core inverts."""
    m = _ridge_matrix(x, live)
    d = m.sum(-1).rsqrt()
    return d[..., :, None] * m * d[..., None, :]


# The PyTorch path on CPU tensors factorises; "torch-steps" forces its steps, which
# GPU tensors run.
PATHS = ["torch", "torch-steps", "triton"]


def _kernel_of(path, monkeypatch):
    """The ``kernel`` option for ``path`` (``PATHS``), the steps forced for
    ``"torch-steps"``; skips ``"triton"`` where the interpreter is off."""
    if path == "triton":
        pytest.importorskip("triton")
        if not interpreter_on():
            pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    if path == "torch-steps":
        monkeypatch.setattr(implicit_inverse, "_resolve_solver", lambda solver, a: "steps")
    return "triton" if path == "triton" else "torch"


def _value_and_grad(fn, x, weights):
    leaf = x.detach().clone().requires_grad_(True)
    w = fn(leaf)
    (grad,) = torch.autograd.grad((w * weights.to(w)).sum(), leaf)
    return w, grad


def _implicit(x, live, kernel, iterations=6):
    return landmark_inverse(x, _norms(x, live), gamma=GAMMA, iterations=iterations,
                            live=live, kernel=kernel, gradient="implicit")


def test_the_bound_is_the_residual_of_coinciding_landmarks():
    """All m >= 2 landmarks at one point (M = 1 1^T) reach the bound: A has the
    eigenvalue gamma / (m + gamma), and ||I - A V_K||_2 = 1 - f^K of it, for every K."""
    for m in (2, 16, 128):
        a = (torch.ones(m, m, dtype=torch.float64) + GAMMA * torch.eye(m, dtype=torch.float64)) \
            / (m + GAMMA)
        for k in (1, 3, 6):
            residual = inverse_residual(a, iterative_pinv(a, k, init="identity")).item()
            assert residual == pytest.approx(residual_bound(m, GAMMA, k), rel=1e-9, abs=1e-15)


def test_the_steps_are_those_the_bound_needs_in_the_dtype():
    assert implicit_iterations(128, GAMMA, torch.float32) == 9
    assert implicit_iterations(128, GAMMA, torch.float64) == 10
    assert implicit_iterations(64, GAMMA, torch.float32) == 8
    assert implicit_iterations(128, GAMMA, torch.float32, at_least=12) == 12
    k = implicit_iterations(256, GAMMA, torch.float32)
    lower = GAMMA / (256 + GAMMA)
    assert newton_residual_bound(lower, k, torch.float32) <= torch.finfo(torch.float32).eps / 2 \
        < newton_residual_bound(lower, k - 1, torch.float32)
    assert k == 9 and residual_bound(256, GAMMA, k) > 1e-7  # Razavi's steps need 10
    with pytest.raises(ValueError, match="gamma > 0"):
        implicit_iterations(128, 0.0, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_newton_schedule_takes_its_interval_to_the_roundoff(dtype):
    """The scales of K steps are made for [newton_lower_end(K), 1]: that interval's end
    reaches 1 - roundoff in K steps and every eigenvalue inside it follows; one that
    rounding left a little above 1 stays positive (below zero the steps diverge)."""
    roundoff = torch.finfo(dtype).eps / 2

    def steps(x, k):
        for alpha in newton_scales(k, dtype):
            x = alpha * x * (2 - alpha * x)
        return x

    for k in (1, 2, 5, 9, 30):
        lower = newton_lower_end(k, dtype)
        assert newton_residual_bound(lower, k, dtype) <= roundoff * 1.001 + 1e-15
        for x in (lower, (lower + 1) / 2, 1.0):
            assert 1 - steps(x, k) <= roundoff * 1.001 + 1e-15
        assert steps(1.0 + 0.5 * newton_floor(dtype), k) > 0
    # the bound's steps make the schedule's interval hold Lemma 3's
    for m in (1, 16, 128, 512):
        k = implicit_iterations(m, GAMMA, dtype)
        assert newton_lower_end(k, dtype) <= GAMMA / (m + GAMMA)


def test_coinciding_landmarks_reach_the_roundoff_in_the_bounds_steps():
    """All landmarks at one point (M = 1 1^T): A has its least eigenvalue at Lemma 3's
    bound, gamma / (m + gamma); the bound's Newton steps leave a residual of rounding,
    one step fewer a larger one (float64)."""
    for m in (2, 16, 128):
        a = (torch.ones(m, m, dtype=torch.float64) + GAMMA * torch.eye(m, dtype=torch.float64)) \
            / (m + GAMMA)
        k = implicit_iterations(m, GAMMA, torch.float64)
        assert inverse_residual(a, newton_steps(a[None], k)[0]).item() < 1e-10
        assert inverse_residual(a, newton_steps(a[None], k - 1)[0]).item() > 1e-8


@pytest.mark.parametrize("solver", ["steps", "cholesky"])
def test_the_implicit_gradient_is_that_of_the_inverse(solver):
    """dA = -V^T G V^T for a non-symmetric G, and it equals autograd through
    ``torch.linalg.inv`` once the steps are those of the bound (or by the
    factorisation)."""
    x, live = _clustered_rows(2, 3, 20, 8, torch.float64, "cpu", dead=False)
    norm = _norms(x, live)
    m = gaussian_kernel_block(x, x, norm, norm) + GAMMA * torch.eye(20, dtype=torch.float64)
    d = m.sum(-1).rsqrt()
    a = (d[..., :, None] * m * d[..., None, :]).requires_grad_(True)
    g = torch.randn(a.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    steps = implicit_iterations(20, GAMMA, torch.float64)
    v = implicit_pinv(a, steps, solver)
    (grad,) = torch.autograd.grad(v, a, g)
    assert torch.allclose(grad, -(v.mT @ g @ v.mT), atol=0, rtol=1e-12)
    a_exact = a.detach().clone().requires_grad_(True)
    (grad_exact,) = torch.autograd.grad(torch.linalg.inv(a_exact), a_exact, g)
    assert relative_error(grad, grad_exact) < 1e-10
    # with 6 steps the same inputs are far from the inverse: the bound is what makes
    # the implicit gradient the gradient of the forward pass
    a6 = a.detach().clone().requires_grad_(True)
    (grad6,) = torch.autograd.grad(iterative_pinv(a6, 6, init="identity"), a6, g)
    assert relative_error(grad6, grad_exact) > 1e-4


@pytest.mark.parametrize("solver", ["steps", "cholesky"])
def test_vmap_and_grad_of_the_implicit_steps_equal_a_loop(solver):
    """Per-sample gradients of [heads, m, m] batches, as the methods call it."""
    x, live = _clustered_rows(4, 3, 6, 4, torch.float64, "cpu", dead=False)
    norm = _norms(x, live)
    mats = gaussian_kernel_block(x, x, norm, norm) + torch.eye(6, dtype=torch.float64)

    def loss(a):
        return (implicit_pinv(a, 8, solver) ** 2).sum()

    batched = torch.func.vmap(torch.func.grad(loss))(mats)
    looped = torch.stack([torch.func.grad(loss)(a) for a in mats])
    assert torch.allclose(batched, looped, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-13), (torch.float32, 2e-5)])
def test_the_factorisation_and_the_steps_give_one_inverse_and_gradient(dtype, tolerance):
    """The Cholesky solver (``"auto"`` on the CPU) and the bound's steps both give
    A^-1 of clustered landmarks (the bound's worst case) with dead slots, to rounding,
    and the same implicit gradient."""
    x, live = _clustered_rows(2, 3, 48, 16, dtype, "cpu")
    a = _lemma3_matrix(x, live)
    exact = torch.linalg.inv(a.double())
    steps = implicit_iterations(48, GAMMA, dtype)
    g = torch.randn(a.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
    results = {}
    for solver in ("auto", "steps", "cholesky"):
        leaf = a.detach().clone().requires_grad_(True)
        w = implicit_pinv(leaf, steps, solver)
        results[solver] = (w, *torch.autograd.grad(w, leaf, g))
        assert relative_error(w.double(), exact) < tolerance, solver
    for solver in ("auto", "steps"):
        for got, want in zip(results[solver], results["cholesky"], strict=True):
            assert relative_error(got.double(), want.double()) < tolerance, solver
    assert torch.equal(results["auto"][0], results["cholesky"][0])


@pytest.mark.parametrize("m", [128, 256])
@pytest.mark.parametrize("spread", [0.05, 1.0])
def test_in_float32_the_factorisation_is_as_accurate_as_the_steps(m, spread):
    """Against the float64 inverse, for tight clusters (lambda_min(A) near the bound)
    and spread landmarks: the factorisation that replaces the steps on the CPU loses
    no accuracy (measured 0.3-0.9x the steps' error)."""
    x, live = _clustered_rows(1, 2, m, 64, torch.float64, "cpu", spread=spread, dead=False)
    a = _lemma3_matrix(x / 64 ** 0.25, live)
    # one matrix at a time: batched torch.linalg.inv fails from about 150 x 150 once
    # torch.set_num_threads has run (conftest), pytorch/pytorch#142815
    exact = torch.stack([torch.linalg.inv(one) for one in a.flatten(0, 1)]).view_as(a)
    steps = implicit_iterations(m, GAMMA, torch.float32)
    errors = {solver: relative_error(implicit_pinv(a.float(), steps, solver).double(), exact)
              for solver in ("steps", "cholesky")}
    assert errors["cholesky"] <= 1.2 * errors["steps"], errors


@pytest.mark.parametrize("m", [64, 256])
@pytest.mark.parametrize("spread", [0.01, 0.1, 1.0])
def test_in_float32_the_newton_steps_are_as_accurate_as_razavis(m, spread):
    """Against the float64 inverse: the scaled Newton steps at the bound's K lose no
    accuracy to Razavi's ordinary steps at theirs (measured 0.6-1.01x their error, at
    m = 64 to 512; at m = 256 Newton needs 9 steps, Razavi 10)."""
    x, live = _clustered_rows(1, 2, m, 16, torch.float64, "cpu", spread=spread, dead=False)
    a = _lemma3_matrix(x, live).flatten(0, 1)
    exact = torch.stack([torch.linalg.inv(one) for one in a])  # pytorch/pytorch#142815
    roundoff = torch.finfo(torch.float32).eps / 2
    razavi_steps = next(k for k in range(1, 40) if residual_bound(m, GAMMA, k) <= roundoff)
    newton = newton_steps(a.float(), implicit_iterations(m, GAMMA, torch.float32))
    razavi = iterative_pinv(a.float(), razavi_steps, init="identity")
    assert relative_error(newton.double(), exact) <= 1.1 * relative_error(razavi.double(), exact)


def test_the_razavi_solver_differentiates_the_authors_steps_as_an_inverse():
    """``solver="razavi"`` (the study of benchmarks/implicit_core_gradient.py): the
    forward value of Razavi's unconverged steps, the gradient -V^T G V^T of that V."""
    x, live = _clustered_rows(1, 2, 12, 8, torch.float64, "cpu", dead=False)
    a = _lemma3_matrix(x, live).detach().requires_grad_(True)
    g = torch.randn(a.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = implicit_pinv(a, 2, "razavi")
    razavi = iterative_pinv(a.detach(), 2, init="identity")
    assert torch.equal(w, razavi) and inverse_residual(a, w).max() > 1e-3  # unconverged
    (grad,) = torch.autograd.grad(w, a, g)
    v_t = razavi.transpose(-1, -2)
    assert relative_error(grad, -(v_t @ g @ v_t)) < 1e-14


def test_a_matrix_that_is_not_positive_definite_takes_the_steps():
    """A batch with a matrix whose factorisation fails (indefinite, NaN; in float32 a
    Lemma 3 matrix of many tightly clustered landmarks with a tiny gamma) gets the
    steps' V_K eagerly, not the inverse of a partial factor; NaN in traced code."""
    a = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)
    a[1, 0, 0] = -0.5
    assert torch.equal(implicit_pinv(a, 3, "cholesky"), implicit_pinv(a, 3, "steps"))
    traced = torch.compile(lambda a: implicit_pinv(a, 3, "cholesky"), fullgraph=True,
                           backend="aot_eager")(a)
    assert traced[1].isnan().all() and torch.equal(traced[0], torch.eye(4, dtype=a.dtype))
    a[1, 0, 0] = float("nan")  # on the diagonal: the factorisation reads the lower half
    assert implicit_pinv(a, 3, "cholesky")[1].isnan().any()
    with pytest.raises(ValueError, match="solver must be one of"):
        implicit_pinv(a, 3, "lu")


@pytest.mark.parametrize("solver", ["auto", "cholesky"])
def test_a_matrix_that_is_not_symmetric_is_inverted_by_lu(solver):
    """The Cholesky factorisation reads the lower triangle alone: a matrix that is not
    symmetric gets its own inverse (by LU) on the CPU, not that of the symmetric matrix
    of its lower triangle."""
    gen = torch.Generator().manual_seed(0)
    a = 0.8 * torch.eye(4, dtype=torch.float64) \
        + 0.05 * torch.randn(2, 4, 4, dtype=torch.float64, generator=gen)
    steps = implicit_iterations(4, GAMMA, torch.float64)
    assert relative_error(implicit_pinv(a, steps, solver), torch.linalg.inv(a)) < 1e-13


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_matrices_take_the_steps(dtype):
    """The CPU has no half-precision Cholesky: ``"auto"`` runs the steps for them."""
    a = (torch.eye(6, dtype=torch.float64) * 0.5 + 0.05).expand(2, 6, 6)
    w = implicit_pinv(a.to(dtype), 12)
    assert w.dtype == dtype
    assert relative_error(w, torch.linalg.inv(a[0])) < 2e-2


@pytest.mark.parametrize("shape", [(5, 5), (2, 5, 5), (2, 3, 5, 5)])
@pytest.mark.parametrize("solver", ["steps", "cholesky"])
def test_jacrev_of_the_implicit_inverse_is_that_of_the_inverse(shape, solver):
    """``torch.func.jacrev`` maps the backward pass over the Jacobian's rows, one
    matrix alone included (the saved iterate keeps a batch dim for that)."""
    a = (0.5 * torch.eye(5, dtype=torch.float64) + 0.05).expand(*shape).contiguous()
    jacobian = torch.func.jacrev(lambda t: implicit_pinv(t, 12, solver))(a)
    assert torch.allclose(jacobian, torch.func.jacrev(torch.linalg.inv)(a), atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [(1, 1, 1, 8), (2, 3, 5, 8), (1, 2, 37, 16), (1, 1, 128, 64)])
def test_the_core_is_the_ridge_inverse_with_its_gradient(path, case, monkeypatch):
    """float64: W and the gradient of the landmark rows (through the block and the
    norms) are those of (C(X, X) + diag(ridge))^-1, dead slots included."""
    kernel = _kernel_of(path, monkeypatch)
    x, live = _clustered_rows(*case, torch.float64, "cpu")
    weights = torch.randn(*case[:3], case[2], dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1))
    w, grad = _value_and_grad(lambda t: _implicit(t, live, kernel), x, weights)
    w_ref, grad_ref = _value_and_grad(lambda t: _ridge_inverse(t, live), x, weights)
    live_block = live[:, None, :, None] & live[:, None, None, :]
    assert relative_error(torch.where(live_block, w, 0), torch.where(live_block, w_ref, 0)) \
        < 1e-10
    assert relative_error(grad, grad_ref) < 1e-9


@pytest.mark.parametrize("device", devices())
def test_the_kernels_give_the_pytorch_paths_implicit_gradient_in_float32(device):
    """The Triton path (interpreter on the CPU, compiled on CUDA) against the PyTorch
    path, both implicit, float32, 9 steps at m = 128 and dead slots."""
    pytest.importorskip("triton")
    if device == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    x, live = _clustered_rows(2, 2, 128, 32, torch.float32, device, spread=0.3)
    weights = torch.randn(2, 2, 128, 128, generator=torch.Generator().manual_seed(1))
    w, grad = _value_and_grad(lambda t: _implicit(t, live, "triton"), x, weights)
    w_ref, grad_ref = _value_and_grad(lambda t: _implicit(t, live, "torch"), x, weights)
    assert relative_error(w, w_ref) < 1e-4
    assert relative_error(grad, grad_ref) < 1e-3


def test_a_launch_per_pass_gives_one_programs_implicit_gradient(monkeypatch):
    pytest.importorskip("triton")
    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    from tests.linalg.test_lemma3_triton import _launch_per_pass

    x, live = _clustered_rows(1, 2, 37, 16, torch.float64, "cpu")
    weights = torch.randn(1, 2, 37, 37, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(2))
    w_program, grad_program = _value_and_grad(lambda t: _implicit(t, live, "triton"), x,
                                              weights)
    _launch_per_pass(monkeypatch, 16)
    w, grad = _value_and_grad(lambda t: _implicit(t, live, "triton"), x, weights)
    assert relative_error(w, w_program) < 1e-12
    assert relative_error(grad, grad_program) < 1e-12


def test_the_kernel_keeps_the_last_iterate_alone_for_the_backward_pass():
    """An implicit call holds two m x m matrices a head for its backward pass (the
    forward kernel's last two iterates), an unrolled one all K."""
    pytest.importorskip("triton")
    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    x, live = _clustered_rows(1, 2, 16, 8, torch.float32, "cpu", dead=False)
    x.requires_grad_(True)
    stores = {}
    for gradient in ("unrolled", "implicit"):
        w = landmark_inverse(x, _norms(x, live), gamma=GAMMA, iterations=6, kernel="triton",
                             gradient=gradient)
        stores[gradient] = w.grad_fn.saved_tensors[-1].shape[1]
    assert stores == {"unrolled": 6, "implicit": 2}


def test_the_matrix_entry_point_takes_the_option_too():
    x, live = _clustered_rows(1, 1, 12, 4, torch.float64, "cpu", dead=False)
    norm = _norms(x, live)
    mat = gaussian_kernel_block(x, x, norm, norm)
    w = lemma3_inverse(mat, gamma=GAMMA, gradient="implicit")
    assert relative_error(w, torch.linalg.inv(mat + GAMMA * torch.eye(12).double())) < 1e-12
    with pytest.raises(ValueError, match="gradient must be one of"):
        lemma3_inverse(mat, gamma=GAMMA, gradient="exact")
    with pytest.raises(ValueError, match="iterative inverse from the identity"):
        lemma3_inverse(mat, gamma=GAMMA, init="scaled_transpose", gradient="implicit")


def _attention_grads(method, q, k, v, weights, **options):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = skyformer.attention(*leaves, method, num_features=24,
                              generator=skyformer.random_key(0), **options)
    return out, torch.autograd.grad((out * weights).sum(), leaves)


@pytest.mark.parametrize("path", ["torch", "torch-steps"])
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "skyformer_adaptive"])
def test_methods_with_the_implicit_gradient_equal_the_exact_ridge_inverse(method, path,
                                                                          monkeypatch):
    """Whole calls, float64, clustered queries and keys: output and dQ, dK, dV as with
    ``pinv="exact"`` (the ridge inverse), where the default 6 unrolled steps differ."""
    _kernel_of(path, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    centre = torch.randn(16, generator=gen, dtype=torch.float64)
    q, k = (centre + 0.05 * torch.randn(1, 2, 48, 16, generator=gen, dtype=torch.float64)
            for _ in range(2))
    v = torch.randn(1, 2, 48, 16, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, 2, 48, 16, generator=gen, dtype=torch.float64)
    out, grads = _attention_grads(method, q, k, v, weights, kernel="torch",
                                  pinv_gradient="implicit")
    out_ref, grads_ref = _attention_grads(method, q, k, v, weights, kernel="torch",
                                          pinv="exact")
    assert relative_error(out, out_ref) < 1e-9
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert relative_error(g, g_ref) < 1e-7
    _, grads6 = _attention_grads(method, q, k, v, weights, kernel="torch")
    assert max(relative_error(g, g_ref) for g, g_ref in zip(grads6, grads_ref, strict=True)) \
        > 1e-5


@pytest.mark.parametrize("options, problem", [
    ({"pinv": "exact"}, "iterative inverse from the identity"),
    ({"pinv_init": "scaled_transpose"}, "iterative inverse from the identity"),
    ({"gamma": 0.0}, "needs gamma > 0"),
])
def test_what_the_implicit_gradient_needs_is_checked_with_the_options(options, problem):
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match=problem):
        skyformer.attention(q, q, q, "skyformer", pinv_gradient="implicit", **options)
    with pytest.raises(ValueError, match="pinv_gradient must be one of"):
        skyformer.attention(q, q, q, "skyformer", pinv_gradient="exact")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_compile_fullgraph_equals_eager(kernel):
    """Dynamo and AOT autograd through the implicit Function (PyTorch path) and the
    Triton operators' implicit variants: outputs and gradients as eager."""
    if kernel == "triton":
        pytest.importorskip("triton")
        if not interpreter_on():
            pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    from tests.pt2.test_stack_matrix import _assert_compiled_equals_eager

    _assert_compiled_equals_eager(skyformer.get_method("skyformer").bind(
        kernel=kernel, pinv_gradient="implicit"), 160)


def test_forward_mode_agrees_with_the_implicit_reverse_mode():
    """Forward mode runs the same steps in plain operators (their unrolled derivative);
    at the bound's number of steps it is the implicit gradient's transpose to rounding."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, tangent, u = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64)
                           for _ in range(5))

    def f(q):
        return skyformer.attention(q, k, v, "skyformer", num_features=16, kernel="torch",
                                   pinv_gradient="implicit", generator=skyformer.random_key(2))

    _, forward = torch.func.jvp(f, (q,), (tangent,))
    leaf = q.clone().requires_grad_(True)
    (reverse,) = torch.autograd.grad(f(leaf), leaf, u)
    assert (u * forward).sum().item() == pytest.approx((reverse * tangent).sum().item(),
                                                       rel=1e-10)


@pytest.mark.parametrize("iterations", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_newton_chain_is_the_pytorch_paths_steps(iterations, dtype):
    """The implicit forward kernel runs the scaled Newton steps, paired
    (``triton_lemma3.chains``): the W of ``newton_steps`` on the PyTorch path, to
    rounding in float64 and, in float32, as close to the exact inverse as Razavi's
    ordinary chain at the bound's steps, on clustered landmarks with dead slots."""
    pytest.importorskip("triton")
    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    from skyformer.linalg import triton_lemma3

    x, live = _clustered_rows(2, 2, 37, 16, dtype, "cpu")
    flat, norm = x.reshape(4, 37, 16), _norms(x, live).reshape(4, 37)
    ridge = torch.where(live, torch.tensor(GAMMA, dtype=dtype), torch.tensor(1.0, dtype=dtype))
    chain = triton_lemma3.lemma3_forward(flat, norm, ridge, iterations, backward=False,
                                         implicit=True)
    a = _lemma3_matrix(x, live)
    scale = _ridge_matrix(x, live).sum(-1).rsqrt()
    steps = (scale[..., :, None] * newton_steps(a.reshape(4, 37, 37), iterations)
             .reshape(a.shape) * scale[..., None, :]).reshape(4, 37, 37)
    last = (iterations - 1) % 2  # the store's slot of V_K
    if dtype == torch.float64:
        assert relative_error(chain[0], steps) < 1e-12
        assert relative_error(chain[1][:, last],
                              newton_steps(a.reshape(4, 37, 37), iterations)) < 1e-12
    elif iterations == 9:
        ordinary = triton_lemma3.lemma3_forward(flat, norm, ridge, iterations, backward=False)
        exact = _ridge_inverse(x.double(), live).reshape(4, 37, 37)
        assert relative_error(chain[0], exact) < 2 * relative_error(ordinary[0], exact) + 1e-6


def test_the_newton_chain_has_one_pass_a_step():
    from skyformer.linalg import triton_lemma3

    for k in (2, 9):  # 2 + (K - 1) + 2 + 1 passes against 2 + 2 + 4 (K - 1) + 1
        assert len(triton_lemma3.forward_passes(k, chain=True)) == k + 4
        assert len(triton_lemma3.forward_passes(k)) == 4 * k + 1
    assert len(triton_lemma3.forward_passes(1, chain=True)) == 4
    assert triton_lemma3.chains(9, implicit=True) and triton_lemma3.chains(1, True)
    assert not triton_lemma3.chains(9, implicit=False)
