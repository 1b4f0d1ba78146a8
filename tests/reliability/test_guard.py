"""``show_nonfinite`` against its plain definition, on the CPU shortcut and on the path
CUDA calls take (every tensor checked row by row).

The rows that must be NaN: a real query row holding NaN or inf, and every real query
row of a (batch element, head) whose real keys or values hold one (grouped query heads:
any key head of the batch element); padded rows are zeros by then (``zero_padding``).
Every other row is returned unchanged.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyformer.registry import guard
from tests.dispatch import Recorder


def _expected_rows(q, k, v, query_valid, causal=False):
    """[B, H, Nq] bool: the rows the guard must mark, by the definition above (causal:
    row i by the keys and values j <= i)."""
    bad = ~torch.isfinite(q).all(-1)
    per_key = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [B, Hk, Nk]
    spoiled = per_key.cummax(-1).values if causal else per_key.any(-1, keepdim=True)
    if spoiled.shape[1] != q.shape[1]:
        spoiled = spoiled.any(1, keepdim=True)
    spread = spoiled.expand_as(bad)
    if query_valid is not None:
        spread = spread & query_valid[:, None, :]
    return bad | spread


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), grouped=st.booleans(), padded=st.booleans(),
       cpu_shortcut=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       causal=st.booleans())
def test_marks_exactly_the_rows_a_non_finite_input_reaches(seed, grouped, padded,
                                                          cpu_shortcut, dtype, causal):
    g = torch.Generator().manual_seed(seed)
    b, h, hk, n, d = 2, 4, (2 if grouped else 4), 6, 3
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, n, d, generator=g).to(dtype) for _ in range(2))
    for t in (q, k, v):  # a few entries NaN, inf or -inf (maybe none)
        hits = torch.rand(t.shape, generator=g) < 0.02
        values = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        t[hits] = values[torch.randint(0, 3, (int(hits.sum()),), generator=g)]
    mask = torch.rand(b, n, generator=g) > 0.3 if padded else None
    q, k, v = guard.zero_padding(q, k, v, mask, "auto")  # as the guard receives them
    out = 1e30 * torch.randn(b, h, n, d, generator=g).to(dtype)  # huge but finite
    given = out.clone()  # the flag may be added into out in place (no gradient)
    with mock.patch.object(guard, "may_read_values", lambda *_: cpu_shortcut):
        got = guard.show_nonfinite(out, q, k, v, mask, "auto", causal=causal)
    rows = _expected_rows(q, k, v, mask, causal)
    assert torch.isnan(got[rows]).all()
    assert torch.equal(got[~rows], given[~rows])
    assert got.dtype == out.dtype


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer", "nystrom_softmax",
                                    "linear", "performer"])
def test_a_causal_call_marks_only_the_rows_that_see_the_bad_key(method):
    """As SDPA with is_causal: a NaN key at j spoils rows j, j+1, ..., not the earlier
    rows, which cannot see it; a NaN query only its own row; an inf value every row of
    its head (0 x inf in the products; in these 16 tokens one chunk holds them all)."""
    import torch.nn.functional as F

    import skyformer

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 0, 10, 0] = float("nan")
    v[0, 1, 12, 2] = float("inf")
    q[0, 1, 3, 1] = float("nan")
    out = skyformer.attention(q, k, v, method, causal=True, generator=skyformer.random_key(0))
    want = ~F.scaled_dot_product_attention(q, k, v, is_causal=True).isfinite().all(-1)
    assert torch.equal(~out.isfinite().all(-1), want)  # SDPA: inf or NaN rows
    assert want[0, 0].tolist() == [False] * 10 + [True] * 6


@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer", "nystrom_softmax",
                                    "linear", "performer"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_causal_call_marks_the_rows_docs_reliability_names_for_a_bad_value(method, bad):
    """docs/reliability.md: a non-finite value at j spoils every row of its head in the
    exact methods (as SDPA), the rows from the start of j's chunk on in the chunked
    linear-time forms, never a row of another head; a bad key at j the rows from j on."""
    import skyformer
    from skyformer.ops.shared.causal_prefix import CAUSAL_CHUNK

    n, j = 3 * CAUSAL_CHUNK, 2 * CAUSAL_CHUNK + 20
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    v[0, 0, j, 3] = float(bad)
    k[0, 1, j, 1] = float(bad)
    out = skyformer.attention(q, k, v, method, causal=True, generator=skyformer.random_key(0))
    spoiled = ~out.isfinite().all(-1)[0]
    first = 0 if method in ("softmax", "kernelized") else j - j % CAUSAL_CHUNK
    assert spoiled[0].tolist() == [False] * first + [True] * (n - first)
    assert spoiled[1].tolist() == [False] * j + [True] * (n - j)


# every row of a 12-token sequence a landmark (num_features >= 2N), or in k-means
LANDMARKS_FROM_QUERIES = {"skyformer": {}, "nystrom_softmax": {},
                          "nystromformer": {"num_features": 4}, "skyformer_adaptive": {},
                          "skyformer_multipole": {}, "softmax_multipole": {}}


@pytest.mark.parametrize("method", sorted(LANDMARKS_FROM_QUERIES))
def test_a_nan_query_among_the_landmarks_spoils_every_row_of_its_head(method):
    """docs/reliability.md: where landmarks are built from the queries, a NaN query
    spoils every row they reach, whatever the method's own arithmetic would make of it:
    here every row of its head (the other head and batch element are unchanged).
    ``nystrom_softmax``'s rows fell back to mean(V) in silence (a NaN normaliser was
    taken for an unreliable one), ``softmax_multipole``'s to zero (taken for rows
    without a real key)."""
    import skyformer

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bad = q.clone()
    bad[0, 1, 5, 2] = float("nan")
    options = LANDMARKS_FROM_QUERIES[method]
    out, base = (skyformer.attention(x, k, v, method, generator=skyformer.random_key(0),
                                     **options) for x in (bad, q))
    assert out[0, 1].isnan().all()
    torch.testing.assert_close(out[0, 0], base[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["softmax", "skyformer", "performer", "bigbird"])
@pytest.mark.parametrize("which", ["key_padding_mask", "query_padding_mask"])
def test_a_padding_mask_on_another_device_gets_the_methods_sentence(method, which):
    """A mask on another device than q, k, v (the meta device standing in for a GPU):
    the padding was zeroed with torch.where before the method's checks, which failed
    with torch's 'Tensor on device cpu is not on the expected device meta!'."""
    import skyformer

    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    real = torch.ones(1, 6, dtype=torch.bool)
    masks = {"key_padding_mask": real, "query_padding_mask": real, which: real.to("meta")}
    with pytest.raises(ValueError, match=rf"{which} is on meta but the inputs are on cpu; "
                                         rf"pass {which}.to\('cpu'\)"):
        skyformer.attention(q, k, v, method, **masks)


def test_the_cuda_path_adds_no_operation_to_the_backward_pass():
    """The check's flags are detached and added to the output: autograd passes the
    gradient straight through (no ``where`` in backward), and finite inputs give the
    output unchanged."""
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    out = torch.randn(1, 2, 5, 4, requires_grad=True)
    with mock.patch.object(guard, "may_read_values", lambda *_: False):
        got = guard.show_nonfinite(out, q, k, v, None, "auto")
    assert torch.equal(got, out)
    with Recorder(lambda func, args, result: func.name()) as calls:
        got.sum().backward()
    assert not any("where" in name or "mul" in name for name in calls.items)
    torch.testing.assert_close(out.grad, torch.ones_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_finite_inputs_are_not_marked(dtype):
    """Finite inputs are never marked by the check itself, on the path CUDA calls take:
    entries at the top of the dtype's range (float32 / bfloat16: 1e30, whose squares
    overflow; float16: 6e4) over a head of 1024 x 64 keys and values, whose sum is far
    past float16's range."""
    big = 6e4 if dtype == torch.float16 else 1e30
    q, k, v = (torch.full((1, 2, 1024, 64), big, dtype=dtype) for _ in range(3))
    q[0, 0, 1] = -big
    out = torch.randn(1, 2, 1024, 64).to(dtype)
    with mock.patch.object(guard, "may_read_values", lambda *_: False):
        assert torch.equal(guard.show_nonfinite(out, q, k, v, None, "auto"), out)


@pytest.mark.parametrize("shape", [(1, 2, 3), (2, 2, 5, 4, 1)])
def test_other_shapes_are_returned_as_they_are(shape):
    t = torch.randn(shape)
    assert guard.show_nonfinite(t, t, t, t, None, "auto") is t


@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_cuda_path_is_three_sums_and_one_multiplication(requires_grad):
    """Each of q, k, v is read once (a sum each); the sums a row can reach are added
    and multiplied by 0 once (each sum had its own multiplication), then the flag is
    added to the output: in place where no autograd graph holds it."""
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    out = torch.randn(1, 2, 5, 4, requires_grad=requires_grad)
    with mock.patch.object(guard, "may_read_values", lambda *_: False), \
            mock.patch.object(guard, "overwrite_in_eager", lambda: True), \
            Recorder(lambda func, args, result: func.overloadpacket.__name__) as calls:
        guard.show_nonfinite(out, q, k, v, None, "auto", owned=True)
    ops = [name for name in calls.items if name not in ("promote_types", "detach", "unsqueeze")]
    last = "add" if requires_grad else "add_"  # (as outside the Recorder's dispatch mode)
    assert sorted(ops) == sorted(["add", "add", last, "mul", "sum", "sum", "sum"])


def test_the_flag_goes_into_the_output_in_place_only_where_nothing_else_sees_it():
    """In place for a library method's plain contiguous output that no autograd graph
    holds (inference: no second tensor of the output's size; a reshaped new tensor
    too); out of place for one that needs a gradient, a non-contiguous tensor, one
    sharing memory with an input (a view of it too) or the output of a method
    registered from outside the library, which stay as given."""
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    q[0, 1, 2, 0] = float("nan")

    def check(out, owned=True):
        with mock.patch.object(guard, "may_read_values", lambda *_: False):
            return guard.show_nonfinite(out, q, k, v, None, "auto", owned=owned)

    for plain in (torch.randn(1, 2, 5, 4), torch.randn(2, 5, 4).reshape(1, 2, 5, 4)):
        assert check(plain) is plain and plain[0, 1, 2].isnan().all()
    plain = torch.randn(1, 2, 5, 4)
    assert check(plain, owned=False) is not plain and not plain.isnan().any()
    for out in (torch.randn(1, 2, 5, 4, requires_grad=True),
                torch.randn(1, 2, 5, 8)[..., :4],  # a slice
                torch.empty_strided((1, 2, 5, 4), (40, 20, 1, 5)).normal_(),  # not a view
                v, v.reshape(1, 2, 5, 4)):  # the input itself, a view of it
        given = out.detach().clone()
        got = check(out)
        assert got is not out and got[0, 1, 2].isnan().all()
        assert torch.equal(out.detach(), given)


@pytest.mark.parametrize("method", ["linear", "softmax"])
def test_selective_checkpointing_that_keeps_every_output_sees_no_output_changed(method):
    """Frozen q, k, v and a trained layer after the attention: the output needs no
    gradient, but selective checkpointing (a dispatch mode) keeps it to hand back in
    its recomputation, so the flag is not added into it in place. (Methods with fused
    in-place workspaces refuse a policy that keeps every output: docs/pytorch2.md.)"""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    import skyformer

    q, k, v = (torch.randn(2, 2, 32, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))
    key = skyformer.random_key(3)

    def block(q, k, v):
        return skyformer.attention(q, k, v, method, generator=key) @ w

    def keep_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    with mock.patch.object(guard, "may_read_values", lambda *_: False):  # as on CUDA
        want = torch.autograd.grad(block(q, k, v).square().sum(), w)[0]
        out = checkpoint(block, q, k, v, use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(keep_all))
        got = torch.autograd.grad(out.square().sum(), w)[0]
    torch.testing.assert_close(got, want)
