"""Skyformer against the paper's equations (naive lifted reference) and its limits."""

from __future__ import annotations

import dataclasses
import itertools
from unittest import mock

import pytest
import torch

import skyformer
from skyformer import kernelized_attention, skyformer_attention
from skyformer.eval.measure.metrics import relative_error
from skyformer.linalg import kernel_matmul
from skyformer.ops.shared import modified_nystrom
from skyformer.ops.shared.inputs import check_attention_inputs
from skyformer.ops.shared.modified_nystrom import sample_landmarks
from skyformer.ops.skyformer import materialised_skyformer_attention
from skyformer.ops.skyformer.naive import reference_skyformer_attention
from tests.conftest import gen, make_qkv
from tests.dispatch import Recorder


def landmarks_for(q, k, v, mask, m, seed):
    info = check_attention_inputs(q, k, v, mask, method="test")
    return sample_landmarks(info, m, q.device, gen(seed))


@pytest.mark.parametrize("pinv", ["iterative", "exact"])
@pytest.mark.parametrize("init", ["identity", "scaled_transpose"])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_matches_naive_lifted_reference(pinv, init, masked):
    q, k, v = make_qkv(2, 2, 26, 8)
    mask = None
    if masked:
        mask = torch.ones(2, 26, dtype=torch.bool)
        mask[0, 20:] = False
        mask[1, :6] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = skyformer_attention(
        q,
        k,
        v,
        key_padding_mask=mask,
        generator=gen(3),
        num_features=12,
        pinv=pinv,
        pinv_init=init,
    )
    lm = landmarks_for(q, k, v, mask, 12, 3)
    ref = reference_skyformer_attention(
        q, k, v, lm, key_padding_mask=mask, pinv=pinv, pinv_init=init
    )
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    if pinv == "iterative":  # eigh's gradient is not a fair target for exact pinv
        for a, b in zip(
            torch.autograd.grad(fast.sum(), (q, k, v)),
            torch.autograd.grad(ref.sum(), (q, k, v)),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("nq", [26, 19])  # self- and cross-attention
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_a_batch_element_without_keys_is_zero_in_both_paths(method, nq):
    """The naive reference stopped at an empty sub-sampling matrix where a batch
    element's mask keeps no key; both paths give its rows zero."""
    from skyformer.ops.nystrom_softmax.naive import reference_nystrom_softmax_attention

    q, k, v = make_qkv(2, 2, 26, 8)
    q = q[:, :, :nq]
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1] = False
    fast = skyformer.attention(q, k, v, method, key_padding_mask=mask, generator=gen(3),
                               num_features=12)
    reference = {"skyformer": reference_skyformer_attention,
                 "nystrom_softmax": reference_nystrom_softmax_attention}[method]
    ref = reference(q, k, v, landmarks_for(q, k, v, mask, 12, 3), key_padding_mask=mask)
    assert fast[1].eq(0).all()
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("masked", [False, True])
def test_the_implicit_option_matches_the_naive_reference_at_its_steps(masked):
    """``pinv_gradient="implicit"``: the naive reference takes the exact ridge inverse
    (the fast path on the CPU factorises, elsewhere runs the steps the bound asks for:
    the same inverse to rounding), on queries and keys clustered so that 6 steps would
    not do."""
    q, k, v = make_qkv(2, 2, 26, 8)
    q, k = (0.05 * t + torch.ones(8, dtype=t.dtype) for t in (q, k))
    mask = None
    if masked:
        mask = torch.ones(2, 26, dtype=torch.bool)
        mask[0, 20:] = False
    fast = skyformer_attention(q, k, v, key_padding_mask=mask, generator=gen(3),
                               num_features=12, pinv_gradient="implicit")
    lm = landmarks_for(q, k, v, mask, 12, 3)
    ref = reference_skyformer_attention(q, k, v, lm, key_padding_mask=mask,
                                        pinv_gradient="implicit")
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)
    six = reference_skyformer_attention(q, k, v, lm, key_padding_mask=mask)
    assert (six - ref).abs().max() > 1e-8  # the 6 steps are further off than the match


@pytest.mark.parametrize("masked", [False, True])
def test_every_row_as_landmark_reproduces_kernelized_attention(masked):
    """Exactness limit: S = I, gamma = 0, exact inverse => C~ = C."""
    q, k, v = make_qkv(2, 2, 15, 8)
    mask = None
    if masked:
        mask = torch.ones(2, 15, dtype=torch.bool)
        mask[1, 9:] = False
    out = skyformer_attention(
        q, k, v, key_padding_mask=mask, num_features=30, gamma=0.0, pinv="exact"
    )
    torch.testing.assert_close(
        out, kernelized_attention(q, k, v, key_padding_mask=mask), rtol=1e-7, atol=1e-9
    )


def test_gamma_zero_is_refused_for_the_identity_start_which_diverges_when_rows_repeat():
    """Without a ridge, repeated landmark rows make M singular: from V_0 = I its null
    space grows by 13/4 a step (NaN after 40 steps in float64). Lemma 3 needs gamma > 0;
    the scaled transpose start converges to the pseudo-inverse for any matrix."""
    q, _, v = make_qkv(1, 2, 6, 4)
    q = torch.cat([q[:, :, :3], q[:, :, :3]], dim=2)  # every row twice; k = q
    with pytest.raises(ValueError, match=r"gamma > 0.*scaled_transpose.*exact"):
        skyformer_attention(q, q, v, num_features=12, gamma=0.0, pinv_iterations=40)
    out = skyformer_attention(q, q, v, num_features=12, gamma=0.0, pinv_iterations=40,
                              pinv_init="scaled_transpose")
    torch.testing.assert_close(out, kernelized_attention(q, q, v), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_gamma_zero_in_a_causal_call_names_what_the_causal_form_needs(method):
    """The causal form factorises its core by Cholesky and needs gamma > 0 whatever the
    inverse options: the refusal says so, without offering the non-causal form's ways to
    gamma = 0 (pinv_init='scaled_transpose', pinv='exact'), which it refuses next."""
    q, k, v = make_qkv(1, 2, 6, 4)
    for options in ({}, {"pinv_init": "scaled_transpose"}, {"pinv": "exact"}):
        with pytest.raises(ValueError, match=r"causal=True needs gamma > 0") as refused:
            skyformer.attention(q, k, v, method, causal=True, gamma=0.0, **options)
        assert "scaled_transpose" not in str(refused.value)
    with pytest.raises(ValueError, match=r"gamma must be a finite number >= 0, got 'x'"):
        skyformer.attention(q, k, v, method, causal=True, gamma="x")


def test_iterative_inverse_error_small_and_shrinks_with_iterations():
    q, k, v = make_qkv(2, 2, 64, 16)
    exact = skyformer_attention(q, k, v, generator=gen(1), num_features=32, pinv="exact")
    errors = [
        relative_error(
            skyformer_attention(q, k, v, generator=gen(1), num_features=32, pinv_iterations=t),
            exact,
        )
        .mean()
        .item()
        for t in (1, 3, 6, 12)
    ]
    # Non-increasing up to rounding: on this input 6 iterations already reach ~1e-15,
    # where which of two such values is smaller is rounding noise.
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(errors))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.05  # the paper's 6 iterations
    assert errors[3] < 1e-4


def test_error_falls_as_features_grow():
    """Averaged over seeds, more landmarks approximate kernelized attention better."""
    q, k, v = make_qkv(1, 2, 96, 16, seed=4, scale=0.8)
    exact = kernelized_attention(q, k, v)
    means = []
    for m in (8, 32, 96, 192):
        errs = [
            relative_error(
                skyformer_attention(q, k, v, generator=gen(s), num_features=m), exact
            ).mean()
            for s in range(4)
        ]
        means.append(torch.stack(errs).mean().item())
    assert all(b < a for a, b in itertools.pairwise(means)), means
    assert means[-1] < 0.05


def test_landmarks_half_from_queries_half_from_keys_and_only_valid_rows():
    q, k, v = make_qkv(3, 1, 40, 4)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, :30] = False  # left padding: only rows 30..39 are real
    lm = landmarks_for(q, k, v, mask, 16, 0)
    assert lm.query_index.shape == (3, 8) and lm.key_index.shape == (3, 8)
    for b in range(3):
        for index, live in (
            (lm.query_index[b], lm.query_live[b]),
            (lm.key_index[b], lm.key_live[b]),
        ):
            assert live.all()
            assert mask[b, index].all()
            assert len(set(index.tolist())) == len(index)  # without replacement
    few = landmarks_for(q, k, v, mask, 30, 0)  # row 1 has only 10 real rows per side
    assert few.query_live[1].sum() == 10 and few.key_live[1].sum() == 10
    assert few.query_live[0].all()


def test_an_unpadded_call_leaves_out_the_dead_slot_masks():
    # without padding every landmark slot is filled (no slot needs masking): the call
    # neither computes the masks (lt) nor applies them (where), and gives what the masks
    # would have given, bit for bit
    q, k, v = make_qkv(2, 2, 24, 8)
    names = Recorder(lambda func, args, out: func.overloadpacket.__name__)
    with names:
        out = skyformer_attention(q, k, v, generator=gen(0), num_features=30)
    assert "where" not in names.items and "lt" not in names.items
    assert landmarks_for(q, k, v, None, 30, 0).every_slot_live
    assert not landmarks_for(q, k, v, torch.ones(2, 24, dtype=torch.bool), 30, 0
                             ).every_slot_live
    draw = modified_nystrom.uniform_landmarks

    def masked_draw(*args, **kwargs):
        drawn = draw(*args, **kwargs)
        return dataclasses.replace(drawn, query_live_mask=drawn.query_live,
                                   key_live_mask=drawn.key_live)

    with mock.patch.object(modified_nystrom, "uniform_landmarks", masked_draw), names:
        names.items.clear()
        masked = skyformer_attention(q, k, v, generator=gen(0), num_features=30)
    assert "where" in names.items
    assert torch.equal(out, masked)


def test_half_precision_is_computed_in_float32():
    q, k, v = make_qkv(1, 2, 40, 16, dtype=torch.float32)
    out = skyformer_attention(q.half(), k.half(), v.half(), generator=gen(0), num_features=16)
    ref = skyformer_attention(
        q.half().float(), k.half().float(), v.half().float(), generator=gen(0), num_features=16
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "skyformer_adaptive"])
def test_a_ridge_below_the_dtypes_rounding_is_warned_of_at_the_callers_line(method):
    """gamma = 1e-9 in float32 acts as 0 beside close landmarks: outputs 1e6-1e7 off, or
    NaN, without a word (the ridge is lost to rounding; Lemma 3 no longer holds)."""
    import warnings

    q, k, v = make_qkv(1, 1, 32, 8, dtype=torch.float32)
    call = skyformer.get_method(method).function
    with pytest.warns(UserWarning, match=r"^gamma=1e-09 with 16 landmarks in float32: the "
                                         r"core's condition number may reach \(m \+ gamma\) "
                                         r"/ gamma = 1\.6e\+10, .* use gamma >= 3e-05 or "
                                         r"float64 inputs\.$") as said:
        call(q, k, v, num_features=16, gamma=1e-9, generator=gen(0))
    assert said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(q, k, v, num_features=16, generator=gen(0))  # gamma = 0.1
        call(q.double(), k.double(), v.double(), num_features=16, gamma=1e-9,
             generator=gen(0))
        with mock.patch("torch.compiler.is_compiling", return_value=True):  # frames
            call(q, k, v, num_features=16, gamma=1e-9,  # untraceable
                 generator=skyformer.random_key(0))


@pytest.mark.parametrize(("method", "causal"), [
    ("skyformer", False), ("nystrom_softmax", False), ("skyformer_adaptive", False),
    ("skyformer", True), ("nystrom_softmax", True)])  # skyformer_adaptive: no causal form
def test_a_ridge_past_the_dtypes_range_is_refused_in_a_sentence(method, causal):
    """gamma = 1e39 in float32 stopped at filling the ridge with torch's bare overflow
    message; float64 holds it (the output is then that of a near-zero core)."""
    q, k, v = make_qkv(1, 1, 16, 4, dtype=torch.float32)
    call = skyformer.get_method(method).function
    options = {"causal": True} if causal else {}
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: a float32 core
        with pytest.raises(ValueError, match=r"^gamma=1e\+39 is past the largest float32 "
                                             r"value \(3\.4e\+38\), the dtype the Nystrom "
                                             r"core is computed in: .* float64 inputs\.$"):
            call(*(t.to(dtype) for t in (q, k, v)), num_features=4, gamma=1e39,
                 generator=gen(0), **options)
    out = call(q.double(), k.double(), v.double(), num_features=4, gamma=1e39,
               generator=gen(0), **options)
    assert out.isfinite().all()


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_the_materialised_forms_refuse_causal_in_a_sentence(method):
    """The materialised forms (the two-way blocks formed whole) ignored causal=True, every
    row seeing later keys (0.9 off the causal form), and the causal form's options."""
    from skyformer.ops.nystrom_softmax import materialised_nystrom_softmax_attention

    materialised = {"skyformer": materialised_skyformer_attention,
                    "nystrom_softmax": materialised_nystrom_softmax_attention}[method]
    q, k, v = make_qkv(1, 1, 6, 4)
    with pytest.raises(ValueError, match=rf"^materialised_{method}_attention has no causal "
                                         rf"form .* use {method}_attention\(\.\.\., "
                                         rf"causal=True\)\.$"):
        materialised(q, k, v, causal=True, generator=gen(0))
    with pytest.raises(ValueError, match=rf"^{method}: landmark_stride=2 shapes causal .* "
                                         rf"leave it out, or use {method}_attention"):
        materialised(q, k, v, landmark_stride=2, generator=gen(0))


def test_bad_options_name_the_problem():
    q, k, v = make_qkv(1, 1, 8, 4)
    for options, word in (
        ({"num_features": 0}, "num_features"),
        ({"num_features": 2.5}, "num_features"),
        ({"gamma": -1.0}, "gamma"),
        ({"pinv": "svd"}, "pinv"),
        ({"pinv_iterations": -2}, "pinv_iterations"),
        ({"pinv_init": "zeros"}, "pinv_init"),
    ):
        with pytest.raises(ValueError, match=word):
            skyformer_attention(q, k, v, **options)
    with pytest.raises(TypeError, match="generator"):
        skyformer_attention(q, k, v, generator=0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("init", ["identity", "scaled_transpose"])
@pytest.mark.parametrize("chunk_elements", [1, 2**18])  # 64-row chunks (several); one chunk
def test_fused_path_equals_materialised_path(masked, init, chunk_elements, monkeypatch):
    """The chunked path with its own backward equals the previous implementation (whole
    [N, m] blocks, autograd) on outputs and gradients, masks included."""
    monkeypatch.setattr(kernel_matmul, "CPU_CHUNK_ELEMENTS", chunk_elements)
    q, k, v = make_qkv(2, 2, 150, 8, dv=5)
    mask = None
    if masked:
        mask = torch.ones(2, 150, dtype=torch.bool)
        mask[0, 130:] = False
        mask[1, :70] = False
    for t in (q, k, v):
        t.requires_grad_(True)
    options = {"key_padding_mask": mask, "num_features": 24, "pinv_init": init}
    fast = skyformer_attention(q, k, v, generator=gen(5), **options)
    before = materialised_skyformer_attention(q, k, v, generator=gen(5), **options)
    torch.testing.assert_close(fast, before, rtol=1e-10, atol=1e-12)
    g = torch.randn(fast.shape, generator=gen(6), dtype=fast.dtype)
    for a, b in zip(
        torch.autograd.grad((fast * g).sum(), (q, k, v)),
        torch.autograd.grad((before * g).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_fused_path_equals_materialised_path_in_float32():
    q, k, v = make_qkv(1, 2, 700, 32, dtype=torch.float32)
    for t in (q, k, v):
        t.requires_grad_(True)
    fast = skyformer_attention(q, k, v, generator=gen(0))
    before = materialised_skyformer_attention(q, k, v, generator=gen(0))
    torch.testing.assert_close(fast, before, rtol=1e-4, atol=1e-6)
    for a, b in zip(
        torch.autograd.grad(fast.sum(), (q, k, v)),
        torch.autograd.grad(before.sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_matches_the_naive_per_query_construction(local, padded):
    """The fast causal path (nested cores from one Cholesky, chunked prefix sums) equals
    the per-query construction with explicit inverses, on outputs and gradients."""
    from skyformer.linalg import kernel_scale
    from skyformer.ops.shared.causal_naive import reference_causal_nystrom
    from skyformer.ops.shared.inputs import check_attention_inputs
    from skyformer.ops.skyformer.causal import causal_skyformer, draw_causal_landmarks
    from skyformer.sketch.rng import random_key

    n = 23
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, n, 6))
    mask = None
    if padded:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, :4] = False
        mask[1, 9:12] = False
    info = check_attention_inputs(q, k, v, mask, method="test")
    marks = draw_causal_landmarks(info, 10, 2, q.device, random_key(gen(1)))
    scale = kernel_scale(6, None)
    fast, _ = causal_skyformer(q, k, v, info, scale, 0.1, local, marks, chunk=8)
    if mask is not None:
        fast = fast * mask[:, None, :, None]
    ref = reference_causal_nystrom(q, k, v, marks, key_padding_mask=mask, scale=scale,
                                   gamma=0.1, local=local, chunk=8)
    torch.testing.assert_close(fast, ref, rtol=1e-11, atol=1e-12)  # float64
    for a, b in zip(torch.autograd.grad(fast.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_landmark_slots_a_short_sequence_leaves_empty_match_the_lifted_reference():
    """More landmarks than a padded sequence has real rows: its empty slots hold no
    landmark (not a point at the origin, which the padded rows become), at the default
    ridge and iterative inverse, where gamma = 0 with the exact inverse hid them."""
    q, k, v = make_qkv(2, 2, 15, 8)
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[1, 9:] = False  # 18 real rows of [Q; K] for 24 slots
    out = skyformer_attention(q, k, v, key_padding_mask=mask, generator=gen(3),
                              num_features=24)
    info = check_attention_inputs(q, k, v, mask, method="skyformer")
    landmarks = sample_landmarks(info, 24, q.device, gen(3))
    ref = reference_skyformer_attention(q, k, v, landmarks, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_causal_with_a_landmark_at_every_position_and_no_ridge_is_exact(scale):
    """Every token a landmark (query and key slots alike, stride 1) and gamma -> 0: the
    far past is reproduced exactly, so causal Skyformer equals exact causal kernelized
    attention (up to the ridge's effect, here 1e-9)."""
    from skyformer.ops.kernelized.naive import reference_kernelized_attention

    q, k, v = make_qkv(1, 2, 40, 6, scale=2.0)
    k = q  # landmarks drawn from queries then span the keys too
    out = skyformer_attention(q, k, v, num_features=40, landmark_stride=1, gamma=1e-9,
                              causal=True, causal_local=False, generator=gen(0), scale=scale)
    ref = reference_kernelized_attention(q, k, v, causal=True, scale=scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
