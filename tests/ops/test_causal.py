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
from skyformer.sketch.rng import random_key
from tests.conftest import make_qkv
from tests.dispatch import Recorder

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


@pytest.mark.parametrize("method", CAUSAL)
def test_how_far_the_batch_is_padded_changes_no_output(method):
    """Real rows of sequences of 70 and 100 tokens get the same outputs in a batch padded
    to 100 and to 160 (the default landmark stride follows each sequence's real tokens;
    past the first chunk of 64, where the landmarks serve)."""
    q, k, v = make_qkv(2, 2, 160, 8, seed=4)
    mask = torch.zeros(2, 160, dtype=torch.bool)
    mask[0, :70] = mask[1, :100] = True
    budget = {"num_features": 6} if "num_features" in get_method(method).option_names() \
        else {}  # fewer features than tokens: where they go matters

    def run(*tensors):
        g = torch.Generator().manual_seed(2)
        return attention(*tensors[:3], method, key_padding_mask=tensors[3], generator=g,
                         causal=True, **budget)

    wide = run(q, k, v, mask)
    narrow = run(q[:, :, :100], k[:, :, :100], v[:, :, :100], mask[:, :100])
    real = mask[:, None, :100, None].expand_as(narrow)
    torch.testing.assert_close(wide[:, :, :100][real], narrow[real], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method, options", [(m, {}) for m in CAUSAL] + [
    (m, {"causal_local": False}) for m in ("skyformer", "nystrom_softmax")])
def test_left_padding_and_holes_give_the_packed_outputs(method, options):
    """Real tokens anywhere (left padding, a hole) give the outputs they give packed at
    the front: the landmarks and the nystrom forms' exact chunks follow ranks among the
    real tokens (a hole of 7 at position 40 and a left padding of 7 move chunk
    boundaries by position, not by rank)."""
    n = 90
    q, k, v = make_qkv(2, 2, n, 8, seed=6)
    mask = _mask(n, padded=True)
    g = torch.Generator().manual_seed(3)
    budget = {"num_features": 6} if "num_features" in get_method(method).option_names() \
        else {}
    out = attention(q, k, v, method, key_padding_mask=mask, generator=g, causal=True,
                    **options, **budget)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real ones first
    packed = [t.gather(2, order[:, None, :, None].expand_as(t)) for t in (q, k, v)]
    g = torch.Generator().manual_seed(3)
    out_packed = attention(*packed, method, key_padding_mask=mask.gather(1, order),
                           generator=g, causal=True, **options, **budget)
    for i in range(2):
        real = int(mask[i].sum())
        torch.testing.assert_close(out_packed[i, :, :real], out[i][:, mask[i]], rtol=1e-9,
                                   atol=1e-12)


def test_a_query_row_slot_at_a_padded_query_holds_no_landmark():
    """With a query mask of its own, a slot that takes its token's query row where that
    query is padded held the zeroed row, a landmark at the origin; it is dead now, and
    the key-row slots and the other query-row slots are as drawn."""
    from skyformer.ops.shared.causal_nystrom import draw_causal_landmarks
    from skyformer.ops.shared.inputs import check_attention_inputs

    q, k, v = make_qkv(1, 1, 12, 4)
    queries = torch.ones(1, 12, dtype=torch.bool)
    queries[0, 2] = False

    def slots(query_padding_mask):
        info = check_attention_inputs(q, k, v, None, method="skyformer",
                                      query_padding_mask=query_padding_mask)
        return draw_causal_landmarks(info, 12, 1, q.device, random_key(0))

    drawn, own = slots(None), slots(queries)
    assert drawn.position.tolist() == [list(range(12))] and bool(drawn.from_query[2])
    assert own.live.tolist() == [[i != 2 for i in range(12)]]
    assert own.position[0, 2] == 0 and torch.equal(own.position[0, 3:], drawn.position[0, 3:])


def test_a_core_that_rounding_leaves_indefinite_flags_the_slots_from_the_failed_pivot(
        monkeypatch):
    """The causal core factorises C(X_S, X_S) + gamma I unchecked (no host wait); where
    rounding makes it indefinite (float32, tiny gamma, near-equal landmarks) the slots
    from the first failed pivot on are flagged and decoupled, the leading block stays
    exact (a later slot changes no earlier one), and the other matrices are untouched."""
    from skyformer.ops.shared import causal_nystrom

    indefinite = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 2.0], [0.0, 2.0, 1.0]])
    blocks = torch.stack([indefinite, torch.eye(3)])[:, None]  # [B=2, H=1, 3, 3]
    monkeypatch.setattr(causal_nystrom, "gaussian_kernel_block",
                        lambda *args: blocks - 1e-3 * torch.eye(3))  # the ridge added back
    x = torch.zeros(2, 1, 3, 4)
    core = causal_nystrom.core_of_rows(x, torch.ones(2, 3, dtype=torch.bool), gamma=1e-3)
    assert core.failed[:, 0].tolist() == [[False, False, True], [False, False, False]]
    lead = torch.linalg.inv(torch.linalg.cholesky(indefinite[:2, :2]))
    torch.testing.assert_close(core.l_inv[0, 0, :2, :2], lead)
    torch.testing.assert_close(core.l_inv[0, 0, 2], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(core.l_inv[1, 0], torch.eye(3))


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_outputs_before_a_failed_slot_stay_and_decoding_agrees(method):
    """Identical landmark rows with gamma = 1e-9 in float32: a pivot of the core after
    the first fails (the second or the third: which depends on the rounding of the
    kernel entries, which differs between CPUs), so the queries that may use that slot
    or a later one are NaN and those before it keep their outputs (a later token
    changes no earlier output), step by step as well."""
    from skyformer.decoding import new_decoding_state
    from skyformer.sketch.rng import random_key

    row = torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(1))
    q = row.expand(1, 2, 100, 8).clone()
    v = torch.randn(1, 2, 100, 8, generator=torch.Generator().manual_seed(2))
    bound = get_method(method).bind(num_features=8, landmark_stride=8, gamma=1e-9,
                                    causal=True)
    key = random_key(3)
    with pytest.warns(UserWarning, match=r"^gamma=1e-09 with 8 landmarks in float32"):
        out = bound(q, q, v, generator=key)  # NaN rows, as the non-causal forms, explained
    nan = torch.isnan(out).any(-1)[0, 0]  # [N]
    first = int(nan.long().argmax())
    assert 0 < first < 32 and bool(nan[first:].all()) and not bool(nan[:first].any())
    early = bound(q[:, :, :first], q[:, :, :first], v[:, :, :first], generator=key)
    torch.testing.assert_close(out[:, :, :first], early, rtol=0, atol=0)
    state = new_decoding_state(bound, generator=key)
    steps = [state.step(q[:, :, :4], q[:, :, :4], v[:, :, :4])]
    steps += [state.step(q[:, :, t:t + 1], q[:, :, t:t + 1], v[:, :, t:t + 1])
              for t in range(4, 100)]
    torch.testing.assert_close(torch.cat(steps, dim=2), out, rtol=1e-5, atol=1e-6,
                               equal_nan=True)


@pytest.mark.parametrize("local", [True, False])
def test_left_padding_gives_the_packed_rows_that_fall_back_to_the_mean(local):
    """nystrom_softmax's bound of unreliable rows sums its far part chunk by chunk, so
    which rows return the prefix mean depends on the chunks, with causal_local off too:
    with a left padding of 10, row 136 (rank 126) fell back in the packed sequence and
    not in the padded one while only causal_local gathered the real tokens."""
    n = 140
    q, k, v = make_qkv(1, 2, n, 4, seed=1, scale=3.0)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, :10] = False
    options = {"num_features": 6, "landmark_stride": 3, "causal_local": local,
               "causal": True}
    key = random_key(3)
    out = attention(q, k, v, "nystrom_softmax", key_padding_mask=mask, generator=key,
                    **options)
    packed = attention(*(t[:, :, 10:] for t in (q, k, v)), "nystrom_softmax",
                       generator=key, **options)
    torch.testing.assert_close(out[:, :, 10:], packed, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", CAUSAL)
def test_a_non_finite_query_or_key_changes_no_earlier_output(method, bad):
    """A NaN or inf query or key at j (inside the first chunk, and in the second at a
    landmark slot's position) leaves every output before j bit-identical. It did not:
    nystrom_softmax mixed the later chunks' sums in with zero weights (0 x NaN), so the
    rows of the chunks up to j's fell back to the mean of the values; and in both
    Nystrom methods a landmark row holding NaN gave every feature of every key 0 x
    NaN, the earlier rows NaN. (A non-finite value spoils the earlier rows of its
    chunk, as SDPA's 0 x NaN does all of them: not tested here.)"""
    q, k, v = make_qkv(2, 2, 130, 8, seed=0)
    out = _run(method, q, k, v, None, seed=0)
    for j in (20, 100):
        for t in (q, k):
            spoiled = t.clone()
            spoiled[0, 1, j, 3] = bad
            inputs = [spoiled if s is t else s for s in (q, k, v)]
            again = _run(method, *inputs, None, seed=0)
            assert torch.equal(again[:, :, :j], out[:, :, :j]), (method, j)
            assert torch.isnan(again[0, 1, j]).all(), (method, j)


def test_causal_skyformer_saves_no_gaussian_block_for_the_backward_pass(monkeypatch):
    """Its features phi = L^-1 C(X_S, y) come from one product
    (``causal_nystrom.gaussian_features``, ``linalg.gaussian_kernel_matmul``), whose
    backward pass rebuilds C: at a length of more than one of its chunks, the call keeps
    at least the two ``[N, m]`` blocks (of the queries and of the keys) less for its
    backward pass than with the block times (L^-1)^T, the earlier path (patched in)."""
    from skyformer.linalg import gaussian_kernel_block, half_sq_norm
    from skyformer.linalg.kernel_matmul import chunk_rows
    from skyformer.ops.shared.causal_nystrom import nystrom_features
    from skyformer.ops.skyformer import causal as causal_skyformer

    n, m = 3000, 96
    assert chunk_rows(n, 1, m, torch.device("cpu")) < n  # the product rebuilds C by chunks
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 1, n, 16, seed=2))

    def saved_bytes():
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attention(q, k, v, "skyformer", causal=True, num_features=m,
                      generator=torch.Generator().manual_seed(1))
        return sum(storages.values())

    def block_features(y, core, *, row_valid=None, kernel="auto"):
        return nystrom_features(gaussian_kernel_block(y, core.x, half_sq_norm(y),
                                                      core.x_norm), core)

    product = saved_bytes()
    monkeypatch.setattr(causal_skyformer, "gaussian_features", block_features)
    assert saved_bytes() - product >= 2 * n * m * q.element_size()


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_causal_features_on_the_triton_kernels_equal_the_pytorch_path(method):
    """The features' products with ``kernel="triton"`` (Triton's interpreter on the CPU;
    on CUDA the default for float32) give the PyTorch path's outputs and gradients,
    padding included."""
    pytest.importorskip("triton")
    from skyformer.linalg.kernel_backend import interpreter_on

    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0)")
    n = 90
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, n, 16, seed=5))
    mask = _mask(n, padded=True)

    def run(kernel):
        with Recorder(lambda func, args, out: func.name() if "gaussian_" in func.name()
                      and "product" in func.name() else None) as products:
            out = attention(q, k, v, method, causal=True, num_features=24, kernel=kernel,
                            key_padding_mask=mask, generator=torch.Generator().manual_seed(2))
            results = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
        return results, products.items

    (got, launched), (want, none) = run("triton"), run("torch")
    assert launched and not none  # the Triton products' operators ran, and only there
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_a_call_that_is_not_causal_refuses_the_causal_forms_options(method):
    """landmark_stride and causal_local=False shape the causal form only: a call
    without causal=True gave the default's output, bit for bit, without a word."""
    q, k, v = make_qkv(1, 2, 16, 4)
    for options, said in (({"landmark_stride": 3}, r"landmark_stride=3 shapes"),
                          ({"causal_local": False}, r"causal_local=False shapes"),
                          ({"landmark_stride": 3, "causal_local": False},
                           r"causal_local=False and landmark_stride=3 shape")):
        with pytest.raises(ValueError, match=rf"^{method}: {said} causal attention only "
                                             r"\(causal=True\); this call is not causal"):
            attention(q, k, v, method, num_features=4, **options)
        attention(q, k, v, method, num_features=4, causal=True, **options)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_a_landmark_stride_past_int64s_reach_gets_a_sentence(method):
    """landmark_stride=2**62 overflowed slot * stride and failed with an IndexError deep
    inside; the largest stride whose positions stay in range is 2^32."""
    q, k, v = make_qkv(b=1, h=2, n=8, d=4)
    with pytest.raises(ValueError, match=rf"^{method}: landmark_stride must be at most 2\^32 "):
        attention(q, k, v, method, causal=True, num_features=4, landmark_stride=2**62,
                  generator=random_key(0))
    out = attention(q, k, v, method, causal=True, num_features=4, landmark_stride=2**32,
                    generator=random_key(0))
    assert out.isfinite().all()
