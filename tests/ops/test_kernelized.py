"""Exact kernelized attention: SDPA-augmentation fast path vs naive pairwise reference."""

from __future__ import annotations

import pytest
import torch

from skyformer import kernelized_attention, skyformer_attention
from skyformer.linalg import gaussian_scores
from skyformer.ops.kernelized.naive import reference_kernelized_attention
from tests.conftest import make_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("d", [8, 32, 48])
def test_fast_path_matches_naive_reference_float64(causal, masked, d):
    q, k, v = make_qkv(2, 2, 21, d, dv=6, scale=1.5)
    mask = None
    if masked:
        mask = torch.ones(2, 21, dtype=torch.bool)
        mask[0, 17:] = False
        mask[1, :3] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = kernelized_attention(q, k, v, key_padding_mask=mask, causal=causal)
    ref = reference_kernelized_attention(q, k, v, key_padding_mask=mask, causal=causal)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(fast.cos().sum(), (q, k, v)),
        torch.autograd.grad(ref.cos().sum(), (q, k, v)), strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_kernel_bandwidth_uses_the_input_head_dim():
    """C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))) with p the actual head dim, here 50."""
    q, k, v = make_qkv(1, 1, 5, 50, nk=7)
    c = torch.exp(-torch.cdist(q, k) ** 2 / (2 * 50**0.5))
    torch.testing.assert_close(kernelized_attention(q, k, v), c @ v)
    torch.testing.assert_close(gaussian_scores(q, k), c)


def test_cross_attention_and_float32_accuracy():
    q, k, v = make_qkv(2, 2, 9, 16, nk=33, dtype=torch.float32)
    ref = reference_kernelized_attention(q.double(), k.double(), v.double())
    out = kernelized_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_far_apart_inputs_underflow_to_zero_not_nan():
    q, k, v = make_qkv(1, 1, 8, 16, dtype=torch.float32)
    out = kernelized_attention(q * 100, k * 100 + 1000, v)
    assert torch.isfinite(out).all()
    assert out.abs().max() < 1e-30


def test_scale_option_sets_the_kernel_bandwidth():
    """exp(-s |q - k|^2 / 2): the default s is 1/sqrt(D) (Skyformer eq. (1)); a model that
    pre-scales its queries passes its own s (e.g. 1.0)."""
    q, k, v = make_qkv(2, 2, 12, 8)
    torch.testing.assert_close(kernelized_attention(q, k, v, scale=8**-0.5),
                               kernelized_attention(q, k, v), rtol=0, atol=0)
    for s in (1.0, 0.05):
        torch.testing.assert_close(kernelized_attention(q, k, v, scale=s),
                                   reference_kernelized_attention(q, k, v, scale=s))
        # every row a landmark, gamma 0, exact inverse: Skyformer is exact at any scale
        torch.testing.assert_close(
            skyformer_attention(q, k, v, scale=s, num_features=24, gamma=0.0, pinv="exact"),
            kernelized_attention(q, k, v, scale=s), rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        kernelized_attention(q, k, v, scale=0.0)
