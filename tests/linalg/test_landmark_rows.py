"""The landmark rows' gradient added into dq and dk (``linalg/landmark_rows.py``): the
Triton kernel against the same arithmetic by PyTorch operations, bit for bit, in every
dtype, padded or not, one side or both; its fallback under ``"auto"``. On the CPU
through Triton's interpreter, on CUDA with ``SKYFORMER_TEST_CUDA=1``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from skyformer.linalg import landmark_rows
from skyformer.linalg.landmark_rows import add_rows_gradient, add_rows_gradient_by_pytorch
from tests.conftest import gen
from tests.devices import devices

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    """CPU tensors run the kernel under Triton's interpreter; the CUDA cases on the GPU."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device", "cpu") == "cpu":
        request.getfixturevalue("triton_interpreter")


def _inputs(b, h, nq, nk, m, mq, d, dtype, device, live=False, seed=0):
    """(dq, dk, flat_q, flat_k, x, dx, dnorm, live) as Skyformer's key side holds them:
    distinct rows on each side, the rows' gradients in float32 (float64 rows: float64)."""
    g = gen(seed)
    compute = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape, dt=compute):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dt)

    def rows(n, count):  # distinct rows of each (b, h), flat in [B * H * n]
        picks = torch.stack([torch.randperm(n, generator=g)[:count] for _ in range(b)])
        offsets = torch.arange(b * h).view(b, h, 1) * n
        return (picks[:, None, :] + offsets).to(device)

    dq, dk = randn(b, h, nq, d, dt=dtype), randn(b * h, nk, d, dt=dtype)
    dx = tuple(randn(b * h, m, d) for _ in range(3))
    dnorm = tuple(randn(b * h, m) for _ in range(3))
    slots = torch.rand(b, m, generator=g) > 0.3 if live else None
    return (dq, dk, rows(nq, mq), rows(nk, m - mq), randn(b * h, m, d), dx, dnorm,
            None if slots is None else slots.to(device))


CASES = [  # b, h, nq, nk, m, mq, d
    (2, 3, 40, 40, 16, 8, 32),
    (1, 2, 9, 30, 13, 7, 20),  # odd m and D, cross-attention
    (3, 1, 5, 6, 11, 5, 64),  # every row a landmark
    (2, 2, 17, 17, 1, 1, 16),  # one landmark: no key side
    (1, 1, 200, 200, 128, 64, 128),  # the kernel's largest m and D
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("live", [False, True])
def test_the_kernel_adds_the_same_bits_as_pytorch(device, dtype, case, live):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 CUDA tensors take the PyTorch path")
    dq, dk, flat_q, flat_k, x, dx, dnorm, slots = _inputs(*case, dtype, device, live=live)
    want = add_rows_gradient_by_pytorch(dq.clone(), dk.clone(), flat_q, flat_k, x, dx,
                                        tuple(t.clone() for t in dnorm), slots, 0.7)
    got_q, got_k = dq.clone(), dk.clone()
    add_rows_gradient(got_q, got_k, flat_q, flat_k, x, dx, dnorm, slots, 0.7, auto=False)
    assert torch.equal(got_q, want[0]) and torch.equal(got_k, want[1])
    assert not torch.equal(got_q, dq)  # rows were added to
    if case[4] > case[5]:
        assert not torch.equal(got_k, dk)


@pytest.mark.parametrize("side", ["q", "k"])
def test_one_side_leaves_the_other_untouched(side):
    dq, dk, flat_q, flat_k, x, dx, dnorm, _ = _inputs(2, 2, 24, 24, 12, 6, 16,
                                                      torch.float32, "cpu")
    got_q, got_k = dq.clone(), dk.clone()
    out = add_rows_gradient(got_q if side == "q" else None, got_k if side == "k" else None,
                            flat_q, flat_k, x, dx, dnorm, None, 0.5, auto=False)
    want = add_rows_gradient_by_pytorch(dq.clone() if side == "q" else None,
                                        dk.clone() if side == "k" else None, flat_q, flat_k,
                                        x, dx, tuple(t.clone() for t in dnorm), None, 0.5)
    kept, changed = (1, 0) if side == "q" else (0, 1)
    assert out[kept] is None and torch.equal(out[changed], want[changed])
    assert torch.equal((got_q, got_k)[kept], (dq, dk)[kept])  # the other side as it was
    assert add_rows_gradient(None, None, flat_q, flat_k, x, dx, dnorm, None, 0.5,
                             auto=False) == (None, None)


def test_a_strided_gradient_takes_pytorch_out_of_place():
    """The kernel writes rows of contiguous gradients; a strided one gets a new tensor."""
    dq, dk, flat_q, flat_k, x, dx, dnorm, _ = _inputs(1, 2, 24, 24, 12, 6, 16,
                                                      torch.float32, "cpu")
    strided = dq.transpose(-1, -2).contiguous().transpose(-1, -2)
    got = add_rows_gradient(strided, dk.clone(), flat_q, flat_k, x, dx, dnorm, None, 0.5,
                            auto=False)
    want = add_rows_gradient_by_pytorch(dq.clone(), dk.clone(), flat_q, flat_k, x, dx,
                                        tuple(t.clone() for t in dnorm), None, 0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(strided, dq)


def test_a_kernel_that_fails_gives_way_to_pytorch_under_auto(monkeypatch):
    """Under "auto" a failure to compile or launch warns once and adds by PyTorch
    operations, the same numbers, from then on; "triton" insists."""
    from skyformer.linalg import triton_landmark_rows

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(landmark_rows.ROWS_GRADIENT_FALLBACK, "failures", set())
    monkeypatch.setattr(triton_landmark_rows, "add_landmark_rows_gradient", fail)
    dq, dk, flat_q, flat_k, x, dx, dnorm, _ = _inputs(2, 2, 24, 24, 12, 6, 16,
                                                      torch.float32, "cpu")
    want = add_rows_gradient_by_pytorch(dq.clone(), dk.clone(), flat_q, flat_k, x, dx,
                                        tuple(t.clone() for t in dnorm), None, 0.5)
    with pytest.raises(RuntimeError, match="no compiler here"):
        add_rows_gradient(dq.clone(), dk.clone(), flat_q, flat_k, x, dx, dnorm, None, 0.5,
                          auto=False)
    with pytest.warns(RuntimeWarning, match="landmark rows' gradient kernel failed for "
                                            "float32 tensors on cpu"):
        got = add_rows_gradient(dq.clone(), dk.clone(), flat_q, flat_k, x, dx,
                                tuple(t.clone() for t in dnorm), None, 0.5, auto=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        again = add_rows_gradient(dq.clone(), dk.clone(), flat_q, flat_k, x, dx,
                                  tuple(t.clone() for t in dnorm), None, 0.5, auto=True)
    assert torch.equal(again[0], want[0])
