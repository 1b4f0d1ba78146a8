from __future__ import annotations

import torch

from skyformer.linalg import gaussian_kernel_block, half_sq_norm
from tests.conftest import gen


def test_gaussian_block_matches_pairwise_differences():
    g = gen(0)
    x = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    naive = torch.exp(-((x[..., :, None, :] - y[..., None, :, :]) ** 2).sum(-1) / 2)
    torch.testing.assert_close(gaussian_kernel_block(x, y), naive)
    shifted = gaussian_kernel_block(x, y, shift_rows=True)
    torch.testing.assert_close(shifted, naive / naive.amax(-1, keepdim=True))


def test_infinite_half_norm_masks_rows_and_columns_without_nan_gradients():
    x = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True)
    ny = half_sq_norm(y).clone()
    ny[..., 2] = float("inf")
    c = gaussian_kernel_block(x, y, half_sq_norm(x), ny)
    assert torch.all(c[..., 2] == 0)
    c.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()
    assert torch.all(y.grad[..., 2, :] == 0)


def test_all_masked_row_with_shift_is_zero():
    x = torch.randn(1, 1, 2, 3, dtype=torch.float64)
    y = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    ny = torch.full((1, 1, 3), float("inf"), dtype=torch.float64)
    c = gaussian_kernel_block(x, y, None, ny, shift_rows=True)
    assert torch.all(c == 0)
