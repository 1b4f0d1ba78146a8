"""Skyformer's eager call as two autograd nodes (``ops/skyformer/two_nodes.py``) against
the same call composed of its Functions (``TWO_NODES`` off): outputs and gradients, padded
or not, the calls that take it and those that keep the composable path, and the backward passes it
hands to the composable path (batched gradients) or refuses (``create_graph``).
On the CPU through Triton's interpreter, on CUDA with ``SKYFORMER_TEST_CUDA=1``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import skyformer
from skyformer.linalg.eager_calls import through_pytorch
from skyformer.ops.skyformer import two_nodes
from tests.conftest import edge_padding, gen, holes_mask, make_qkv
from tests.devices import devices, relative_error

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    """CPU tensors run the kernels under Triton's interpreter; the CUDA cases
    (``SKYFORMER_TEST_CUDA=1``) on the GPU."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device", "cpu") == "cpu":
        request.getfixturevalue("triton_interpreter")

NODE = "_QueryProductBackward"


@contextlib.contextmanager
def _nodes(on: bool):
    """Inside: eligible calls take the two nodes (``on``) or the composed call."""
    before, two_nodes.TWO_NODES = two_nodes.TWO_NODES, on
    try:
        yield
    finally:
        two_nodes.TWO_NODES = before


def _auto_as_on_cuda(monkeypatch, fallback) -> None:
    """``kernel="auto"`` takes the Triton path on these CPU tensors (as on CUDA), with
    ``fallback`` (a ``KernelFallback``) as if no kernel had failed yet."""
    from skyformer.linalg import kernel_backend

    monkeypatch.setattr(fallback, "failures", set())
    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)


def _call(q, k, v, **options):
    options = {"num_features": 8, "kernel": "triton", **options}
    return skyformer.attention(q, k, v, "skyformer", generator=skyformer.random_key(3),
                               **options)


def _results(inputs, needs=(True, True, True), one=True, **options):
    """[out, the gradients of the inputs that ``needs`` marks] for random weights, and
    the output's autograd node's name."""
    leaves = [t.detach().clone().requires_grad_(need) for t, need in zip(inputs, needs,
                                                                         strict=True)]
    with _nodes(one):
        out = _call(*leaves, **options)
    weights = torch.randn(out.shape, generator=gen(5), dtype=torch.float64).to(out)
    wanted = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad((out * weights).sum(), wanted)
    return [out, *grads], _node(out)


def _node(out: torch.Tensor) -> str:
    """The name of the autograd node that made ``out``, beneath its views."""
    node = out.grad_fn
    while node is not None and type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return type(node).__name__


def _assert_same(got, want, tolerance):
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert relative_error(a, e) <= tolerance, relative_error(a, e)


CASES = [  # b, h, nq, nk, d, dv, num_features
    (2, 2, 24, 24, 16, 16, 8),
    (1, 3, 29, 40, 32, 8, 13),  # cross-attention, Dv != D, odd m
    (2, 1, 7, 5, 64, 24, 64),  # more features than rows: every row a landmark
    (1, 1, 33, 33, 16, 16, 1),  # one landmark
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gradient", ["unrolled", "implicit"])
def test_two_nodes_equals_the_composed_call_in_float64(case, gradient):
    b, h, nq, nk, d, dv, m = case
    inputs = make_qkv(b, h, nq, d, nk=nk, dv=dv, seed=nq + m, scale=0.6)
    options = {"num_features": m, "pinv_gradient": gradient}
    got, node = _results(inputs, **options)
    want, composed = _results(inputs, one=False, **options)
    assert node == NODE and composed != NODE
    _assert_same(got, want, 0.0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_nodes_equals_the_composed_call_in_float32_and_half_types(device, dtype):
    """The same kernels on the same tensors, the gradients summed in autograd's order:
    the same bits."""
    inputs = [t.to(device, dtype) for t in make_qkv(2, 2, 40, 32, seed=4, scale=0.6)]
    got, node = _results(inputs)
    want, _ = _results(inputs, one=False)
    assert node == NODE
    _assert_same(got, want, 0.0)


def _short_padding() -> torch.Tensor:
    """``[2, 30]``: element 0 has 3 real tokens (too few for m = 16: dead slots),
    element 1 is left-padded."""
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[0, :3] = True
    mask[1, 5:] = True
    return mask


PADDED = {  # name: (b, h, nq, nk, dv, options)
    "edge": (2, 2, 24, 24, 16, lambda: {"key_padding_mask": edge_padding(2, 24)}),
    "holes": (2, 1, 30, 30, 16, lambda: {"key_padding_mask": holes_mask(2, 30)}),
    "dead slots": (2, 2, 30, 30, 16, lambda: {"key_padding_mask": _short_padding(),
                                               "num_features": 16}),
    "cross": (2, 2, 20, 30, 8, lambda: {"key_padding_mask": _short_padding(),
                                        "num_features": 12}),
    "queries too": (2, 2, 20, 30, 16, lambda: {"key_padding_mask": _short_padding(),
                                               "query_padding_mask": edge_padding(2, 20)}),
}


@pytest.mark.parametrize(("form", "dtype", "gradient"), [
    *[(form, torch.float64, "unrolled") for form in PADDED],
    ("dead slots", torch.float64, "implicit"), ("cross", torch.float32, "implicit"),
    ("queries too", torch.float32, "unrolled"), ("holes", torch.bfloat16, "unrolled"),
    ("dead slots", torch.bfloat16, "implicit")])
def test_padded_calls_take_the_node_with_the_same_bits(form, dtype, gradient):
    """Key padding (the context product's rows), padded queries' zero rows, and slots
    that hold no landmark (+inf norms, a ridge of 1)."""
    b, h, nq, nk, dv, options = PADDED[form]
    inputs = [t.to(dtype) for t in make_qkv(b, h, nq, 16, nk=nk, dv=dv, seed=nq + nk)]
    got, node = _results(inputs, pinv_gradient=gradient, **options())
    want, _ = _results(inputs, one=False, pinv_gradient=gradient, **options())
    assert node == NODE
    _assert_same(got, want, 0.0)


def test_non_finite_keys_are_marked_as_in_the_composed_call():
    """A NaN in a padded key changes nothing; one in a real key spoils every real row
    (the products' marks, ``registry/guard.py``); padded queries' rows stay zero."""
    q, k, v = (t.float() for t in make_qkv(2, 1, 24, 16, seed=12))
    mask = edge_padding(2, 24)
    for row in (23, 0):  # element 0's last key is padding, its first is real
        bad = k.clone()
        bad[0, 0, row, 3] = float("nan")
        got, node = _results((q, bad, v), key_padding_mask=mask)
        want, _ = _results((q, bad, v), one=False, key_padding_mask=mask)
        spoilt = torch.isnan(got[0][0])  # element 0's rows: its real ones all, or none
        assert node == NODE and spoilt.any(-1).tolist() == [[row == 0 and bool(real)
                                                             for real in mask[0]]]
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True), (True, False, True)])
def test_only_the_gradients_asked_for(needs):
    inputs = make_qkv(1, 2, 20, 16, seed=2)
    got, node = _results(inputs, needs)
    want, _ = _results(inputs, needs, one=False)
    assert node == NODE and len(got) == 1 + sum(needs)
    _assert_same(got, want, 0.0)


def test_one_tensor_as_queries_and_keys():
    """attention(x, x, v): the rows' gradients of both sides reach x."""
    x, _, v = make_qkv(2, 1, 30, 16, seed=6)

    def grads(one):
        leaf = x.clone().requires_grad_(True)
        with _nodes(one):
            out = _call(leaf, leaf, v)
        return [out, *torch.autograd.grad(out.square().sum(), leaf)]

    _assert_same(grads(True), grads(False), 0.0)


def test_without_gradients_no_node_and_the_same_output():
    q, k, v = make_qkv(1, 2, 20, 16, seed=3)
    with torch.no_grad():
        out = _call(q.requires_grad_(True), k, v)
    assert out.grad_fn is None
    _assert_same([out], _results((q, k, v), one=False)[0][:1], 0.0)


@pytest.mark.parametrize("form", ["causal", "torch kernel", "through PyTorch", "vmap",
                                  "compiled"])
def test_other_calls_keep_the_composed_path(form):
    """The causal form, the PyTorch path, tracers and transforms: the composed
    Functions, which they need (``two_nodes.applies``)."""
    q, k, v = (t.float().requires_grad_(True) for t in make_qkv(2, 2, 20, 16, seed=1))
    options = {"causal": True} if form == "causal" else \
        {"kernel": "torch"} if form == "torch kernel" else {}
    entered = []
    original = two_nodes.attention

    def spy(*args, **kwargs):
        entered.append(True)
        return original(*args, **kwargs)

    two_nodes.attention = spy
    try:
        if form == "through PyTorch":
            with through_pytorch():
                _call(q, k, v)
        elif form == "vmap":
            torch.func.vmap(lambda a, b, c: _call(a[None], b[None], c[None])[0])(q, k, v)
        elif form == "compiled":
            torch.compile(lambda a, b, c: _call(a, b, c), backend="eager",
                          fullgraph=True)(q, k, v)
        else:
            _call(q, k, v, **options)
    finally:
        two_nodes.attention = original
    assert not entered


def test_a_differentiated_backward_pass_is_refused_with_the_composed_sentence():
    leaves = [t.requires_grad_(True) for t in make_qkv(1, 1, 16, 16, seed=8)]
    out = _call(*leaves)
    assert _node(out) == NODE
    with pytest.raises(RuntimeError, match="forward-over-reverse"):
        torch.autograd.grad(out.sum(), leaves, create_graph=True)


def test_batched_gradients_replay_the_composed_backward():
    """``autograd.grad(..., is_grads_batched=True)``: each row of the batch gives the
    gradients of one weighting, as one call each would."""
    leaves = [t.requires_grad_(True) for t in make_qkv(1, 2, 18, 16, seed=9)]
    out = _call(*leaves)
    weights = torch.randn(3, *out.shape, generator=gen(2), dtype=out.dtype)
    batched = torch.autograd.grad(out, leaves, weights, is_grads_batched=True,
                                  retain_graph=True)
    with _nodes(False):
        composed = _call(*leaves)
    for i in range(3):
        one = torch.autograd.grad(composed, leaves, weights[i], retain_graph=True)
        _assert_same([g[i] for g in batched], one, 1e-12)


def test_activation_checkpointing_gives_the_same_gradients():
    inputs = make_qkv(2, 1, 24, 16, seed=10)
    want, _ = _results(inputs)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = torch.utils.checkpoint.checkpoint(_call, *leaves, use_reentrant=False)
    weights = torch.randn(out.shape, generator=gen(5), dtype=torch.float64)
    _assert_same([out, *torch.autograd.grad((out * weights).sum(), leaves)], want, 0.0)


def test_the_output_may_be_changed_in_place():
    """A residual added in place (``out += x``), as the composed call allows."""
    inputs = make_qkv(1, 2, 20, 16, seed=13)

    def grads(nodes):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        with _nodes(nodes):
            out = _call(*leaves)
        out += leaves[0]
        out.mul_(2.0)
        return [out, *torch.autograd.grad(out.square().sum(), leaves)]

    _assert_same(grads(True), grads(False), 0.0)


def test_a_backward_pass_under_autocast_runs_as_the_forward_did():
    """The forward in float32, its backward inside ``torch.autocast``: the kernels get
    the dtypes of the forward (the matrix products between them are not cast)."""
    leaves = [t.float().requires_grad_(True) for t in make_qkv(1, 2, 20, 16, seed=14)]
    out = _call(*leaves)
    want = torch.autograd.grad(out.sum(), leaves, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(out.sum(), leaves)
    _assert_same(got, want, 0.0)


def test_vmap_over_autograd_grad_replays_the_composed_backward():
    inputs = make_qkv(1, 2, 18, 16, seed=15)
    weights = torch.randn(3, 1, 2, 18, 16, generator=gen(3), dtype=torch.float64)

    def batched(nodes):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        with _nodes(nodes):
            out = _call(*leaves)
        return torch.func.vmap(lambda w: torch.autograd.grad(out, leaves, w,
                                                             retain_graph=True))(weights)

    _assert_same(batched(True), batched(False), 1e-12)


def test_one_tensor_as_queries_keys_and_values():
    """attention(x, x, x): equal to rounding (autograd sums the three gradients of x in
    another order than the nodes' dq + dk, then dv)."""
    x = make_qkv(2, 1, 30, 16, seed=16)[0]

    def grads(nodes):
        leaf = x.clone().requires_grad_(True)
        with _nodes(nodes):
            out = _call(leaf, leaf, leaf)
        return [out, *torch.autograd.grad(out.square().sum(), leaf)]

    _assert_same(grads(True), grads(False), 1e-13)


@pytest.mark.parametrize("fails", ["core kernel", "import"])
def test_auto_falls_back_where_triton_fails(monkeypatch, fails):
    """"auto" where Triton fails, with each fallback's warning: the Lemma 3 kernel
    unable to compile or launch (the nodes take W by PyTorch and its gradient), or
    what fails before the kernels, importing Triton (the composed call takes over)."""
    from skyformer.linalg import kernel_matmul_triton, lemma3_triton, triton_lemma3

    core = fails == "core kernel"

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources") if core else ImportError("no Triton here")

    fallback = lemma3_triton.CORE_FALLBACK if core else kernel_matmul_triton.PRODUCT_FALLBACK
    _auto_as_on_cuda(monkeypatch, fallback)
    if core:
        monkeypatch.setattr(triton_lemma3, "lemma3_forward", broken)
    else:
        monkeypatch.setattr(two_nodes, "stores_for", broken)
    inputs = [t.float() for t in make_qkv(1, 2, 20, 16, seed=11)]
    want, _ = _results(inputs, kernel="torch")
    with pytest.warns(RuntimeWarning, match="Lemma 3 kernel failed" if core
                      else "product kernels failed"):
        got, node = _results(inputs, kernel="auto")
    assert (node == NODE) == core and fallback.failed
    _assert_same(got, want, 1e-5)
