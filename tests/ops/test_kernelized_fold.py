"""Exact kernelized attention with the key norms folded into V (``fold_key_norms=True``,
``ops/kernelized/sdpa_fold.py``) against the naive pairwise reference: outputs and
gradients, padding, causal masks, cross-attention, Dv != D, half types, the range it
is exact in, ``torch.func`` and ``torch.compile``; on CUDA with ``SKYFORMER_TEST_CUDA=1``
(FlashAttention-2 for bfloat16, the memory-efficient kernel for float32).
"""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer import kernelized_attention
from skyformer.ops.kernelized import sdpa_fold
from skyformer.ops.kernelized.naive import reference_kernelized_attention
from tests.conftest import gen, make_qkv
from tests.devices import devices, relative_error

CASES = [  # b, h, nq, nk, d, dv
    (2, 2, 37, 45, 16, 24),
    (1, 3, 70, 70, 40, 8),
    (2, 1, 33, 1, 128, 16),
    (1, 1, 130, 97, 64, 64),
]
FORMS = ["plain", "padded", "causal", "padded causal"]


def _padding(b: int, n: int, device) -> torch.Tensor:
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, n - max(1, n // 4):] = n <= 1  # keep the only key of a one-key case
    if b > 1:
        mask[1, : n // 5] = False
    return mask.to(device)


def _errors(q, k, v, mask, causal, dtype, device) -> dict[str, float]:
    """Output and input gradients of the folded call in ``dtype`` on ``device``: relative
    errors against the pairwise reference in float64 on the same rounded inputs."""
    leaves = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, key_padding_mask=mask, causal=causal,
                               fold_key_norms=True)
    assert out.dtype == dtype and out.device.type == torch.device(device).type
    exact = [t.to(device, dtype).double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_kernelized_attention(*exact, key_padding_mask=mask, causal=causal)
    weights = torch.randn(out.shape, generator=gen(9), dtype=torch.float64).to(device)
    got = [out, *torch.autograd.grad((out * weights.to(dtype)).sum(), leaves)]
    want = [ref, *torch.autograd.grad((ref * weights).sum(), exact)]
    return {name: relative_error(a, e)
            for name, a, e in zip(["out", "dq", "dk", "dv"], got, want, strict=True)}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("case", "form"), [(case, form) for case in CASES for form in FORMS
                                            if "causal" not in form or case[2] == case[3]])
def test_folded_sdpa_equals_the_naive_reference(device, case, form):
    b, h, nq, nk, d, dv = case
    q, k, v = make_qkv(b, h, nq, d, nk=nk, dv=dv, seed=nq + d, scale=0.7)
    mask = _padding(b, nk, device) if "padded" in form else None
    dtype, tolerance = ((torch.float64, 1e-12) if device == "cpu"
                        else (torch.float32, 1e-4))  # float64 on CUDA: the augmentation
    errors = _errors(q, k, v, mask, "causal" in form, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_folded_sdpa_in_float32_and_half_types(device, dtype, causal):
    """To the dtype's rounding: bfloat16 as SDPA itself rounds (the weights before their
    product with V), float16 computed in float32 and rounded once at the end."""
    q, k, v = make_qkv(2, 2, 66, 64, seed=4)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    errors = _errors(q, k, v, _padding(2, 66, device), causal, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


def test_the_augmentation_and_the_fold_agree_with_padded_queries_zeroed():
    q, k, v = make_qkv(2, 2, 50, 32, seed=6)
    mask = _padding(2, 50, "cpu")
    out = [kernelized_attention(q, k, v, key_padding_mask=mask, fold_key_norms=fold)
           for fold in (False, True)]
    assert relative_error(out[1], out[0]) < 1e-12
    assert (out[1][0, :, -12:] == 0).all()  # padded queries of batch 0


def _one_far_key(spread: float, d: int = 64) -> tuple[torch.Tensor, ...]:
    """float32 keys near the origin and one key (the last) with s |k|^2 / 2 = ``spread``
    (s = d^-1/2), the last query next to it, so that its row is that key's value."""
    q, k, v = make_qkv(1, 1, 40, d, seed=3, dtype=torch.float32, scale=0.5)
    far = torch.full((d,), (2 * spread * d**0.5 / d) ** 0.5)
    k[0, 0, -1], q[0, 0, -1] = far, far + 0.1
    return q, k, v


def test_exact_while_the_key_norms_span_less_than_the_documented_range():
    q, k, v = _one_far_key(110.0)
    ref = reference_kernelized_attention(q.double(), k.double(), v.double())
    out = kernelized_attention(q, k, v, fold_key_norms=True)
    augmented = kernelized_attention(q, k, v)
    assert relative_error(out, ref) < 1e-5
    # the far key's own row: float32's rounding of that key (3e-5), as the augmentation
    assert relative_error(out[0, 0, -1], ref[0, 0, -1]) < 1e-4
    assert relative_error(out[0, 0, -1], augmented[0, 0, -1]) < 1e-6


def test_past_the_documented_range_the_fold_loses_the_far_key_and_the_augmentation_does_not():
    """The limit the docstrings state, shown: at a span of 300 the far key's folded value
    underflows in float32; the default augmentation has no such limit."""
    q, k, v = _one_far_key(300.0)
    ref = reference_kernelized_attention(q.double(), k.double(), v.double())[0, 0, -1]
    folded = kernelized_attention(q, k, v, fold_key_norms=True)[0, 0, -1]
    augmented = kernelized_attention(q, k, v)[0, 0, -1]
    assert relative_error(augmented, ref) < 1e-4  # float32's rounding of that key
    assert not relative_error(folded, ref) < 0.5  # lost (or NaN)


def test_fold_exponent_shift_is_the_middle_of_the_valid_keys_range_with_headroom():
    norms = torch.tensor([[[1.0, 5.0, 1000.0, 9.0]], [[2.0, 300.0, 4.0, float("nan")]]])
    valid = torch.tensor([[True, True, False, True], [True, True, True, False]])[:, None]
    shift = sdpa_fold.fold_exponent_shift(norms, valid)
    assert shift[:, 0, 0].tolist() == [5.0, 2.0 + sdpa_fold.FOLD_HEADROOM]
    empty = sdpa_fold.fold_exponent_shift(norms, torch.zeros_like(valid))
    assert empty.eq(0).all()  # no valid key: 0, not inf


def test_bad_combinations_are_refused_in_a_sentence():
    q, k, v = make_qkv(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r'fold_key_norms=True .* kernel="triton"'):
        kernelized_attention(q, k, v, fold_key_norms=True, kernel="triton")
    with pytest.raises(ValueError, match="fold_key_norms=False for an attn_mask"):
        kernelized_attention(q, k, v, fold_key_norms=True,
                             attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="fold_key_norms"):
        kernelized_attention(q, k, v, fold_key_norms="yes")


def test_torch_func_transforms_and_forward_mode():
    q, k, v = make_qkv(3, 2, 20, 16, seed=11)
    call = lambda q, k, v: kernelized_attention(q, k, v, fold_key_norms=True)  # noqa: E731
    mapped = torch.func.vmap(call)(q[:, None], k[:, None], v[:, None])[:, 0]
    torch.testing.assert_close(mapped, call(q, k, v), rtol=1e-12, atol=1e-12)

    def loss(q, k, v):
        return (call(q, k, v) * v.sum(-1, keepdim=True)).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    loss(*leaves).backward()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)
    per_sample = torch.func.vmap(torch.func.grad(loss))(q[:, None], k[:, None], v[:, None])
    for i in range(3):  # each sample's gradient of q, alone
        alone = torch.func.grad(loss)(q[i : i + 1], k[i : i + 1], v[i : i + 1])
        torch.testing.assert_close(per_sample[i], alone, rtol=1e-12, atol=1e-12)
    # forward mode: the fused kernels have no derivative there, the augmentation does
    tangent = torch.randn_like(q)
    _, jvp = torch.func.jvp(lambda q: call(q, k, v), (q,), (tangent,))
    ref_jvp = torch.func.jvp(lambda q: reference_kernelized_attention(q, k, v), (q,),
                             (tangent,))[1]
    torch.testing.assert_close(jvp, ref_jvp, rtol=1e-9, atol=1e-12)


def test_compiled_call_equals_the_eager_one():
    q, k, v = make_qkv(1, 2, 24, 16, seed=12, dtype=torch.float32)
    mask = _padding(1, 24, "cpu")

    def step(q, k, v):
        return skyformer.attention(q, k, v, "kernelized", fold_key_norms=True,
                                   key_padding_mask=mask)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for call in (step, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = call(*leaves)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="the CUDA operators' signatures need a CUDA build of torch "
                           "(checked under fake CUDA tensors, no GPU needed)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_operator_calls_are_well_formed_on_fake_tensors(dtype):
    """The CUDA branch's private operators (flash for bfloat16, memory-efficient for
    float32), forward and backward, called as the Function calls them: shapes and
    dtypes from their fake kernels, on a machine without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(2, 3, 100, 64, device="cuda", dtype=dtype) for _ in range(3))
        out, lse, seed, offset = sdpa_fold._fused_forward(q, k, v, 0.125, True)
        grads = sdpa_fold._fused_backward(out, q, k, v, out, lse, seed, offset, 0.125, True)
    assert sdpa_fold.uses_flash(q) == (dtype == torch.bfloat16)
    assert out.shape == q.shape and lse.dtype == torch.float32 and lse.shape[-1] >= 100
    assert [g.shape for g in grads] == [q.shape] * 3
