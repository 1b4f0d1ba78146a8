"""Exact kernelized attention's flash-style Triton kernels (``kernel="triton"``) against
the naive pairwise reference: on the CPU through Triton's interpreter (float64 exactly,
half types to their rounding), on CUDA with ``SKYFORMER_TEST_CUDA=1``.

Odd sizes (N not a multiple of a block, one key, head dims 16..128, Dv != D), padding,
causal masks, cross-attention, grouped keys, strided inputs, ``torch.func``.
"""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer import kernelized_attention
from skyformer.ops.kernelized.naive import reference_kernelized_attention
from tests.conftest import edge_padding, gen, make_qkv
from tests.devices import cuda_only, devices, relative_error
from tests.dispatch import Recorder

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
triton_flash = pytest.importorskip("skyformer.ops.kernelized.triton_flash")

CASES = [  # b, h, nq, nk, d, dv
    (2, 2, 37, 45, 16, 24),
    (1, 3, 70, 70, 40, 8),
    (2, 1, 33, 1, 128, 16),
    (1, 1, 130, 97, 64, 64),
]


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("device", "cpu") == "cpu":
        request.getfixturevalue("triton_interpreter")


def _grads(out: torch.Tensor, leaves) -> list[torch.Tensor]:
    weights = torch.randn(out.shape, generator=gen(9), dtype=torch.float64).to(out)
    return list(torch.autograd.grad((out * weights).sum(), leaves))


def _errors(q, k, v, mask, causal, dtype, device) -> dict[str, float]:
    """The flash kernels' output and input gradients in ``dtype`` on ``device``: their
    relative errors against the pairwise reference in float64 on the same (rounded)
    inputs, by name; NaN for a result in the wrong dtype or on the wrong device."""
    leaves = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*leaves, key_padding_mask=mask, causal=causal, kernel="triton")
    exact = [t.to(device, dtype).double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_kernelized_attention(*exact, key_padding_mask=mask, causal=causal)
    got, want = [out, *_grads(out, leaves)], [ref, *_grads(ref, exact)]
    where = torch.device(device).type
    return {name: relative_error(a, e) if a.dtype == dtype and a.device.type == where
            else float("nan")
            for name, a, e in zip(["out", "dq", "dk", "dv"], got, want, strict=True)}


FORMS = ["plain", "padded", "causal", "padded causal"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("case", "form"), [(case, form) for case in CASES for form in FORMS
                                            if "causal" not in form or case[2] == case[3]])
def test_flash_kernels_equal_the_naive_reference(device, case, form):
    b, h, nq, nk, d, dv = case
    causal = "causal" in form
    q, k, v = make_qkv(b, h, nq, d, nk=nk, dv=dv, seed=nq + d, scale=0.7)
    mask = edge_padding(b, nk, device) if "padded" in form else None
    dtype, tolerance = ((torch.float64, 1e-12) if device == "cpu"
                        else (torch.float32, 1e-5))  # float64 on CUDA takes SDPA
    errors = _errors(q, k, v, mask, causal, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_kernels_in_float32_and_half_types(device, dtype, causal):
    """In the inputs' dtype, to its rounding: float32 ~1e-7, the weights rounded to the
    half type before their products (as flash attention rounds softmax's)."""
    q, k, v = make_qkv(2, 2, 66, 64, seed=4)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    errors = _errors(q, k, v, edge_padding(2, 66, device), causal, dtype, device)
    assert all(error < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("device", devices())
def test_the_sdpa_augmentation_and_the_flash_kernels_agree(device):
    """The two exact paths, padded self-attention with padded query rows zeroed."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = (t.to(device, dtype) for t in make_qkv(2, 2, 50, 32, seed=6))
    mask = edge_padding(2, 50, device)
    out = [kernelized_attention(q, k, v, key_padding_mask=mask, kernel=kernel)
           for kernel in ("torch", "triton")]
    assert relative_error(out[1], out[0]) < (1e-12 if dtype == torch.float64 else 1e-5)
    assert (out[1][0, :, -12:] == 0).all()  # padded queries of batch 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_type_gradients_where_queries_and_keys_share_a_large_offset(device, dtype):
    """C depends on q - k only, so a common offset changes nothing exact; the gradients'
    two terms (dS K and (dS 1) q) then cancel almost completely, which stays exact only
    if both are formed from the same rounded dS (with unrounded sums the bfloat16 dq
    error grew to 9e-2 at offset 10; now 2.8e-3, and 3.6e-4 in float16)."""
    q, k, v = make_qkv(1, 2, 64, 64, seed=14)
    offset = 10.0 + torch.randn(64, generator=gen(15), dtype=torch.float64)
    q, k = offset + 0.3 * q, offset + 0.3 * k
    errors = _errors(q, k, v, None, False, dtype, device)
    tolerance = {torch.bfloat16: 5e-3, torch.float16: 1e-3}[dtype]
    assert all(error < tolerance for error in errors.values()), errors


@pytest.mark.parametrize("device", devices())
def test_strided_and_expanded_inputs(device):
    """[B, N, H, D] tensors seen as [B, H, N, D] and keys and values expanded over the
    heads (stride 0, as grouped-query attention without a copy): the outputs and
    gradients of the same values made contiguous."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = (t.to(device, dtype) for t in make_qkv(2, 4, 40, 16, seed=8))
    q_bnhd = q.transpose(1, 2).contiguous().transpose(1, 2)
    k1, v1 = k[:, :1].clone(), v[:, :1].clone()

    def run(q, k1, v1, expand):
        leaves = [q.clone().requires_grad_(True), k1.clone().requires_grad_(True),
                  v1.clone().requires_grad_(True)]
        kk, vv = ((leaves[1].expand(2, 4, 40, 16), leaves[2].expand(2, 4, 40, 16))
                  if expand else (leaves[1].repeat(1, 4, 1, 1), leaves[2].repeat(1, 4, 1, 1)))
        if expand:
            assert kk.stride(1) == 0
        out = kernelized_attention(leaves[0] if expand else leaves[0].contiguous(), kk, vv,
                                   kernel="triton")
        return [out, *_grads(out, leaves)]

    assert not q_bnhd.is_contiguous()
    for a, e in zip(run(q_bnhd, k1, v1, True), run(q, k1, v1, False), strict=True):
        torch.testing.assert_close(a, e)


def test_per_sample_gradients_through_the_flash_kernels():
    """``vmap(grad)`` folds the mapped dim into the batch (the mask's with it)."""
    q, k, v = make_qkv(3, 1, 20, 8, seed=10)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, 15:] = False

    def per_sample(attention):
        def loss(q, k, v, mask):
            return attention(q[None], k[None], v[None], key_padding_mask=mask[None]
                             ).square().sum()
        return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)

    flash = per_sample(lambda *qkv, **mask: kernelized_attention(*qkv, **mask, kernel="triton"))
    for a, e in zip(flash, per_sample(reference_kernelized_attention), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_an_attn_mask_is_refused_with_the_way_out():
    q, k, v = make_qkv(1, 1, 8, 16)
    with pytest.raises(ValueError, match='kernel="torch"'):
        skyformer.scaled_dot_product_attention(q, k, v, method="kernelized", kernel="triton",
                                               attn_mask=torch.ones(8, 8, dtype=torch.bool))
    # is_causal with fewer queries than keys reaches the method as a mask: the sentence
    # names is_causal, which the caller passed, and not only attn_mask
    with pytest.raises(ValueError, match=r"nor is_causal with Nq != Nk .* kernel=\"torch\""):
        skyformer.scaled_dot_product_attention(q[:, :, :5], k, v, method="kernelized",
                                               kernel="triton", is_causal=True)


def _padding_masks(row: torch.Tensor, nq: int) -> dict[str, torch.Tensor]:
    """A key padding row ``[B, Nk]`` in the attn_mask forms that hold one row over the
    keys for every query and head."""
    b, nk = row.shape
    return {"[B, 1, 1, Nk]": row[:, None, None, :],
            "[B, 1, Nq, Nk], stride 0": row[:, None, None, :].expand(b, 1, nq, nk),
            "[B, H, 1, Nk], stride 0": row[:, None, None, :].expand(b, 2, 1, nk),
            "[Nk]": row[0],
            "[1, 1, 1, Nk]": row[:1, None, None, :]}


def _flash_calls() -> Recorder:
    return Recorder(lambda func, args, out: func.name() if "gaussian_flash" in func.name()
                    else None)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", list(_padding_masks(torch.ones(2, 3, dtype=torch.bool), 4)))
@pytest.mark.parametrize("pattern", ["full", "causal", "cross"])
def test_a_padding_attn_mask_runs_on_the_flash_kernels(device, form, pattern):
    """A boolean attn_mask that is one row over the keys for every query and head (a
    padding mask, as skyformer.hf builds it) is the flash kernels' key padding, joined
    with key_padding_mask: the flash operators run, with the SDPA augmentation's outputs
    and gradients under the same masks (self-attention, causal, and 29 queries against
    40 keys)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    nq = 29 if pattern == "cross" else 40
    causal = pattern == "causal"
    q, k, v = (t.to(device, dtype) for t in make_qkv(2, 2, 40, 16, dv=24, seed=16))
    q = q[:, :, :nq]
    row = torch.ones(2, 40, dtype=torch.bool, device=device)
    row[0, 5:9], row[1, -7:] = False, False
    attn_mask = _padding_masks(row, nq)[form]
    padding = edge_padding(2, 40, device)

    def run(kernel):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = kernelized_attention(*leaves, key_padding_mask=padding, attn_mask=attn_mask,
                                   causal=causal, kernel=kernel)
        return [out, *_grads(out, leaves)]

    with _flash_calls() as calls:
        flash = run("triton")
    assert "skyformer::gaussian_flash_forward" in calls.items
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for name, a, e in zip(["out", "dq", "dk", "dv"], flash, run("torch"), strict=True):
        assert relative_error(a, e) < tolerance, name


@pytest.mark.parametrize("form", ["float", "a row per query", "a row per head"])
def test_auto_leaves_other_attn_masks_to_the_sdpa_routes(monkeypatch, form):
    """With the flash kernels available (here under the interpreter), kernel="auto"
    takes them for a padding attn_mask and leaves any other to the SDPA routes, and
    kernel="triton" refuses it with the way out."""
    from skyformer.ops.kernelized import kernelized

    monkeypatch.setattr(kernelized, "use_triton", lambda kernel, q, half=False:
                        kernel != "torch")
    q, k, v = make_qkv(2, 2, 12, 8, seed=17)
    row = torch.ones(2, 12, dtype=torch.bool)
    row[1, -3:] = False
    masks = {"padding": row[:, None, None, :],
             "float": torch.zeros(2, 1, 1, 12, dtype=torch.float64).masked_fill(
                 ~row[:, None, None, :], float("-inf")),
             "a row per query": row[:, None, None, :].expand(2, 1, 12, 12).clone(),
             "a row per head": row[:, None, None, :].expand(2, 2, 1, 12).clone()}
    for name in ("padding", form):
        with _flash_calls() as calls:
            out = kernelized_attention(q, k, v, attn_mask=masks[name], kernel="auto")
        assert bool(calls.items) == (name == "padding"), name
        reference = kernelized_attention(q, k, v, attn_mask=masks[name], kernel="torch")
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r'boolean row over the keys.*kernel="torch"'):
        kernelized_attention(q, k, v, attn_mask=masks[form], kernel="triton")


def test_a_repeat_by_stride_0_is_not_read_as_one_row_in_a_recorded_program(monkeypatch):
    """Where strides do not hold (torch.export, make_fx), a mask repeated by stride 0
    is not taken for one row (the program would read one row of any later mask); a
    mask of size 1 over the queries and heads still is."""
    from skyformer.ops.shared import masked

    row = torch.ones(2, 6, dtype=torch.bool)
    row[1, :2] = False
    shape = (2, 2, 5, 6)
    masks = _padding_masks(row, 5)
    for name, mask in masks.items():
        assert torch.equal(masked.shared_key_row(mask, shape), row if name.startswith("[B")
                           else row[:1].expand(2, 6)), name
    monkeypatch.setattr(masked, "strides_hold", lambda: False)
    for name, mask in masks.items():
        got = masked.shared_key_row(mask, shape)
        assert (got is None) == ("stride 0" in name), name


@cuda_only
def test_float64_on_cuda_takes_the_sdpa_augmentation():
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 30, 16))
    with Recorder(lambda func, args, out: func.name()) as calls:
        out = kernelized_attention(q, k, v, kernel="triton")
    assert "skyformer::gaussian_flash_forward" not in calls.items
    torch.testing.assert_close(out, reference_kernelized_attention(q, k, v))


def test_torch_compile_calls_the_flash_operators():
    """``torch.compile(fullgraph=True)`` traces the method around the custom operators
    (forward and backward): the eager results."""
    q, k, v = (t.float() for t in make_qkv(2, 2, 24, 16, seed=12))
    mask = edge_padding(2, 24, "cpu")

    def attention(q, k, v):
        return kernelized_attention(q, k, v, key_padding_mask=mask, causal=True,
                                    kernel="triton")

    from skyformer.ops.kernelized import triton_flash

    launches = []

    def counted(name):
        original = getattr(triton_flash, name)

        def run(*args, **kwargs):
            launches.append(name)
            return original(*args, **kwargs)
        return run

    results = []
    for fn in (attention, torch.compile(attention, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        launches.clear()
        with pytest.MonkeyPatch.context() as patch:
            for name in ("flash_forward", "flash_backward"):
                patch.setattr(triton_flash, name, counted(name))
            out = fn(*leaves)
            results.append([out, *_grads(out, leaves)])
        assert launches == ["flash_forward", "flash_backward"]  # the kernels, compiled too
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


def test_only_the_gradients_asked_for_are_computed():
    """Keys and values frozen: the key kernel is not launched, dq is the full
    backward's; queries frozen: only dk and dv."""
    from skyformer.ops.kernelized import triton_flash

    q, k, v = make_qkv(1, 2, 30, 16, seed=13)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernelized_attention(*full, kernel="triton")
    expected = _grads(out, full)
    launched = []
    original = triton_flash.flash_tiles

    def recording(dtype, head_dim, kind, *rest):
        launched.append(kind)
        return original(dtype, head_dim, kind, *rest)

    for frozen, kind in (((1, 2), "queries"), ((0,), "keys")):
        leaves = [t.clone().requires_grad_(i not in frozen) for i, t in enumerate((q, k, v))]
        out = kernelized_attention(*leaves, kernel="triton")
        launched.clear()
        triton_flash.flash_tiles = recording
        try:
            grads = _grads(out, [t for t in leaves if t.requires_grad])
        finally:
            triton_flash.flash_tiles = original
        assert launched == [kind]
        wanted = [g for i, g in enumerate(expected) if i not in frozen]
        for a, e in zip(grads, wanted, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_float64_keeps_its_blocks_on_every_gpu_generation():
    """The blocks for other GPU generations (``_BY_FAMILY``) were chosen for float32 and
    half types; float64 (the interpreter's exact dtype: ``triton_resources.py --arch``
    records with it) keeps its own, as the products' float64 tiles do."""
    from skyformer.ops.kernelized import triton_flash

    for kind in ("forward", "keys", "queries"):
        for head_dim in (16, 32, 64):
            for capability in ((8, 0), (7, 5)):
                assert triton_flash.flash_tiles(torch.float64, head_dim, kind,
                                                capability) == \
                    triton_flash.flash_tiles(torch.float64, head_dim, kind)
    assert triton_flash.flash_tiles(torch.float32, 32, "keys", (8, 0)) != \
        triton_flash.flash_tiles(torch.float32, 32, "keys")


@pytest.mark.parametrize("causal", [False, True])
def test_more_sequences_than_a_cuda_grid_holds_go_in_slices(monkeypatch, causal):
    """A CUDA grid holds at most 65535 blocks along its third dimension, where the flash
    kernels put the batch index: a call with more sequences (reached by ``kernel="auto"``
    on CUDA, or a ``vmap`` folded into the batch) is launched in slices (here with the
    limit lowered to 2 for 5 sequences), with the same results."""
    from skyformer.linalg import triton_kernels
    from skyformer.ops.kernelized import triton_flash

    q, k, v = make_qkv(5, 2, 20, 16, seed=14)
    mask = torch.ones(5, 20, dtype=torch.bool)
    mask[1, 15:], mask[4, :3] = False, False

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = kernelized_attention(*leaves, key_padding_mask=mask, causal=causal,
                                   kernel="triton")
        return [out, *_grads(out, leaves)]

    expected = run()
    grids = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(triton_kernels, "MAX_GRID_YZ", 2)
    for name in ("_flash_forward_kernel", "_flash_key_grad_kernel", "_flash_query_grad_kernel"):
        monkeypatch.setattr(triton_flash, name, Recording(getattr(triton_flash, name)))
    for a, e in zip(run(), expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert len(grids) == 9 and max(grid[2] for grid in grids) == 2  # 3 slices a kernel



@triton.jit
def _second_matrix_offsets(OUT, n, width, BLOCK: tl.constexpr):
    """``triton_flash._matrix_offsets`` of rows 0..BLOCK-1 of matrix bh = 1 (int64, as
    the kernels' bh) into ``OUT [BLOCK, BLOCK]``."""
    bh = tl.program_id(0).to(tl.int64) + 1
    rows = tl.arange(0, BLOCK)
    offsets, _ = triton_flash._matrix_offsets(bh, rows, n, width, BLOCK)
    tl.store(OUT + rows[:, None] * BLOCK + rows[None, :], offsets)


def test_offsets_of_a_head_past_2_31_entries_are_int64(triton_interpreter):
    """The gradient kernels read dO as matrix bh of a contiguous ``[BH, Nq, Dv]``: from
    one head of 2^31 entries (Nq = 2^25 queries of width 64) the offset of the second
    head, bh Nq Dv = 2^31, passes int32 (here the offsets alone, computed by the
    kernels' own function: the tensors would take 8 GiB)."""
    out = torch.zeros(16, 16, dtype=torch.int64)
    _second_matrix_offsets[(1,)](out, 2**25, 64, BLOCK=16)
    rows, cols = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    assert torch.equal(out, 2**31 + rows * 64 + cols)


def test_the_blocks_follow_the_wider_of_the_key_and_value_dims():
    """A narrow head dim with wide values (D = 4, Dv = 160): the forward and both
    gradient kernels hold a block of value rows each, so their blocks are chosen for 160
    (float32 past 128 takes the smallest), not for 4."""
    from skyformer.ops.kernelized import triton_flash

    q, k, _ = make_qkv(1, 1, 20, 4, seed=3)
    v = torch.randn(1, 1, 20, 160, dtype=torch.float64)
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    widths = []
    original = triton_flash.flash_tiles

    def recording(dtype, head_dim, kind, *rest):
        widths.append((kind, head_dim))
        return original(dtype, head_dim, kind, *rest)

    triton_flash.flash_tiles = recording
    try:
        out = kernelized_attention(*leaves, kernel="triton")
        _grads(out, leaves)
    finally:
        triton_flash.flash_tiles = original
    assert sorted(widths) == [("forward", 160), ("keys", 160), ("queries", 160)]
