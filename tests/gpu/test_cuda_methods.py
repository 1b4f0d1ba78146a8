"""Every method on CUDA, in float32 and bfloat16, masks included, against the same call
in float64 on the CPU with the same random key (``tests/devices.py``).

The CPU float64 path is itself checked against each method's naive reference
(``tests/ops``), so agreement here carries that check to the GPU. Skipped unless
``SKYFORMER_TEST_CUDA=1``.
"""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer import get_method, list_methods, random_key
from tests.conftest import gen, make_qkv
from tests.devices import (
    TOLERANCES,
    assert_matches_reference,
    backward_with_weights,
    cuda_only,
    device_leaves,
    relative_error,
)
from tests.reliability.test_host_reads import CAUSAL, READS_ON_PURPOSE

pytestmark = cuda_only
METHODS = list_methods()


def _call(method, q, k, v, mask, device, dtype, **options):
    bound = get_method(method).bind(seq_len=64, **options)
    leaves = device_leaves((q, k, v), device, dtype)
    out = bound(*leaves, key_padding_mask=None if mask is None else mask.to(device),
                generator=random_key(gen(3)))
    backward_with_weights(out)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_equals_cpu_float64(method, dtype, masked, matrix):
    matrix(f"cuda {str(dtype)[6:]}{' masked' if masked else ''}", method)
    if dtype == torch.bfloat16 and not get_method(method).capabilities.half_precision:
        pytest.skip(f"{method} does not run in half precision")
    q, k, v = make_qkv(2, 2, 40, 16, dtype=torch.float64, seed=11)
    mask = None
    if masked:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[0, 29:] = False
        mask[1, :6] = False
    ref, ref_grads = _call(method, q, k, v, mask, "cpu", torch.float64)
    out, grads = _call(method, q, k, v, mask, "cuda", dtype)
    assert out.device.type == "cuda" and out.dtype == dtype
    assert_matches_reference(out, grads, ref, ref_grads, dtype)


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer", "linear"])
def test_sdpa_entry_point_and_autocast_on_cuda(method):
    layer = skyformer.MultiHeadAttention(dim=64, num_heads=4, method=method).cuda()
    x = torch.randn(2, 96, 64, device="cuda")
    mask = torch.ones(2, 96, dtype=torch.bool, device="cuda")
    mask[1, 70:] = False
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x, key_padding_mask=mask)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    q, k, v = (torch.randn(2, 4, 96, 32, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out = skyformer.scaled_dot_product_attention(q, k, v, method=method)
    assert out.shape == (2, 4, 96, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "padded", "causal", "bool_mask"])
def test_exact_kernelized_takes_the_fused_sdpa_kernels(dtype, variant):
    """The augmentation's head dim is a multiple of 8, so SDPA's memory-efficient kernel
    (float32, and any call with a mask) and flash kernel (bfloat16) accept it; with only
    those backends allowed, a fall-back to the math backend (the [N, N] matrix) would
    raise. Outputs and gradients against float64 on the CPU. ``kernel="torch"``: on CUDA
    ``"auto"`` takes the flash kernels without an ``attn_mask``, not the augmentation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype == torch.float32 or variant == "bool_mask":  # flash takes neither
        backends = [SDPBackend.EFFICIENT_ATTENTION]
    else:
        backends = [SDPBackend.FLASH_ATTENTION]
    q, k, v = make_qkv(2, 4, 300, 64, dtype=torch.float64, seed=5)
    options = {"causal": variant == "causal", "kernel": "torch"}
    mask = None
    if variant == "padded":
        mask = torch.ones(2, 300, dtype=torch.bool)
        mask[1, 211:] = False
    if variant == "bool_mask":
        options["attn_mask"] = torch.rand(300, 300, generator=gen(2)) > 0.2
    weights = torch.randn(2, 4, 300, 64, generator=gen(7), dtype=torch.float64)
    leaves = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(backends):
        out = skyformer.kernelized_attention(
            *leaves, key_padding_mask=None if mask is None else mask.cuda(),
            **{key: (val.cuda() if isinstance(val, torch.Tensor) else val)
               for key, val in options.items()})
        (out.double() * weights.cuda()).sum().backward()
    exact_leaves = [t.requires_grad_(True) for t in (q, k, v)]
    exact = skyformer.kernelized_attention(*exact_leaves, key_padding_mask=mask, **options)
    (exact * weights).sum().backward()
    tol = TOLERANCES[dtype]
    assert relative_error(out, exact) < tol
    for name, got, want in zip("qkv", leaves, exact_leaves, strict=True):
        assert relative_error(got.grad, want.grad) < 5 * tol, f"gradient of {name}"


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("method, causal", [(m, False) for m in METHODS
                                            if m not in READS_ON_PURPOSE]
                         + [(m, True) for m in CAUSAL if m not in READS_ON_PURPOSE])
def test_a_call_never_waits_for_the_gpu(method, causal, masked):
    """Forward + backward issue their work without a host-device synchronisation (a
    value read or a blocking copy would make the host wait for the queue: PyTorch's
    sync debug mode raises there). The CPU check of the same property, for every
    method, is ``tests/reliability/test_host_reads.py``."""
    q, k, v = (t.to("cuda", torch.float32).requires_grad_(True)
               for t in make_qkv(2, 2, 64, 16, dtype=torch.float32, seed=8))
    mask = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    mask[1, 50:] = False
    bound = get_method(method).bind(seq_len=64, **({"causal": True} if causal else {}))
    options = {"generator": random_key(3, device="cuda"),
               "key_padding_mask": mask if masked else None}
    bound(q, k, v, **options).sum().backward()  # warm-up: compilation, autotuning
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bound(q, k, v, **options).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
