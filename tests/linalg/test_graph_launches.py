"""``skyformer.cuda_graph_launches()``: inside, the Lemma 3 kernels take the launch
options made for CUDA graphs (a launch per pass, the step products kept), for the
warm-up and the capture alike, and give the default launches' results."""

from __future__ import annotations

import threading

import pytest
import torch

import skyformer
from skyformer.linalg import half_sq_norm, landmark_inverse
from skyformer.linalg.graph_launches import graph_launches_on
from skyformer.linalg.kernel_backend import interpreter_on
from tests.devices import captured_in_graph, cuda_only, relative_error

pytest.importorskip("triton")

GAMMA = 0.1


@pytest.fixture
def launches(monkeypatch):
    """The options of every Lemma 3 launch, forward and backward, in call order."""
    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")
    from skyformer.linalg import triton_lemma3, triton_lemma3_backward

    seen: list[tuple[str, dict]] = []
    real = triton_lemma3.launch

    def recording(program_kernel, pass_kernel, passes, bh, m, args, options):
        kind = "backward" if program_kernel.__name__.startswith("_backward") else "forward"
        seen.append((kind, dict(options)))
        return real(program_kernel, pass_kernel, passes, bh, m, args, options)

    monkeypatch.setattr(triton_lemma3, "launch", recording)
    monkeypatch.setattr(triton_lemma3_backward, "launch", recording)
    return seen


def _rows(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    x = 1.2 / 8**0.5 * torch.randn(2, 3, 24, 8, generator=gen, dtype=dtype)
    return x, torch.randn(2, 3, 24, 24, generator=gen, dtype=dtype)


def _inverse_and_grad(x, weights):
    leaf = x.detach().clone().requires_grad_(True)
    w = landmark_inverse(leaf, half_sq_norm(leaf), gamma=GAMMA, kernel="triton")
    (grad,) = torch.autograd.grad(w, leaf, weights)
    return w.detach(), grad


def test_inside_a_launch_per_pass_keeps_the_products_and_gives_the_same_results(launches):
    x, weights = _rows()
    w_default, grad_default = _inverse_and_grad(x, weights)
    assert [(kind, o["PER_PASS"]) for kind, o in launches] == [("forward", False),
                                                               ("backward", False)]
    assert not launches[0][1]["KEEP"]
    launches.clear()
    with skyformer.cuda_graph_launches():
        w, grad = _inverse_and_grad(x, weights)
    assert [(kind, o["PER_PASS"]) for kind, o in launches] == [("forward", True),
                                                               ("backward", True)]
    assert launches[0][1]["KEEP"] and launches[1][1]["KEEP"]
    assert relative_error(w, w_default) < 1e-12
    assert relative_error(grad, grad_default) < 1e-12
    launches.clear()
    _inverse_and_grad(x, weights)  # the defaults again once the context is closed
    assert [o["PER_PASS"] for _, o in launches] == [False, False]


def test_the_setting_nests_and_is_seen_by_other_threads():
    """Autograd runs a CUDA backward pass on a thread of its own: the setting is the
    process's, not the thread's."""
    seen = []
    with skyformer.cuda_graph_launches():
        with skyformer.cuda_graph_launches():
            pass
        thread = threading.Thread(target=lambda: seen.append(graph_launches_on()))
        thread.start()
        thread.join()
        assert graph_launches_on()
    assert seen == [True] and not graph_launches_on()


@pytest.mark.parametrize("padded", [False, True])
def test_a_whole_skyformer_call_inside_equals_the_default(launches, padded):
    """With key padding too: the padded sequence's dead landmark slots."""
    q, k, v = (torch.randn(2, 2, 40, 16, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(s)) for s in range(3))
    mask = None
    if padded:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[1, 31:] = False

    def call():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, "skyformer", num_features=16, kernel="triton",
                                  key_padding_mask=mask, generator=skyformer.random_key(5))
        out.sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    default = call()
    with skyformer.cuda_graph_launches():
        inside = call()
    assert {o["PER_PASS"] for _, o in launches} == {False, True}
    for a, b in zip(inside, default, strict=True):
        assert relative_error(a, b) < 1e-12


def test_torch_compile_follows_the_setting(launches):
    """The forward call's choice to keep the step products is traced: torch.compile
    guards on the setting, so a call outside the context does not keep them."""
    x, weights = _rows(torch.float32)
    compiled = torch.compile(lambda t: landmark_inverse(t, half_sq_norm(t), gamma=GAMMA,
                                                        kernel="triton"), fullgraph=True)

    def run():
        leaf = x.clone().requires_grad_(True)
        w = compiled(leaf)
        (grad,) = torch.autograd.grad(w, leaf, weights)
        return w.detach(), grad

    with skyformer.cuda_graph_launches():
        w_inside, grad_inside = run()
    assert [(o["PER_PASS"], o["KEEP"]) for _, o in launches] == [(True, True), (True, True)]
    launches.clear()
    w, grad = run()
    assert [(o["PER_PASS"], o["KEEP"]) for _, o in launches] == [(False, False),
                                                                 (False, False)]
    assert relative_error(w_inside, w) < 1e-5 and relative_error(grad_inside, grad) < 1e-5


@cuda_only
def test_a_skyformer_call_captured_inside_replays_what_an_eager_call_gives():
    """Warm-up and capture inside the context, as its docstring says: the pass kernels
    are compiled and loaded in the warm-up, so the capture can launch them."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", generator=gen,
                           dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    key = skyformer.random_key(0, device="cuda")

    def step():
        for t in (q, k, v):
            t.grad = None
        out = skyformer.attention(q, k, v, "skyformer", num_features=128, generator=key)
        out.float().sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    with skyformer.cuda_graph_launches():
        graph, captured = captured_in_graph(step)
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
    graph.replay()
    replayed = [t.clone() for t in captured]
    eager = step()
    for a, b in zip(replayed, eager, strict=True):
        assert relative_error(a.float(), b.float()) < 1e-2
