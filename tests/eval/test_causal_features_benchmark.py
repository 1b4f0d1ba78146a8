"""benchmarks/causal_features.py runs on tiny shapes and writes its table and JSON; the
block path it patches in gives the product path's features, and keeps more for the
backward pass."""

from __future__ import annotations

import json

import pytest
import torch

import skyformer
from tests.benchmark_scripts import load_benchmark
from tests.conftest import make_qkv

benchmark = load_benchmark("causal_features")


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_the_block_path_gives_the_same_outputs_and_gradients(method):
    """With padded keys too (their rows of phi zeros on both paths)."""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, 150, 16, seed=3))
    mask = torch.ones(2, 150, dtype=torch.bool)
    mask[0, :9] = False
    mask[1, 120:] = False

    def run(path):
        with benchmark.features(path):
            out = skyformer.attention(q, k, v, method, causal=True, num_features=24,
                                      key_padding_mask=mask,
                                      generator=torch.Generator().manual_seed(1))
            return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    for got, want in zip(run("product"), run("block"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_tiny_run_writes_rows_json_and_table(tmp_path):
    argv = ["--shape", "1,1,16", "--seq-lens", "256", "--features", "32", "--repeats", "1",
            "--out", str(tmp_path / "features.md")]
    assert benchmark.main(argv) == 0
    saved = json.loads((tmp_path / "features.json").read_text())
    rows = {(row["method"], row["features"]): row for row in saved["rows"]}
    assert set(rows) == {(method, path) for method in ("skyformer", "nystrom_softmax")
                         for path in ("product", "block")}
    assert all(r["ms"] > 0 for r in rows.values())
    for method in ("skyformer", "nystrom_softmax"):
        assert rows[method, "product"]["saved_mib"] < rows[method, "block"]["saved_mib"]
    assert saved["command"] == "python benchmarks/causal_features.py " + " ".join(argv)
    assert "| nystrom_softmax | 256 | product |" in (tmp_path / "features.md").read_text()
