"""The Gaussian kernel depends on q_i - k_j alone: queries and keys moved by one large
vector give, in float32, what float64 gives for the same inputs, where the method takes
the keys' mean out (``ops/shared/centring.py``): exact kernelized attention's SDPA
augmentation, in a copy it makes anyway, and its flash kernels (under Triton's
interpreter here; unmoved they gave outputs of 1e19). Without it a common offset of 1e4 gave
outputs of 1e21. The methods that read q and k as they are keep the float32 limits
docs/reliability.md's table states (checked last)."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.ops.shared.centring import keys_mean
from tests.conftest import make_qkv

METHODS = {"kernelized": {"kernel": "torch"}, "kernelized[kernel=triton]": {}}


def _call(method, q, k, v, mask):
    return skyformer.attention(q, k, v, method, key_padding_mask=mask,
                               generator=torch.Generator().manual_seed(3), **METHODS[method])


@pytest.mark.parametrize("method", METHODS)
def test_a_large_common_offset_costs_float32_no_accuracy(method, request):
    if "triton" in method:  # the flash kernels, through Triton's interpreter
        pytest.importorskip("triton")
        request.getfixturevalue("triton_interpreter")
    q, k, v = make_qkv(2, 2, 40, 16, dtype=torch.float32, seed=1)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    offset = torch.full((16,), 1e4)
    offset[::2] = -3e3
    q, k = (t + offset for t in (q, k))  # norms ~3e4, distances ~8
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _call(method, *leaves, mask)
    exact = [t.double().requires_grad_() for t in (q, k, v)]  # the same rounded inputs
    want = _call(method, *exact, mask)
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-3)
    out.sum().backward()
    want.sum().backward()
    for a, b in zip(leaves, exact, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=2e-2, atol=2e-2)


def test_the_shift_is_the_real_keys_mean_detached_and_finite():
    k = make_qkv(2, 1, 6, 3, nk=5)[1].requires_grad_()
    valid = torch.tensor([[True] * 5, [True, True, False, True, False]])
    mu = keys_mean(k, valid)
    want = torch.stack([k[0, 0].mean(0), k[1, 0, [0, 1, 3]].mean(0)])[:, None, None, :]
    torch.testing.assert_close(mu, want.detach())
    assert not mu.requires_grad
    bad = k.detach().clone()
    bad[0, 0, 1, 2] = float("inf")  # a component with a non-finite mean: 0, not moved
    mu = keys_mean(bad, None)
    assert mu[0, 0, 0, 2] == 0 and mu.isfinite().all()
    assert mu[0, 0, 0, 0] == bad[0, 0, :, 0].mean()
    assert keys_mean(k.bfloat16(), valid) is None  # half inputs: their own rounding rules


# docs/reliability.md, "Large norms in float32": the table's rows, by its snippet's call.
# The numbers there are one machine's float32 rounding; what is checked is the regime
# each row states (the rounding's size may move with the BLAS, not the regime).
DOCUMENTED = {  # method: (relative error at offset 1e3, at 1e4), as (low, high) bounds;
    # None: NaN; "huge": outputs of 1e15 or more
    "kernelized": ((0, 1e-4), (0, 1e-3)),
    "skyformer": ((0.1, 1.0), None),
    "skyformer_adaptive": ((0.1, 1.0), None),
    "skyformer_multipole": ((0.05, 1.0), "huge"),
}


@pytest.mark.parametrize("method", DOCUMENTED)
def test_the_documented_float32_offset_table(method):
    """What the table says each method gives; a change that helps (or hurts) one of
    the methods reading q and k as they are fails here until the table says so."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    ref = skyformer.attention(q, k, v, method, generator=torch.Generator().manual_seed(0))
    for offset, want in zip((1e3, 1e4), DOCUMENTED[method], strict=True):
        out = skyformer.attention(q + offset, k + offset, v, method,
                                  generator=torch.Generator().manual_seed(0))
        error = ((out - ref).norm() / ref.norm()).item()
        if want is None:
            assert error != error, f"{method} at {offset:g}: {error} where the table says NaN"
        elif want == "huge":
            assert out.abs().max().item() >= 1e15, f"{method} at {offset:g}"
        else:
            assert want[0] <= error <= want[1], f"{method} at {offset:g}: {error}"
