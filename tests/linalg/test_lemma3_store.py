"""What the forward Lemma 3 kernel stores for the backward kernel (``store_slots``).

A differentiated call stores the iterates V_1 ... V_K; where the backward kernel's
launch options ask for it (``KEEP_PRODUCTS``), P, T2, T3 of every Razavi step beside
them, which the backward kernel then reads instead of forming them again; a call no
backward pass can follow keeps the latest two iterates alone.
Checked here: the stored matrices are the steps' products (by PyTorch, from the stored
iterates), W and the gradients equal those of the kernels that form them again
(float64: to rounding) and the equations', in one program per matrix and in a launch
per pass; W without a backward pass is the same.
"""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import gaussian_kernel_block, half_sq_norm, landmark_inverse, lemma3_inverse
from tests.devices import devices, relative_error
from tests.linalg.test_lemma3_triton import (
    GAMMA,
    _assert_the_equations,
    _chain_case,
    _interpreter_for_cpu,  # noqa: F401 (the module's autouse fixture: CPU cases need it)
    _inverse_of_rows,
    _landmark_matrix,
    _rows,
    _value_and_grad,
)

pytest.importorskip("triton")


def _keeping(monkeypatch, per_pass=False, rows=None):
    """Both kernels launched as by default but with the products kept (and, ``per_pass``,
    a launch per pass of ``rows`` rows a program)."""
    from skyformer.linalg import triton_lemma3, triton_lemma3_backward

    default = triton_lemma3.launch_options

    def keeping(m, backward=False, graphed=False, family="default"):
        option = default(m, backward, graphed, family)
        if per_pass:
            tile = min(rows, option["BLOCK"])
            option = {**option, "ROWS": tile, "KC": tile, "PER_PASS": True}
        return {**option, "KEEP_PRODUCTS": True} if backward else option

    monkeypatch.setattr(triton_lemma3, "launch_options", keeping)
    monkeypatch.setattr(triton_lemma3_backward, "launch_options", keeping)


@pytest.mark.parametrize("m, iterations", [(1, 1), (5, 2), (37, 6), (16, 6)])
def test_the_store_holds_the_steps_products(m, iterations):
    """Slots of ``lemma3_forward(keep=True)``: V_1 ... V_K, then P, T2, T3 of each step
    from V_s (s = 1 ... K - 1), then T2 of the first step, as PyTorch forms them from
    the normalised matrix A and the stored iterates."""
    from skyformer.linalg import triton_lemma3

    mat, live = _landmark_matrix(1, 2, m, torch.float64, "cpu")
    ridge = torch.where(live, GAMMA, 1.0).double()  # [B, m]
    flat = mat.reshape(-1, m, m).contiguous()
    w_kept, store = triton_lemma3.lemma3_forward(flat, None, ridge, iterations, keep=True)
    w, iterates = triton_lemma3.lemma3_forward(flat, None, ridge, iterations, keep=False)
    assert store.shape == (2, triton_lemma3.store_slots(iterations, True), m, m)
    assert store.shape[1] == 4 * iterations - 2 and iterates.shape[1] == iterations
    assert torch.equal(w_kept, w) and torch.equal(store[:, :iterations], iterates)

    mat_r = flat + torch.diag_embed(ridge.expand(2, m))
    s = mat_r.sum(-1).rsqrt()
    a = s[:, :, None] * mat_r * s[:, None, :]
    eye = torch.eye(m, dtype=torch.float64)

    def t2(p):
        return 15 * eye - 7 * p + p @ p

    for step in range(1, iterations):
        p = a @ iterates[:, step - 1]
        base = iterations + 3 * (step - 1)
        for i, formed in enumerate((p, t2(p), 13 * eye - p @ t2(p))):
            assert relative_error(store[:, base + i], formed) < 1e-12
    assert relative_error(store[:, 4 * iterations - 3], t2(a)) < 1e-12


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case, from_rows, dtype, per_pass", [
    ((1, 1, 1, 16), True, torch.float64, False), ((2, 3, 5, 8), False, torch.float64, False),
    ((1, 2, 37, 40), True, torch.float64, True), ((2, 1, 37, 8), False, torch.float32, True),
    ((1, 1, 65, 16), True, torch.float32, False)])
def test_kept_products_give_the_gradient_of_products_formed_again(monkeypatch, device, case,
                                                                  from_rows, dtype, per_pass):
    """The same W and gradients as the backward kernel that forms the products again
    (the same products of the same tiles, read back: to rounding) and the equations'."""
    call, source, reference, weights, live = _chain_case(case, dtype, device, from_rows)
    w_formed, grad_formed = _value_and_grad(call, source, weights)
    _keeping(monkeypatch, per_pass, rows=16 if dtype == torch.float64 else 32)
    stores = _recorded_stores(monkeypatch)
    w, grad = _value_and_grad(call, source, weights)
    assert [s.shape[1] for s in stores] == [4 * 6 - 2]  # the products were kept
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(w, w_formed) < tolerance
    assert relative_error(grad, grad_formed) < tolerance
    _assert_the_equations(w, grad, source, weights, live, reference, from_rows, dtype)


def _recorded_stores(monkeypatch) -> list:
    """The stores the forward operator returns, from now on."""
    from skyformer.linalg import triton_ops

    stores = []
    forward = triton_ops.lemma3_forward

    def recording(*args):
        w, store = forward(*args)
        stores.append(store)
        return w, store

    monkeypatch.setattr(triton_ops, "lemma3_forward", recording)
    return stores


def test_the_latest_two_iterates_alone_where_no_backward_pass_follows(monkeypatch):
    """Under no_grad, and for inputs that need no gradient, the store holds two
    iterates, whatever the backward kernel's options ask (the others, and the products,
    would only take memory)."""
    _keeping(monkeypatch)
    stores = _recorded_stores(monkeypatch)
    x, live = _rows(1, 2, 9, 8, torch.float32, "cpu")
    with torch.no_grad():
        _inverse_of_rows(x.requires_grad_(True), live, "triton")
    _inverse_of_rows(x.detach(), live, "triton")
    _inverse_of_rows(x.detach().requires_grad_(True), live, "triton")
    _inverse_of_rows(x.detach(), live, "triton", iterations=1)
    assert [s.shape[1] for s in stores] == [2, 2, 22, 1]


@pytest.mark.parametrize("iterations", [1, 2, 3, 6])
@pytest.mark.parametrize("per_pass", [False, True])
def test_w_without_a_backward_pass_is_w_with_one(monkeypatch, iterations, per_pass):
    """Two iterates alternating in the store give the same W as all of them, in both
    launch modes."""
    x, live = _rows(2, 3, 21, 8, torch.float64, "cpu")
    if per_pass:
        from tests.linalg.test_lemma3_triton import _launch_per_pass

        _launch_per_pass(monkeypatch, 16)
    stores = _recorded_stores(monkeypatch)
    with torch.no_grad():
        w = _inverse_of_rows(x, live, "triton", iterations=iterations)
    w_differentiated = _inverse_of_rows(x.requires_grad_(True), live, "triton",
                                        iterations=iterations)
    assert [s.shape[1] for s in stores] == [min(iterations, 2), iterations]
    assert torch.equal(w, w_differentiated.detach())


def test_a_store_of_another_size_is_refused():
    from skyformer.linalg import triton_lemma3_backward

    mat, live = _landmark_matrix(1, 1, 4, torch.float64, "cpu")
    flat = mat.reshape(-1, 4, 4)
    ridge = torch.where(live, GAMMA, 1.0).double()
    with pytest.raises(ValueError, match="a store of 5 matrices for 6 iterations"):
        triton_lemma3_backward.lemma3_backward(flat, None, ridge, flat.new_zeros(1, 5, 4, 4),
                                               torch.ones_like(flat), 6)


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("per_pass", [False, True])
@pytest.mark.parametrize("from_rows", [False, True])
def test_few_iterations(monkeypatch, iterations, per_pass, from_rows):
    """One step (only the first step's T2 kept), two and three: the same W and
    gradients as the products formed again."""
    x, live = _rows(2, 2, 21, 8, torch.float64, "cpu")
    weights = torch.randn(2, 2, 21, 21, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(2))
    norm = torch.where(live[:, None, :], half_sq_norm(x), float("inf"))
    if from_rows:
        def call(t):
            n = torch.where(live[:, None, :], half_sq_norm(t), float("inf"))
            return landmark_inverse(t, n, gamma=GAMMA, iterations=iterations, live=live,
                                    kernel="triton")
        source = x
    else:
        def call(t):
            return lemma3_inverse(t, gamma=GAMMA, live=live, iterations=iterations,
                                  kernel="triton")
        source = gaussian_kernel_block(x, x, norm, norm)
    w_formed, grad_formed = _value_and_grad(call, source, weights)
    _keeping(monkeypatch, per_pass, rows=16)
    stores = _recorded_stores(monkeypatch)
    w, grad = _value_and_grad(call, source, weights)
    assert [s.shape[1] for s in stores] == [4 * iterations - 2]
    assert relative_error(w, w_formed) < 1e-12
    assert relative_error(grad, grad_formed) < 1e-12


def test_transforms_checkpointing_and_compile_with_kept_products(monkeypatch):
    """torch.func.grad (and vmap over it), activation checkpointing (reentrant and not)
    and torch.compile give the gradients of the products formed again."""
    from torch.utils.checkpoint import checkpoint

    mat, live = _landmark_matrix(2, 2, 9, torch.float64, "cpu")

    def inverse(t):
        return lemma3_inverse(t, gamma=GAMMA, live=live, kernel="triton")

    def loss(t):
        return inverse(t).square().sum()

    def per_matrix(t, lv):  # one batch element's loss
        return lemma3_inverse(t[None], gamma=GAMMA, live=lv[None],
                              kernel="triton").square().sum()

    want = torch.func.grad(loss)(mat)
    want_mapped = torch.func.vmap(torch.func.grad(per_matrix))(mat, live)
    _keeping(monkeypatch)
    stores = _recorded_stores(monkeypatch)
    assert relative_error(torch.func.grad(loss)(mat), want) < 1e-12
    assert relative_error(torch.func.vmap(torch.func.grad(per_matrix))(mat, live),
                          want_mapped) < 1e-12
    assert stores and all(s.shape[1] == 22 for s in stores)
    for reentrant in (True, False):
        leaf = mat.clone().requires_grad_(True)
        checkpoint(inverse, leaf, use_reentrant=reentrant).square().sum().backward()
        assert relative_error(leaf.grad, want) < 1e-12
    leaf = mat.clone().requires_grad_(True)
    torch.compile(inverse, fullgraph=True, backend="aot_eager")(leaf).square().sum().backward()
    assert relative_error(leaf.grad, want) < 1e-12
