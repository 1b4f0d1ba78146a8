"""Exact kernelized attention: SDPA-augmentation fast path vs naive pairwise reference."""

from __future__ import annotations

import math

import pytest
import torch

import skyformer
from skyformer import kernelized_attention, skyformer_attention
from skyformer.eval.measure.memory import CallJob, peak_memory_bytes
from skyformer.linalg import gaussian_scores
from skyformer.ops.kernelized.naive import reference_kernelized_attention
from skyformer.ops.kernelized.sdpa_augmentation import augmented_width, kernelized_by_sdpa
from tests.conftest import make_qkv
from tests.devices import needs_interpreter, relative_error
from tests.dispatch import Recorder, check_lean_and_equal


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
    # causal (as many keys as queries): the lower triangle, each query's own key included
    torch.testing.assert_close(gaussian_scores(q, k[..., :5, :], causal=True), c[..., :5].tril())


def test_the_exact_matrix_keeps_the_tiny_entries_of_far_queries():
    """gaussian_scores, the exact matrix of the analyses (approx's floors), flushed
    entries below sqrt(tiny) on the CPU: for queries far from every key (1e-180) it
    was all zeros while the exact output was not, and the floors came out 1.0."""
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    k = torch.full((1, 1, 2, 4), 20.0, dtype=torch.float64)
    c = gaussian_scores(q, k)  # exp(-1600 / (2 * 2)) = exp(-400) ~ 1.9e-174
    torch.testing.assert_close(c, torch.full_like(c, math.exp(-400.0)), rtol=1e-12, atol=0)
    # what would be subnormal (slow on CPUs) is zero: exp(-720) ~ 2.6e-313 < tiny (said
    # by logarithms: a process that flushes subnormals, as the suite's may, has
    # math.exp(-720) == 0)
    far = gaussian_scores(q, torch.full((1, 1, 1, 4), 720**0.5, dtype=torch.float64))
    assert far.item() == 0.0 and -745 < -720 < math.log(torch.finfo(torch.float64).tiny)


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
    """exp(-s |q - k|^2 / 2): the default s is 1/sqrt(D) (Skyformer eq. (3)); a model that
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


def test_augmented_width_is_a_multiple_of_eight():
    """CUDA's memory-efficient SDPA kernel needs a head dim divisible by 4 (float32) or
    8 (half types); otherwise SDPA takes its math backend, which forms [N, N]."""
    for d, dv in [(64, 64), (32, 32), (1, 1), (50, 7), (8, 100), (128, 128)]:
        width = augmented_width(d, dv)
        assert width % 8 == 0 and width >= d + 4 and width >= dv + 1
        assert width - max(d + 4, dv + 1) < 8


def test_hi_lo_split_carries_twice_the_mantissa_and_the_gradient_once():
    from skyformer.ops.kernelized.sdpa_augmentation import split_hi_lo

    x = (torch.rand(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
         * 200.0).requires_grad_(True)
    hi, lo = split_hi_lo(x, torch.bfloat16)
    assert hi.dtype == lo.dtype == torch.bfloat16
    rounded = hi.float() - x
    assert (rounded.abs() / x).max() > 2**-10  # one bfloat16 alone is that coarse
    assert ((hi.float() + lo.float() - x).abs() / x).max() < 2**-16
    (hi.float() * 3.0 + lo.float() * 3.0).sum().backward()  # both meet the same factor
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("variant", ["plain", "padded", "causal", "attn_mask"])
def test_bfloat16_keeps_float32_accuracy_in_the_exponent(variant):
    """bfloat16 inputs go to SDPA as bfloat16 without gradients (with them, in float32:
    the next test). Against float64 on the same (rounded) values the error is
    bfloat16's rounding of weights and outputs (0.003 here), not of the exponent: with
    the norms |q|^2/2 ~ 50 as single bfloat16 numbers (no lo part) it is ten times
    larger (0.03 for outputs and gradients)."""
    q, k, v = make_qkv(2, 2, 40, 32, dtype=torch.float32, scale=1.8, seed=3)
    k = q + 0.6 * k  # keys near the queries: many non-negligible weights
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    options, mask = {}, None
    if variant == "padded":
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[0, 29:] = False
    if variant == "causal":
        options["causal"] = True
    if variant == "attn_mask":
        options["attn_mask"] = torch.rand(40, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    with torch.no_grad():
        inference = kernelized_attention(q, k, v, key_padding_mask=mask, **options)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, key_padding_mask=mask, **options)
    assert out.dtype == inference.dtype == torch.bfloat16
    exact_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    exact = kernelized_attention(*exact_leaves, key_padding_mask=mask, **options)
    assert relative_error(inference, exact) < 1e-2
    assert relative_error(out, exact) < 1e-2
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out.float() * weights).sum(), leaves)
    exact_grads = torch.autograd.grad((exact * weights.double()).sum(), exact_leaves)
    for got, want in zip(grads, exact_grads, strict=True):
        assert got.dtype == torch.bfloat16
        assert relative_error(got, want) < 1.5e-2


@pytest.mark.parametrize("route", [{}, {"fold_key_norms": False},
                                   {"attn_mask": torch.ones(1, 48, dtype=torch.bool)}])
def test_bfloat16_gradients_where_queries_and_keys_repeat(route):
    """A query's gradient s sum_j dS_ij (k_j - q_i) cancels where keys repeat it; on the
    SDPA routes (the CPU's key bias, the augmentation, a padding attn_mask) a bfloat16
    call with gradients is computed in float32, so that SDPA's dq and the row offset's
    meet unrounded: dq and dk within 4e-3 of float64 (bfloat16's rounding, 1.7e-3;
    each rounded first they were 0.9 to 1.0 off)."""
    q, k, v, weights = _repeated_tokens()
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.to(torch.bfloat16).to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = kernelized_attention(*leaves, kernel="torch", **route)
        grads = torch.autograd.grad((out.double() * weights).sum(), leaves)
        results.append([out, *grads])
    exact, got = results
    assert all(t.dtype == torch.bfloat16 for t in got)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, exact, strict=True):
        assert relative_error(a, e) < 4e-3, name


def _repeated_tokens() -> tuple[torch.Tensor, ...]:
    """q, k around three centres (keys repeating queries), v and output weights: float64."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(1, 2, 3, 32, generator=g, dtype=torch.float64)
    q = centres[:, :, torch.randint(0, 3, (48,), generator=g)]
    k = centres[:, :, torch.randint(0, 3, (48,), generator=g)]
    v, weights = (torch.randn(1, 2, 48, 32, generator=g, dtype=torch.float64)
                  for _ in range(2))
    return q, k, v, weights


@needs_interpreter  # the flash kernels on CPU tensors
def test_the_flash_backwards_fallback_computes_bfloat16_in_float32(monkeypatch):
    """kernel="auto" where the backward kernels cannot run (a GPU too small for their
    tiles) differentiates the SDPA augmentation: in bfloat16 its dq and dk were 0.45
    and 0.36 off float64 on repeated tokens, where every other SDPA route with gradients
    computes in float32 (the test above)."""
    from skyformer.linalg.kernel_backend import KernelTooLarge
    from skyformer.ops.kernelized import flash, triton_flash

    def too_large(*args, **kwargs):
        raise KernelTooLarge("the flash key gradient kernel needs 192 KiB", first=True)

    monkeypatch.setattr(flash.FLASH_FALLBACK, "failures", set())
    monkeypatch.setattr(triton_flash, "flash_backward", too_large)
    q, k, v, weights = _repeated_tokens()
    exact = [t.to(torch.bfloat16).double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad((kernelized_attention(*exact, kernel="torch") * weights).sum(),
                               exact)
    leaves = [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    out = flash.flash_kernelized(*leaves, None, 32 ** -0.5, False, auto=True)
    with pytest.warns(RuntimeWarning, match="takes the SDPA augmentation"):
        got = torch.autograd.grad((out.double() * weights).sum(), leaves)
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16 and relative_error(a, e) < 4e-3, name


def test_bfloat16_makes_no_float32_copy_with_n_rows_and_d_columns():
    """The augmentation: only the norms ([.., N]) and the final division are float32:
    q', k', v' are bfloat16 (half the memory of the float32 augmentation), float16 goes
    through float32. The CPU's default, the key bias at head dim D (``sdpa_fold.py``):
    a float32 bias row per head ([.., 1, Nk]) and the output before its cast. Without
    gradients: a call with them computes in float32 (the test above)."""
    def float32_width(func, args, out):
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.dim() == 4 \
                and out.shape[-2] > 1:
            return out.shape[-1]
        return None

    q, k, v = (t.to(torch.bfloat16) for t in make_qkv(1, 2, 50, 16, dtype=torch.float32))
    with Recorder(float32_width) as seen:
        kernelized_by_sdpa(q, k, v, 0.25)
    assert max(seen.items) <= 16  # the output before its cast, [.., N, Dv]
    with Recorder(float32_width) as seen:
        kernelized_by_sdpa(q.half(), k.half(), v.half(), 0.25)
    assert max(seen.items) == 24  # float16: the augmentation in float32 (16 + 4 -> 24)
    with Recorder(float32_width) as seen, torch.no_grad():
        skyformer.attention(q, k, v, "kernelized")
    assert max(seen.items) <= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_holds_at_any_scale(dtype):
    """The padding logit MASKED_LOGIT / s is clamped to the float range for tiny s (it
    overflowed float32 below s ~ 3e-33), and padded value rows are zero."""
    q, k, v = make_qkv(2, 2, 12, 8, dtype=torch.float32, seed=4)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 5:] = False
    for s in (1e-40, 1e-33, 1e-3, 30.0):
        out = kernelized_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                   key_padding_mask=mask, scale=s)
        ref = reference_kernelized_attention(*(t.to(dtype).double() for t in (q, k, v)),
                                             key_padding_mask=mask, scale=s)
        assert torch.isfinite(out).all()
        assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_a_float_mask_with_bfloat16_inputs_is_not_rounded_to_bfloat16():
    """An additive float mask (ALiBi / T5-style biases reach ~20) would lose ~2^-9 of
    its size in bfloat16: bfloat16 inputs with a float mask are computed in float32."""
    q, k, v = (t.to(torch.bfloat16) for t in make_qkv(1, 2, 30, 16, dtype=torch.float32,
                                                         seed=6))
    bias = 20 * torch.rand(30, 30, generator=torch.Generator().manual_seed(0))
    out = kernelized_attention(q, k, v, attn_mask=bias)
    exact = kernelized_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    assert out.dtype == torch.bfloat16
    assert relative_error(out, exact) < 5e-3  # the output's rounding (bfloat16 mask: 0.04)


@pytest.mark.parametrize(("padded", "causal", "buffers"), [(False, False, 5.5),
                                                          (True, True, 8.0)])
def test_peak_memory_holds_only_the_augmented_inputs_and_the_output(padded, causal, buffers):
    """While SDPA runs only q', k', v' (with the extra key) and its output are alive:
    each intermediate copy of the augmentation is freed first. Peak above the inputs,
    in [B, H, N, W] float32 buffers (W = 72 at D = 64), measured in a fresh process:
    4.9 and 7.5 (it was 6.0 and 9.7 while the copies stayed alive)."""
    shape = [1, 2, 8192, 64]
    buffer = 2 * 8192 * augmented_width(64, 64) * 4
    job = CallJob("tests.eval.memory_helpers:kernelized_call",
                  {"shape": shape, "padded": padded, "causal": causal, "fold": False})
    assert peak_memory_bytes(job) <= buffers * buffer


@pytest.mark.parametrize(("padded", "causal", "buffers"), [(False, False, 4.5),
                                                          (True, True, 7.5)])
def test_peak_memory_at_head_dim_d(padded, causal, buffers):
    """The CPU's default, SDPA at head dim D with the key bias (``sdpa_fold.py``): peak
    above the inputs in [B, H, N, D] float32 buffers, measured in a fresh process: 4.05
    (q and k less the keys' mean, O and the output) and 7.0 (padded rows zeroed in
    copies of k and v, no mean taken out)."""
    shape = [1, 2, 8192, 64]
    job = CallJob("tests.eval.memory_helpers:kernelized_call",
                  {"shape": shape, "padded": padded, "causal": causal, "fold": True})
    assert peak_memory_bytes(job) <= buffers * 2 * 8192 * 64 * 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_augmented_output_is_split_not_sliced(dtype):
    """C V and C 1 come from one SDPA output [.., N, width]: split, its gradient is one
    write, where the two slices' backward wrote a zero tensor of that size each and
    autograd added them."""
    q, k, v = (t.to(dtype).requires_grad_(True) for t in make_qkv(2, 2, 30, 8, dv=6))
    for out in (kernelized_by_sdpa(q, k, v, 0.3),  # the augmentation
                kernelized_attention(q, k, v)):  # the CPU's key bias, its width padded
        with Recorder(lambda func, args, o: func.overloadpacket.__name__) as ops:
            torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert "slice_backward" not in ops.items


@pytest.mark.parametrize("dtype, attn_mask, kernel, flash", [
    (torch.bfloat16, False, "auto", True), (torch.float16, False, "auto", True),
    (torch.float32, False, "auto", True), (torch.float64, False, "auto", False),
    (torch.bfloat16, True, "auto", False), (torch.bfloat16, False, "torch", False)])
def test_auto_takes_the_flash_kernels_where_a_gpu_run_found_them_faster(
        monkeypatch, dtype, attn_mask, kernel, flash):
    """``kernel="auto"`` on a CUDA tensor (here a CPU one taken for one) in float32 or a
    half type and without ``attn_mask`` runs the flash kernels (faster than the SDPA
    augmentation on an H100 at every N measured, docs/gpu-record.md); float64 and an
    ``attn_mask`` with a row per query keep the augmentation (a padding ``attn_mask``:
    ``test_kernelized_flash.py``)."""
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import kernelized as module

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(kernel_backend, "triton_available", lambda: True)
    calls = []

    def flash_kernelized(q, k, v, *args):
        calls.append(q.dtype)
        return torch.zeros_like(v)

    monkeypatch.setattr(module, "flash_kernelized", flash_kernelized)
    q, k, v = make_qkv(1, 2, 16, 8, dtype=dtype, seed=1)
    mask = torch.ones(16, 16, dtype=torch.bool) if attn_mask else None
    kernelized_attention(q, k, v, kernel=kernel, attn_mask=mask)
    assert calls == ([dtype] if flash else [])


@needs_interpreter  # kernel="triton" on CPU tensors
def test_auto_falls_back_to_the_augmentation_when_the_flash_kernels_fail(monkeypatch):
    """Under ``"auto"`` flash kernels that cannot compile or launch (an old GPU, no C
    compiler) warn once and give way to the SDPA augmentation, as the other kernels'
    ``"auto"`` does; ``"triton"`` insists."""
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import kernelized as module

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(kernel_backend, "triton_available", lambda: True)
    monkeypatch.setattr(module.FLASH_FALLBACK, "failures", set())
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(module, "flash_kernelized", broken)
    q, k, v = make_qkv(1, 2, 16, 8, dtype=torch.float32, seed=2)
    with pytest.warns(RuntimeWarning, match="kernel='auto' takes the SDPA augmentation"):
        out = kernelized_attention(q, k, v)
    torch.testing.assert_close(out, kernelized_attention(q, k, v, kernel="torch"))
    kernelized_attention(q, k, v)  # the kernels are not tried again
    assert calls == [1]
    monkeypatch.setattr(module.FLASH_FALLBACK, "failures", set())
    with pytest.raises(RuntimeError, match="no compiler"):
        kernelized_attention(q, k, v, kernel="triton")


@needs_interpreter  # kernel="triton" on CPU tensors
def test_the_fallback_keeps_a_padding_attn_mask(monkeypatch):
    """A padding ``attn_mask`` reaches the flash kernels joined with ``key_padding_mask``
    (the keys both keep), and where they fail under ``"auto"`` the augmentation gets the
    mask itself: the output of ``kernel="torch"`` with it."""
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import kernelized as module

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(kernel_backend, "triton_available", lambda: True)
    monkeypatch.setattr(module.FLASH_FALLBACK, "failures", set())
    q, k, v = make_qkv(2, 2, 16, 8, dtype=torch.float32, seed=4)
    row = torch.ones(2, 16, dtype=torch.bool)
    row[0, 10:] = False
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[1, :3] = False
    given = []

    def broken(q, k, v, key_valid, *args):
        given.append(key_valid)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(module, "flash_kernelized", broken)
    mask = row[:, None, None, :].expand(2, 1, 16, 16)
    with pytest.warns(RuntimeWarning, match="kernel='auto' takes the SDPA augmentation"):
        out = kernelized_attention(q, k, v, key_padding_mask=padding, attn_mask=mask)
    assert len(given) == 1 and torch.equal(given[0], row & padding)
    torch.testing.assert_close(out, kernelized_attention(
        q, k, v, key_padding_mask=padding, attn_mask=mask, kernel="torch"))
    assert not torch.allclose(out, kernelized_attention(q, k, v, key_padding_mask=padding,
                                                        kernel="torch"))


@needs_interpreter  # kernel="triton" on CPU tensors
def test_an_attn_mask_on_another_device_is_named():
    """Also where the flash kernels would read its row (kernel="triton")."""
    q, k, v = make_qkv(1, 2, 8, 4)
    for kernel in ("auto", "torch", "triton"):
        with pytest.raises(ValueError, match=r"attn_mask is on meta .* attn_mask.to\('cpu'\)"):
            kernelized_attention(q, k, v, kernel=kernel, attn_mask=torch.ones(
                1, 1, 1, 8, dtype=torch.bool, device="meta"))


@needs_interpreter  # kernel="triton" on CPU tensors
def test_auto_falls_back_when_the_backward_kernels_fail(monkeypatch):
    """A backward flash kernel that cannot run (too few resources on a smaller GPU)
    under ``"auto"`` warns once and gives the augmentation's gradients; under
    ``"triton"`` its error propagates."""
    from skyformer.linalg import kernel_backend
    from skyformer.ops.kernelized import flash, triton_flash

    monkeypatch.setattr(kernel_backend, "auto_device", lambda y: True)
    monkeypatch.setattr(flash.FLASH_FALLBACK, "failures", set())

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(triton_flash, "flash_backward", broken)
    q, k, v = (t.requires_grad_(True)
               for t in make_qkv(1, 2, 12, 8, dtype=torch.float32, seed=3))
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 9:] = False
    with pytest.warns(RuntimeWarning, match="kernel='auto' takes the SDPA augmentation"):
        got = torch.autograd.grad(kernelized_attention(q, k, v, key_padding_mask=mask,
                                                       causal=True).square().sum(), (q, k, v))
    want = torch.autograd.grad(kernelized_attention(q, k, v, key_padding_mask=mask, causal=True,
                                                    kernel="torch").square().sum(), (q, k, v))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    monkeypatch.setattr(flash.FLASH_FALLBACK, "failures", set())
    out = kernelized_attention(q, k, v, kernel="triton")
    with pytest.raises(RuntimeError, match="out of resources"):
        out.sum().backward()


@pytest.mark.parametrize("float_mask", [False, True])
def test_an_attn_mask_over_keys_alone_forms_no_n_by_n_bias(float_mask):
    """A mask ``[B, 1, 1, N]`` (padded keys, as SDPA callers pass them) stays one row
    for every query: expanding it over the queries for the extra key's column made an
    [N, N + 1] bias. Forward and backward stay below N^2 / 8 entries, equal to the same
    padding given as ``key_padding_mask``."""
    n = 256
    q, k, v = make_qkv(1, 1, n, 8)
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, -30:] = False
    mask = valid[:, None, None, :]
    if float_mask:
        mask = torch.where(mask, 0.0, float("-inf")).double()
    check_lean_and_equal(
        lambda *qkv: kernelized_attention(*qkv, attn_mask=mask, query_padding_mask=None),
        lambda *qkv: kernelized_attention(*qkv, key_padding_mask=valid, query_padding_mask=None),
        [t.clone().requires_grad_(True) for t in (q, k, v)], n * n // 8, rtol=1e-9, atol=1e-11)
