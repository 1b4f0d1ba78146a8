"""The iterative pseudo-inverse (Razavi et al.) against torch.linalg.pinv."""

from __future__ import annotations

import itertools

import pytest
import torch

from skyformer.linalg import initial_inverse, inverse_residual, iterative_pinv, lemma3_inverse
from tests.conftest import gen


def spd(batch, m, cond, seed=0):
    """Symmetric positive definite matrices with condition number ``cond``."""
    g = gen(seed)
    q, _ = torch.linalg.qr(torch.randn(batch, m, m, generator=g, dtype=torch.float64))
    eig = torch.logspace(0, -torch.log10(torch.tensor(float(cond))).item(), m, dtype=torch.float64)
    return q @ torch.diag_embed(eig.expand(batch, m)) @ q.transpose(-1, -2)


@pytest.mark.parametrize("init", ["scaled_transpose", "identity"])
def test_matches_pinv_on_well_conditioned(init):
    a = spd(3, 16, cond=10.0)
    if init == "identity":
        a = a / (1.01 * torch.linalg.matrix_norm(a, ord=2))[:, None, None]  # ||I - A|| < 1
    v = iterative_pinv(a, 30, init=init)
    torch.testing.assert_close(v, torch.linalg.pinv(a), rtol=1e-8, atol=1e-8)
    assert inverse_residual(a, v).max() < 1e-8


def test_general_nonsymmetric_matrix():
    g = gen(1)
    a = torch.eye(12, dtype=torch.float64) * 3 + 0.3 * torch.randn(
        2, 12, 12, generator=g, dtype=torch.float64
    )
    v = iterative_pinv(a, 40)
    torch.testing.assert_close(v, torch.linalg.inv(a), rtol=1e-8, atol=1e-8)


def test_residual_shrinks_with_iterations():
    a = spd(2, 20, cond=100.0)
    residuals = [inverse_residual(a, iterative_pinv(a, t)).max().item() for t in (2, 4, 8, 16)]
    assert all(r2 < r1 for r1, r2 in itertools.pairwise(residuals))
    assert residuals[-1] < 1e-6


def test_badly_conditioned_stays_bounded():
    a = spd(2, 32, cond=1e14)
    v = iterative_pinv(a, 6)
    assert torch.isfinite(v).all()
    # the iteration is a matrix polynomial of a started at a^T / (|a|_1 |a|_inf): its
    # norm grows by at most 13/4 (= max of the step's factor) per step.
    bound = (13 / 4) ** 6 / torch.linalg.matrix_norm(a, ord=2).min()
    assert torch.linalg.matrix_norm(v, ord=2).max() <= bound
    singular = torch.zeros(2, 8, 8, dtype=torch.float64)
    assert torch.isfinite(iterative_pinv(singular, 6)).all()


def test_scaling_is_per_matrix():
    """One matrix's start (and so its result) does not depend on the others in the batch."""
    a = spd(2, 10, cond=10.0)
    alone = iterative_pinv(a[:1], 6)
    b = a.clone()
    b[1] = b[1] * 1000
    together = iterative_pinv(b, 6)
    torch.testing.assert_close(together[:1], alone, rtol=0, atol=0)
    v0 = initial_inverse(b, "scaled_transpose")
    torch.testing.assert_close(v0[:1], initial_inverse(a[:1], "scaled_transpose"))


def test_lemma3_normalised_matrix_is_contractive():
    """Skyformer Lemma 3: ||I - D^-1/2 (M + gamma I) D^-1/2|| < 1. The lemma states the
    singular values lie in (0, 1); in fact the largest is exactly 1 (eigenvector
    D^1/2 1, as for a normalised graph Laplacian), which leaves the conclusion intact."""
    g = gen(2)
    x = torch.randn(4, 24, 6, generator=g, dtype=torch.float64)
    m = torch.exp(-torch.cdist(x, x) ** 2 / 2)
    for gamma in (1e-3, 0.1, 1.0):
        mg = m + gamma * torch.eye(24, dtype=torch.float64)
        d = mg.sum(-1).rsqrt()
        a = d[..., :, None] * mg * d[..., None, :]
        s = torch.linalg.svdvals(a)
        assert (s > 0).all() and (s <= 1 + 1e-12).all()
        torch.testing.assert_close(s[..., 0], torch.ones(4, dtype=torch.float64))
        eye = torch.eye(24, dtype=torch.float64)
        assert (torch.linalg.matrix_norm(eye - a, ord=2) < 1).all()
        w = lemma3_inverse(m, gamma=gamma, pinv="iterative", iterations=40)
        torch.testing.assert_close(w, torch.linalg.inv(mg), rtol=1e-6, atol=1e-6)


def test_lemma3_identity_start_converges_faster():
    g = gen(3)
    x = torch.randn(2, 64, 8, generator=g, dtype=torch.float64)
    m = torch.exp(-torch.cdist(x, x) ** 2 / 4)
    exact = torch.linalg.inv(m + 0.1 * torch.eye(64, dtype=torch.float64))
    errors = {
        init: (lemma3_inverse(m, gamma=0.1, iterations=6, init=init) - exact).norm().item()
        for init in ("identity", "scaled_transpose")
    }
    assert errors["identity"] <= errors["scaled_transpose"]


def test_rejects_bad_arguments():
    a = torch.eye(3)
    with pytest.raises(ValueError, match="iterations"):
        iterative_pinv(a, -1)
    with pytest.raises(ValueError, match="init"):
        iterative_pinv(a, 2, init="nope")
    with pytest.raises(ValueError, match="pinv"):
        lemma3_inverse(a, gamma=0.1, pinv="nope")


def test_live_slots_are_per_batch_element_of_four_dim_matrices():
    """``live: [B, m]`` marks slots of ``[B, H, m, m]`` (shared by the heads); against a
    ``[B, m, m]`` stack it broadcast into a [B, B, m, m] result, silently."""
    m = torch.rand(2, 5, 5, dtype=torch.float64, generator=gen(0))
    m = m @ m.mT / 5
    live = torch.ones(2, 5, dtype=torch.bool)
    live[1, 3:] = False
    w = lemma3_inverse(m[:, None], gamma=0.1, live=live)
    assert w.shape == (2, 1, 5, 5)
    torch.testing.assert_close(w[0, 0], lemma3_inverse(m[0], gamma=0.1))
    with pytest.raises(ValueError, match=r"live must be \[B, m\] = \[2, 5\] for "
                                         r"\[B, H, m, m\] matrices"):
        lemma3_inverse(m, gamma=0.1, live=live)
    with pytest.raises(ValueError, match="live must be"):
        lemma3_inverse(m[:, None], gamma=0.1, live=live[:, :4])


def _autograd_iteration(a, iterations, init):
    """The iteration written out with autograd (what the hand-written backward replaces)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    v = initial_inverse(a, init)
    for _ in range(iterations):
        av = a @ v
        v = 0.25 * v @ (13 * eye - av @ (15 * eye - av @ (7 * eye - av)))
    return v


@pytest.mark.parametrize("init", ["identity", "scaled_transpose"])
@pytest.mark.parametrize("iterations", [1, 2, 6])
def test_hand_written_backward_matches_autograd(init, iterations):
    g = gen(4)
    a = (0.15 * torch.randn(2, 3, 9, 9, generator=g, dtype=torch.float64)
         + 0.6 * torch.eye(9, dtype=torch.float64)).requires_grad_(True)  # not symmetric
    out = iterative_pinv(a, iterations, init=init)
    ref = _autograd_iteration(a, iterations, init)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (grad,) = torch.autograd.grad((out * w).sum(), a)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), a)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-12)
    small = a.detach()[0, :1, :5, :5].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: iterative_pinv(x, iterations, init=init), (small,))


def test_zero_iterations_return_the_start():
    a = torch.rand(2, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(
        iterative_pinv(a, 0, init="identity"), torch.eye(4, dtype=torch.float64).expand(2, 4, 4)
    )
    torch.testing.assert_close(iterative_pinv(a, 0), initial_inverse(a, "scaled_transpose"))


@pytest.mark.parametrize("shape", [(5, 5), (2, 5, 5)])
@pytest.mark.parametrize("init", ["identity", "scaled_transpose"])
def test_jacrev_of_the_steps_equals_jacfwd(shape, init):
    """``torch.func.jacrev`` maps the hand-written backward pass over the Jacobian's rows,
    one matrix alone included; ``jacfwd`` differentiates the same steps in plain
    operators (forward mode)."""
    a = (0.5 * torch.eye(5, dtype=torch.float64) + 0.05
         + 0.01 * torch.randn(5, 5, dtype=torch.float64, generator=gen(0))).expand(*shape)

    def steps(t):
        return iterative_pinv(t, 4, init=init)

    reverse = torch.func.jacrev(steps)(a.contiguous())
    assert torch.allclose(reverse, torch.func.jacfwd(steps)(a.contiguous()), atol=1e-12)


@pytest.mark.parametrize("init", ["identity", "scaled_transpose"])
def test_a_tiny_gradient_is_not_flushed_away(init):
    """The backward pass flushes entries below sqrt(tiny) on CPU, as the forward: with the
    gradient brought to order 1 by a power of two first, scaling the loss by 2^-66 scales
    the gradient exactly (it was 0: the whole gradient below the flush)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 16, generator=g)
    sym = x + x.transpose(1, 2)
    sym = sym / torch.linalg.matrix_norm(sym, ord=2)[:, None, None]
    a = (torch.eye(16) + 0.3 * sym).requires_grad_()  # ||I - A|| = 0.3: both starts converge
    weights = torch.randn(3, 16, 16, generator=g)
    grads = [torch.autograd.grad((iterative_pinv(a, 6, init=init) * weights).sum() * s, a)[0]
             for s in (1.0, 2.0**-66)]
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1] * 2.0**66, grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("gamma", [0.0, 1e-300])
def test_the_exact_inverse_of_a_singular_core_has_finite_gradients(gamma):
    """A repeated landmark: LU fails on the core and its pseudo-inverse is taken. The
    failed LU's inf, unselected in torch.where, reached the gradient (0 times inf), also
    beside a regular core of the batch."""
    x = torch.randn(2, 5, 2, dtype=torch.float64, generator=gen(0))
    x[0, 4] = x[0, 0]  # batch element 0: a repeated row, singular
    x.requires_grad_(True)
    m = torch.exp(-(x[:, :, None] - x[:, None]).square().sum(-1) / 2)
    w = lemma3_inverse(m, gamma=gamma, pinv="exact")
    (grad,) = torch.autograd.grad(w.sum(), x)
    assert bool(torch.isfinite(w).all()) and bool(torch.isfinite(grad).all())
    torch.testing.assert_close(w[1], torch.linalg.inv(m[1] + gamma * torch.eye(5,
                               dtype=torch.float64)), rtol=1e-9, atol=1e-9)
