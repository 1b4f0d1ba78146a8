"""Leakage of every causal method: output i depends on no input after i.

For every registered method with ``Capabilities.causal`` (float64, several seeds, with
and without padding): the gradient of output i with respect to q, k and v at every
position after i is exactly zero, and outputs up to i are bit-identical when the
inputs after i are replaced by other values (chunk boundaries included).
"""

from __future__ import annotations

import pytest
import torch

from skyformer.registry import attention, get_method, list_methods
from tests.conftest import make_qkv

CAUSAL = [m for m in list_methods() if get_method(m).capabilities.causal]
# Positions probed: inside the first chunk, on both sides of a chunk boundary (64), late.
PROBES = (5, 63, 64, 100)


def _mask(n: int, padded: bool) -> torch.Tensor | None:
    if not padded:
        return None
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :7] = False  # left padding, as decoders batch prompts
    mask[1, 40:47] = False  # a hole
    return mask


def _run(method, q, k, v, mask, seed):
    g = torch.Generator().manual_seed(seed)
    return attention(q, k, v, method, key_padding_mask=mask, generator=g, causal=True)


def test_the_approximations_are_causal():
    assert {"linear", "performer", "skyformer", "nystrom_softmax"} <= set(CAUSAL)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method", CAUSAL)
def test_no_gradient_flows_from_the_future(method, padded):
    n = 130
    for seed in (0, 1, 2):
        q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, n, 8, seed=seed))
        mask = _mask(n, padded)
        out = _run(method, q, k, v, mask, seed)
        for i in PROBES:
            grads = torch.autograd.grad(out[:, :, i].sum(), (q, k, v), retain_graph=True)
            for g in grads:
                assert torch.equal(g[:, :, i + 1:], torch.zeros_like(g[:, :, i + 1:])), (
                    method, seed, i)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method", CAUSAL)
def test_changing_the_future_changes_no_past_output(method, padded):
    n = 130
    for seed in (0, 1, 2):
        q, k, v = make_qkv(2, 2, n, 8, seed=seed)
        mask = _mask(n, padded)
        out = _run(method, q, k, v, mask, seed)
        g = torch.Generator().manual_seed(100 + seed)
        for i in PROBES:
            future = [t.clone() for t in (q, k, v)]
            for t in future:
                t[:, :, i + 1:] = torch.randn(t[:, :, i + 1:].shape, generator=g,
                                              dtype=t.dtype) * 4
            again = _run(method, *future, mask, seed)
            assert torch.equal(again[:, :, : i + 1], out[:, :, : i + 1]), (method, seed, i)


@pytest.mark.parametrize("method", sorted(set(list_methods()) - set(CAUSAL)))
def test_the_others_refuse_with_a_sentence(method):
    q, k, v = make_qkv(1, 1, 8, 4)
    with pytest.raises(ValueError, match=f"{method} cannot"):
        attention(q, k, v, method, causal=True)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_the_landmark_rows_gradient_joins_that_of_q_and_k_without_zero_tensors(method):
    """The causal modified Nystrom core gathers its landmark rows through
    ``gather_rows_through``: the backward pass fills no zero tensor of q's size (each
    gather's backward made one, then added it to q's gradient) and copies none (the
    rows' gradient is added in place), and the gradients are those of plain gathers
    (the path that forward-mode AD takes)."""
    from unittest import mock

    from skyformer.linalg import rows
    from tests.dispatch import Recorder

    n = 80
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 3, n, 16, seed=4))
    mask = _mask(n, padded=True)

    def grads():
        out = _run(method, q, k, v, mask, seed=3)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    def zero_fill(func, args, out):
        name = func.overloadpacket.__name__
        if name in ("zeros", "new_zeros", "zeros_like", "zero_", "fill_", "index_add") \
                and out.numel() == q.numel():
            return name
        return None

    with Recorder(zero_fill) as recorded:
        through = grads()
    assert recorded.items == []
    with mock.patch.object(rows, "functional_ops_only", lambda: True):
        plain = grads()
    for got, want in zip(through, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
