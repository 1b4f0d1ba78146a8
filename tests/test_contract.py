"""The contract every registered method must honour (CONTRIBUTING.md, step 3).

Parametrised over ``list_methods()``: a new method is covered as soon as it registers.
Methods are called through the registry's binding, as every caller calls them (a
fixed-length method such as Linformer is bound for ``MAX_LEN`` tokens). Every test runs
on each device of ``tests/devices.py`` (CUDA when ``SKYFORMER_TEST_CUDA=1``): inputs
are made on the CPU, moved, and outputs come back, so the same assertions hold. A method
registered with ``mask=False`` is checked to refuse a mask with the capability's sentence
in the tests of padding, and runs unpadded in the others (``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyformer import get_method, list_methods, random_key
from skyformer.registry import Capabilities, register
from tests.conftest import gen, lacks, make_qkv, mask_for
from tests.devices import devices

METHODS = list_methods()
MAX_LEN = 64  # the length methods are bound for: above every length used here (n <= 40)
DEVICE = {"name": "cpu"}


@pytest.fixture(params=devices(), autouse=True)
def device(request):
    """Runs every test of this module on each device (``run`` moves the inputs)."""
    DEVICE["name"] = request.param
    yield request.param
    DEVICE["name"] = "cpu"


def run(method, q, k, v, mask=None, seed=0, **options):
    bound = get_method(method).bind(seq_len=MAX_LEN, **options)
    device = DEVICE["name"]
    if device == "cpu":
        return bound(q, k, v, key_padding_mask=mask, generator=gen(seed))
    q, k, v = (t.to(device) for t in (q, k, v))
    mask = None if mask is None else mask.to(device)
    # a key drawn from the CPU generator: the same random numbers on every device
    return bound(q, k, v, key_padding_mask=mask, generator=random_key(gen(seed))).cpu()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_and_dtype(method, dtype):
    q, k, v = make_qkv(2, 3, 20, 8, dv=5, dtype=dtype)
    out = run(method, q, k, v)
    assert out.shape == (2, 3, 20, 5)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16(method):
    if not get_method(method).capabilities.half_precision:
        pytest.skip("no half precision")
    q, k, v = make_qkv(1, 2, 32, 8, dtype=torch.float32)
    out16 = run(method, q.bfloat16(), k.bfloat16(), v.bfloat16())
    out32 = run(method, *(t.bfloat16().float() for t in (q, k, v)))
    assert out16.dtype == torch.bfloat16
    assert torch.isfinite(out16.float()).all()
    # bfloat16 keeps 8 mantissa bits: compare with the float32 run on the same inputs.
    scale = out32.abs().max().clamp_min(1e-6)
    assert ((out16.float() - out32).abs().max() / scale) < 0.05


@pytest.mark.parametrize("method", METHODS)
def test_padding_equals_truncation(method):
    """For a batch of one, right padding gives the real rows the output of the truncated
    input (randomised methods too: their draws for real rows do not depend on padding)."""
    n, real = 24, 17
    q, k, v = make_qkv(1, 2, n, 8, seed=1)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[:, :real] = True
    if lacks(method, "mask", lambda: run(method, q, k, v, mask)):
        return
    budgets = [{}]
    if "num_features" in get_method(method).option_names():
        budgets.append({"num_features": 6})  # fewer features than rows: the draw matters
    for options in budgets:
        padded = run(method, q, k, v, mask, **options)
        truncated = run(method, q[:, :, :real], k[:, :, :real], v[:, :, :real], **options)
        torch.testing.assert_close(padded[:, :, :real], truncated, rtol=1e-7, atol=1e-9)
        assert torch.all(padded[:, :, real:] == 0), "padded query rows must be zero"


@pytest.mark.parametrize("method", METHODS)
def test_padded_keys_get_no_weight(method):
    """Whatever the padded positions hold, the real rows' output does not change."""
    n = 20
    q, k, v = make_qkv(2, 2, n, 8, seed=2)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, 13:] = False  # right padding
    if lacks(method, "mask", lambda: run(method, q, k, v, mask)):
        return
    base = run(method, q, k, v, mask)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    junk = torch.randn(2, 2, n, 8, generator=gen(9), dtype=q.dtype) * 5
    for t in (q2, k2, v2):
        t[~mask[:, None, :].expand(-1, 2, -1)] = junk[~mask[:, None, :].expand(-1, 2, -1)]
    out = run(method, q2, k2, v2, mask)
    torch.testing.assert_close(out, base, rtol=1e-7, atol=1e-9)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", METHODS)
def test_gradients_flow(method):
    q, k, v = make_qkv(1, 2, 16, 8, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[:, 12:] = False
    mask = mask_for(method, mask)
    out = run(method, q, k, v, mask)
    out.square().sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad[:, :, :12].abs().sum() > 0, f"no gradient reaches {name}"
    if mask is not None:
        assert torch.all(v.grad[:, :, 12:] == 0), "padded values must get no gradient"


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_given_generator(method):
    q, k, v = make_qkv(2, 2, 30, 8)
    a = run(method, q, k, v, seed=5)
    b = run(method, q, k, v, seed=5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    if get_method(method).capabilities.randomized:
        # with few features the draw matters (with num_features >= 2N Nystrom uses every row)
        a = run(method, q, k, v, seed=5, num_features=8)
        c = run(method, q, k, v, seed=6, num_features=8)
        assert not torch.allclose(a, c), "a randomised method ignored its generator"
    else:  # what lets approx evaluate it once for all seeds
        torch.testing.assert_close(run(method, q, k, v, seed=6), a, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_any_storage_order_gives_the_contiguous_result(method):
    """Inputs as models make them: a per-head projection by einsum can store v with its
    last two dimensions swapped (multipole's far field once could not ``view`` it),
    and q, k may be transposed views of [B, N, H, D]. Forward and gradients."""
    q, k, v = make_qkv(2, 2, 20, 6, seed=4)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    mask = mask_for(method, mask)
    layouts = (q.transpose(1, 2).contiguous().transpose(1, 2),  # [B, N, H, D] storage
               k.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3),  # N outermost
               v.transpose(2, 3).contiguous().transpose(2, 3))  # D before N
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    strided = [t.requires_grad_(True) for t in layouts]  # leaves with those strides
    assert not strided[2].is_contiguous() and strided[2].stride(-1) > strided[2].stride(-2)
    expected = run(method, *leaves, mask=mask)
    got = run(method, *strided, mask=mask)
    torch.testing.assert_close(got, expected)
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    for name, a, b in zip("qkv", strided, leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_batch_independence(method):
    q, k, v = make_qkv(3, 2, 24, 8, seed=3)
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[2, 20:] = False
    base = run(method, q, k, v, mask_for(method, mask))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[1:] = torch.randn(t[1:].shape, generator=gen(4), dtype=t.dtype) * 3
    mask2 = mask.clone()
    mask2[1, :7] = False
    out = run(method, q2, k2, v2, mask_for(method, mask2))
    torch.testing.assert_close(out[0], base[0], rtol=1e-7, atol=1e-9)


# docs/methods.md, "Invariances": the methods whose outputs follow a permutation of the
# keys (with their values) or queries. Those whose outputs are linear in V declare
# ``weights`` (the others are listed in tests/test_attention_weights.py).
PERMUTATION_INVARIANT = {"softmax", "kernelized", "linear", "performer"}


def few_features(method):
    """num_features=8 where the method has it: fewer features than rows."""
    return {"num_features": 8} if "num_features" in get_method(method).option_names() else {}


@pytest.mark.parametrize("method", [m for m in METHODS if get_method(m).capabilities.weights])
def test_outputs_are_linear_in_the_values(method):
    q, k, v = make_qkv(2, 2, 16, 8, seed=5)
    w = torch.randn(v.shape, generator=gen(6), dtype=v.dtype)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 12:] = False
    mask = mask_for(method, mask)
    a, b, mixed = (run(method, q, k, x, mask, **few_features(method))
                   for x in (v, w, 0.5 * v - 2 * w))
    torch.testing.assert_close(mixed, 0.5 * a - 2 * b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("method", sorted(PERMUTATION_INVARIANT))
def test_permutations_of_keys_and_of_queries(method):
    q, k, v = make_qkv(1, 2, 16, 8, seed=7)
    perm = torch.randperm(16, generator=gen(8))
    out = run(method, q, k, v, **few_features(method))
    keys = run(method, q, k[:, :, perm], v[:, :, perm], **few_features(method))
    queries = run(method, q[:, :, perm], k, v, **few_features(method))
    torch.testing.assert_close(keys, out, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(queries, out[:, :, perm], rtol=1e-7, atol=1e-9)

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_norms_stay_finite(method, dtype):
    q, k, v = make_qkv(2, 2, 40, 32, dtype=dtype, seed=6)
    q = q / q.norm(dim=-1, keepdim=True) * 30
    k = k / k.norm(dim=-1, keepdim=True) * 30
    out = run(method, q, k, v)
    assert torch.isfinite(out).all()
    assert out.abs().max() < 1e3 * v.abs().max()


@pytest.mark.parametrize("method", METHODS)
def test_sequence_shorter_than_features(method):
    q, k, v = make_qkv(2, 2, 5, 8, seed=7)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    out = run(method, q, k, v, mask_for(method, mask))
    assert out.shape == (2, 2, 5, 8)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", METHODS)
def test_fully_padded_sequence_gives_zeros(method):
    q, k, v = make_qkv(2, 2, 10, 8, seed=8)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    if lacks(method, "mask", lambda: run(method, q, k, v, mask)):
        return
    out = run(method, q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("method", METHODS)
def test_cross_attention_capability(method):
    q, k, v = make_qkv(1, 2, 12, 8, nk=20)
    if get_method(method).capabilities.cross_attention:
        assert run(method, q, k, v).shape == (1, 2, 12, 8)
    else:
        with pytest.raises(ValueError, match="different number of queries and keys"):
            run(method, q, k, v)


def _earlier_outputs_change(method, **options):
    """How much the outputs of the first 20 of 40 queries move when the later 20 change
    (a causal decoder's later tokens, in its cross-attention over 30 keys; over the 40
    keys of self-attention for a method without cross-attention)."""
    spec = get_method(method)
    options = {**({} if spec.capabilities.exact else {"num_features": 8}), **options}
    nk = 30 if spec.capabilities.cross_attention else 40  # else as many keys as queries
    q, k, v = make_qkv(2, 2, 40, 8, nk=nk, dtype=torch.float64)
    later = q.clone()
    later[:, :, 20:] += torch.randn(2, 2, 20, 8, dtype=torch.float64, generator=gen(5))
    moved = run(method, later, k, v, **options) - run(method, q, k, v, **options)
    return moved[:, :, :20].abs().max().item()


@pytest.mark.parametrize("method", METHODS)
def test_independent_queries_capability(method):
    """A method declaring ``independent_queries`` gives each query an output of its own
    query, the keys and the values alone: changing the later queries leaves the earlier
    outputs exactly as they were."""
    spec = get_method(method)
    if not spec.capabilities.independent_queries:
        pytest.skip("declares that its outputs mix the queries")
    assert _earlier_outputs_change(method) == 0


# The methods that leave independent_queries undeclared, with the options under which
# their outputs mix the queries: the flag is not merely missing.
MIXING = [("skyformer", {}), ("nystrom_softmax", {}), ("nystromformer", {}), ("informer", {}),
          ("kdeformer", {}), ("skyformer_adaptive", {}), ("skyformer_multipole", {}),
          ("softmax_multipole", {}), ("scatterbrain", {"support": "lsh"})]


@pytest.mark.parametrize(("method", "options"), MIXING, ids=[m for m, _ in MIXING])
def test_methods_without_independent_queries_mix_them(method, options):
    assert not get_method(method).capabilities.independent_queries
    assert _earlier_outputs_change(method, **options) > 1e-6


def test_every_method_is_classed_by_independent_queries():
    """A cross-attention method is either declared independent or shown mixing above."""
    mixing = {m for m, _ in MIXING}
    for method in METHODS:
        caps = get_method(method).capabilities
        if caps.cross_attention:
            assert caps.independent_queries != (method in mixing), method


@pytest.mark.parametrize("method", METHODS)
def test_num_features_is_the_common_knob(method):
    spec = get_method(method)
    if spec.capabilities.exact:
        assert "num_features" not in spec.option_names()
    else:
        assert "num_features" in spec.option_names()
        with pytest.raises(ValueError, match="num_features"):
            run(method, *make_qkv(1, 1, 8, 4), num_features=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("generator", ["seed", 7, "keys"])
def test_a_generator_that_is_none_of_the_three_kinds_gets_a_sentence(method, generator):
    """Every method checks ``generator``, also one that draws nothing (exact softmax and
    kernelized took anything: a sweep's typo passed there and failed at the next
    method): None, a torch.Generator or one random key [2]."""
    q, k, v = make_qkv(3, 2, 12, 4)
    if generator == "keys":
        generator = torch.stack([random_key(i) for i in range(3)])
    with pytest.raises(TypeError, match=r"generator (must be|takes one random key)"):
        get_method(method).bind(seq_len=MAX_LEN)(q, k, v, generator=generator)


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.randomized])
def test_a_key_per_batch_element_gets_a_sentence(method):
    """Keys [B, 2] passed the key check, then most methods failed on a shape deep inside
    (or used fold_in(key[b], b), not key[b]): one key [2] is what the methods take."""
    q, k, v = make_qkv(3, 2, 12, 4)
    keys = torch.stack([random_key(i) for i in range(3)])
    with pytest.raises(TypeError, match=r"one random key, an int64 tensor \[2\]"):
        get_method(method).bind(seq_len=MAX_LEN)(q, k, v, generator=keys)


def _softmax_without_masks(q, k, v, config, *, key_padding_mask=None, generator=None):
    """softmax(QK^T / sqrt(D)) V with no key padding mask (``Capabilities(mask=False)``):
    ``[B, H, Nq, D]``, ``[B, H, Nk, D]``, ``[B, H, Nk, Dv]`` -> ``[B, H, Nq, Dv]``."""
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


@dataclasses.dataclass(frozen=True)
class _NoOptions:
    pass


def test_a_method_that_takes_no_mask_is_held_to_the_rest_of_the_contract(monkeypatch):
    """CONTRIBUTING.md: a method registered with ``mask=False`` (no built-in one is) is
    taken by the registry-wide tests, which passed it a mask and failed on the refusal:
    the tests of padding now check that refusal, the others run it unpadded."""
    from skyformer.registry import methods as registry_methods

    name = "softmax_without_masks"
    monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)  # gone after
    register(name, _NoOptions, Capabilities(target="softmax", exact=True, mask=False))(
        _softmax_without_masks)
    monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])
    for test in (test_padding_equals_truncation, test_padded_keys_get_no_weight,
                 test_gradients_flow, test_any_storage_order_gives_the_contiguous_result,
                 test_batch_independence, test_sequence_shorter_than_features,
                 test_fully_padded_sequence_gives_zeros, test_deterministic_given_generator,
                 test_cross_attention_capability, test_num_features_is_the_common_knob):
        test(name)
    test_shape_and_dtype(name, torch.float64)
    test_large_norms_stay_finite(name, torch.float32)
