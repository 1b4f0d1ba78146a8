"""The chunked kernel-block product against the materialised block and autograd."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import gaussian_kernel_block, gaussian_kernel_matmul, half_sq_norm
from tests.conftest import gen

B, H, N, M, D, R = 2, 3, 37, 9, 5, 4


def inputs(seed=0):
    g = gen(seed)
    y = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    x = torch.randn(B, H, M, D, generator=g, dtype=torch.float64) * 0.7
    z = torch.randn(B, H, M, R, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, R, generator=g, dtype=torch.float64)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, 30:] = False
    valid[1, :4] = False
    return [t.requires_grad_(True) for t in (y, x, z, v)] + [valid]


def col_offset(x):
    b = half_sq_norm(x)
    return torch.where(torch.arange(M) == 2, float("inf"), b)  # column 2: a dead landmark


def materialised(y, x, rhs, scale, row_norm, valid, transpose, shift_rows):
    """The same product from the whole block, differentiated by autograd."""
    ys = y * scale
    a = half_sq_norm(ys) if row_norm else torch.zeros_like(ys[..., 0])
    if valid is not None:
        a = torch.where(valid[:, None, :], a, float("inf"))
    c = gaussian_kernel_block(ys, x, a, col_offset(x), shift_rows=shift_rows)
    return c.transpose(-1, -2) @ rhs if transpose else c @ rhs


@pytest.mark.parametrize("transpose,shift_rows", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("row_norm", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [4, 64])  # several chunks with a ragged last one; one chunk
def test_matches_materialised_block_outputs_and_gradients(
    transpose, shift_rows, row_norm, masked, chunk
):
    y, x, z, v, valid = inputs()
    valid = valid if masked else None
    rhs = v if transpose else z
    scale = 0.6
    out = gaussian_kernel_matmul(
        y, x, rhs, col_offset(x), scale=scale, row_norm=row_norm,
        row_valid=None if valid is None else valid[:, None, :], transpose=transpose,
        shift_rows=shift_rows, chunk=chunk,
    )
    ref = materialised(y, x, rhs, scale, row_norm, valid, transpose, shift_rows)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    g = torch.randn(out.shape, generator=gen(1), dtype=out.dtype)
    fast_grads = torch.autograd.grad((out * g).sum(), (y, x, rhs))
    ref_grads = torch.autograd.grad((ref * g).sum(), (y, x, rhs))
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    if valid is not None and not transpose:
        assert torch.all(out[0, :, 30:] == 0)


@pytest.mark.parametrize("transpose", [False, True])
def test_gradcheck_including_column_offsets(transpose):
    g = gen(3)
    y = torch.randn(1, 2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    rhs = torch.randn(1, 2, 11 if transpose else 4, 2, generator=g, dtype=torch.float64,
                      requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda y, x, b, r: gaussian_kernel_matmul(
            y, x, r, b, scale=0.8, transpose=transpose, chunk=3
        ),
        (y, x, b, rhs),
    )


def test_fully_masked_rows_and_dead_columns_are_zero_without_nan():
    y, x, z, _, _ = inputs()
    b = torch.full((B, H, M), float("inf"), dtype=torch.float64)
    out = gaussian_kernel_matmul(y, x, z, b, shift_rows=True, chunk=5)
    assert torch.all(out == 0)
    out.sum().backward()
    assert torch.all(y.grad == 0) and torch.isfinite(x.grad).all()


def test_rejects_mismatched_shapes():
    y, x, _, v, _ = inputs()
    with pytest.raises(ValueError, match="shapes do not fit"):
        gaussian_kernel_matmul(y, x, v, None)  # C @ rhs needs rhs with m rows
    with pytest.raises(ValueError, match="shift_rows"):
        gaussian_kernel_matmul(y, x, v, None, transpose=True, shift_rows=True)
    z = torch.zeros(*x.shape[:-1], 3, dtype=x.dtype)
    for offset in (torch.zeros(y.shape[-2] + 1, dtype=y.dtype),  # not one a row
                   torch.zeros(*y.shape[:-1], dtype=torch.long)):  # not a float
        with pytest.raises(ValueError, match="row_offset must be a float tensor of one "
                           "offset a row of y, broadcastable to"):
            gaussian_kernel_matmul(y, x, z, None, row_offset=offset)


def test_a_tensor_on_another_device_is_named_before_any_kernel_runs():
    """On a GPU, Triton's "cannot be accessed from Triton (cpu tensor?)" for a tensor
    left on the CPU was taken under "auto" for the kernel's own failure: every later
    call on that device then took the PyTorch path."""
    y, x, z, _, _ = inputs()
    offsets = torch.zeros(*x.shape[:-1], dtype=x.dtype, device="meta")
    with pytest.raises(ValueError, match=r"^gaussian_kernel_matmul: col_offset is on meta but "
                                         r"the inputs are on cpu; pass col_offset.to\('cpu'\)\.$"):
        gaussian_kernel_matmul(y, x, z, offsets)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("transpose", [False, True])
def test_rejects_rows_of_none_in_a_sentence(kernel, transpose):
    """y with no rows: a sentence, not an error from inside a path."""
    y, x = torch.randn(1, 0, 4), torch.randn(1, 3, 4)
    rhs = torch.randn(1, 0 if transpose else 3, 2)
    with pytest.raises(ValueError, match=r"empty input.*no rows"):
        gaussian_kernel_matmul(y, x, rhs, None, kernel=kernel, transpose=transpose)


@pytest.mark.parametrize("transpose,shift_rows", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("chunk", [4, 64])
def test_excluded_entries_are_zero_with_zero_gradient(transpose, shift_rows, chunk):
    """``exclude`` (here a transposed [m, N] mask, as the multipole far field passes it)
    equals the materialised block with those entries zeroed, outputs and gradients."""
    y, x, z, v, valid = inputs(4)
    rhs = v if transpose else z
    drop = torch.rand(B, H, M, N, generator=gen(5)) < 0.3
    drop[0, 0, :, 7] = True  # a row with every entry excluded
    exclude = drop.transpose(-1, -2)  # [B, H, N, M], not contiguous
    out = gaussian_kernel_matmul(
        y, x, rhs, col_offset(x), scale=0.6, row_valid=valid[:, None, :], transpose=transpose,
        shift_rows=shift_rows, chunk=chunk, exclude=exclude,
    )
    ys = y * 0.6
    a = torch.where(valid[:, None, :], half_sq_norm(ys), float("inf"))
    e = ys @ x.transpose(-1, -2) - a[..., None] - col_offset(x)[..., None, :]
    e = e.masked_fill(exclude, float("-inf"))
    if shift_rows:
        top = e.detach().amax(-1, keepdim=True)
        e = e - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    c = e.exp()
    ref = c.transpose(-1, -2) @ rhs if transpose else c @ rhs
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    g = torch.randn(out.shape, generator=gen(1), dtype=out.dtype)
    for a_, b_ in zip(torch.autograd.grad((out * g).sum(), (y, x, rhs)),
                      torch.autograd.grad((ref * g).sum(), (y, x, rhs)), strict=True):
        torch.testing.assert_close(a_, b_, rtol=1e-11, atol=1e-12)
    if not transpose:
        assert torch.all(out[0, 0, 7] == 0)


def test_rejects_an_exclude_mask_of_the_wrong_shape():
    y, x, z, _, _ = inputs()
    with pytest.raises(ValueError, match="exclude"):
        gaussian_kernel_matmul(y, x, z, None, exclude=torch.zeros(B, H, M, N, dtype=torch.bool))


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_a_chunk_that_is_not_a_positive_row_count_is_named(chunk):
    """``chunk`` counts rows: 0 stopped with Python's "range() arg 3 must not be zero",
    a negative count or a float with torch's words about tensor sizes."""
    y, x, z, _, _ = inputs()
    with pytest.raises(ValueError, match=rf"gaussian_kernel_matmul: chunk must be a "
                                         rf"positive integer, got {chunk}\."):
        gaussian_kernel_matmul(y, x, z, None, chunk=chunk)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("chunk", [None, 8])
def test_compiled_product_gives_eager_outputs_and_gradients(transpose, chunk):
    """Traced by torch.compile, one chunk or several: Dynamo 2.11 traced the in-place
    accumulation of C^T V across chunks so that every gradient was wrong."""
    g = gen(5)
    y = torch.randn(2, 21, 8, generator=g, dtype=torch.float64)
    x = 0.3 * torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    rhs = torch.randn(2, 21 if transpose else 6, 5, generator=g, dtype=torch.float64)

    def product(y, x, rhs):
        return gaussian_kernel_matmul(y, x, rhs, half_sq_norm(x), transpose=transpose,
                                      chunk=chunk, kernel="torch")

    def with_grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (y, x, rhs)]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        return out.detach(), *(t.grad for t in leaves)

    torch._dynamo.reset()
    got = with_grads(torch.compile(product, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got, with_grads(product), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
