"""The product kernels' tiles at head dims above 64 (``triton_kernels.WIDE_TILES``): the
choice per GPU family, and the compiled code's spills."""

from __future__ import annotations

import pytest
import torch

import skyformer
from skyformer.linalg import triton_kernels as tk
from tests.compiled import compiled_rows, needs_compiler
from tests.conftest import make_qkv
from tests.devices import relative_error

MMA_GPUS = [None, (9, 0), (10, 0), (8, 0), (8, 9), (12, 0)]


@pytest.mark.parametrize("capability", MMA_GPUS)
def test_wide_head_dims_take_eight_warps_where_dots_use_mma(capability):
    """Above 64: eight warps, 16-row tiles for float32 rows; the cols kernel with half
    rows keeps its tiles; at 64 and below nothing changes."""
    narrow_rows = tk._row_tiles(64, 64, torch.float32, True, capability)
    narrow_cols = tk._col_tiles(64, 64, torch.float32, False, capability)
    for bd, br in ((128, 128), (128, 64), (64, 128)):
        assert tk._row_tiles(bd, br, torch.float32, True, capability) == (32, 32, 8, 1)
        assert tk._row_tiles(bd, br, torch.float32, False, capability) == (16, 32, 8, 1)
        assert tk._col_tiles(bd, br, torch.float32, False, capability) == (16, 16, 8, 1)
        assert tk._col_tiles(bd, br, torch.float32, True, capability)[2] == 4
    for bd, br in ((256, 256), (256, 64), (512, 512)):
        assert tk._row_tiles(bd, br, torch.float32, True, capability) == (16, 16, 8, 1)
        assert tk._row_tiles(bd, br, torch.float32, False, capability) == (16, 32, 8, 1)
        assert tk._col_tiles(bd, br, torch.float32, False, capability) == (16, 16, 8, 1)
        assert tk._col_tiles(bd, br, torch.float32, True, capability) == (32, 32, 8, 1)
    assert tk._row_tiles(64, 32, torch.float32, True, capability) == narrow_rows
    assert tk._col_tiles(32, 64, torch.float32, False, capability) == narrow_cols
    assert tk._row_tiles(128, 128, torch.float64, False, capability) == (16, 16, 4, 1)


def test_gpus_without_mma_keep_their_tiles_at_wide_head_dims():
    for half in (False, True):
        assert tk._row_tiles(128, 128, torch.float32, half, (7, 5)) == (16, 16, 8, 1)
        assert tk._col_tiles(128, 128, torch.float32, half, (7, 5)) == (16, 16, 8, 1)


@pytest.mark.parametrize("capability", [None, (8, 0)])
@pytest.mark.parametrize(("d", "dtype"), [(128, torch.bfloat16), (128, torch.float32),
                                          (256, torch.bfloat16)])
def test_skyformer_with_the_wide_tiles(monkeypatch, triton_interpreter, capability, d, dtype):
    """Outputs and gradients with the wide tiles (an sm_90 and an sm_80 GPU's choices),
    under the interpreter, against the same call on the PyTorch path."""
    q, k, v = (t.to(dtype) for t in make_qkv(1, 2, 37, d, seed=4, dtype=torch.float32))

    def run(kernel):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = skyformer.attention(*leaves, "skyformer", kernel=kernel, num_features=16,
                                  generator=skyformer.random_key(2))
        return [out, *torch.autograd.grad(out.float().square().sum(), leaves)]

    want = run("torch")
    chosen = []
    row_tiles = tk._row_tiles
    monkeypatch.setattr(tk, "device_capability", lambda device: capability)
    monkeypatch.setattr(tk, "_row_tiles", lambda *args: chosen.append(row_tiles(*args))
                        or chosen[-1])
    got = run("triton")
    assert chosen and all(tiles[2] == 8 for tiles in chosen)
    for a, e in zip(got, want, strict=True):
        assert relative_error(a.double(), e.double()) < (3e-2 if dtype == torch.bfloat16
                                                         else 2e-4)


@pytest.mark.slow
@needs_compiler
def test_the_gradient_launches_at_head_dim_128_compile_without_spills(tmp_path):
    """Compiled for sm_90 (Triton's ptxas, no GPU): Skyformer's product launches that
    spilled at D = 128 with the 64-and-below tiles (the rows kernel's gradient launches,
    half and float32 rows; the cols kernel's, float32) spill nothing."""
    for config, only in (("128:bfloat16", ["has_vn"]), ("128:float32", ["write_out1 has_v"])):
        rows = compiled_rows(tmp_path / config.replace(":", "_"), "--arch", "90",
                             "--configs", config, "--features", "16", "--only", *only)
        assert len(rows) == 2, [row["kernel"] for row in rows]
        for row in rows:
            assert (row["stack"], row["spill_stores"]) == (0, 0), row["kernel"]
            assert row["warps_per_sm"] >= 8, row["kernel"]
