"""benchmarks/linformer_draw.py runs on tiny shapes and writes its table and JSON; both
draws give N(0, 1/k) projections of the requested shape."""

from __future__ import annotations

import json

import torch

import skyformer
from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("linformer_draw")


def test_both_draws_give_projections_of_variance_one_over_k():
    for draw in benchmark.DRAWS.values():
        e, f = benchmark.projections(draw, skyformer.random_key(0), 2, 64, 500)
        assert e.shape == f.shape == (2, 64, 500) and not torch.equal(e, f)
        assert abs(e.var().item() * 64 - 1) < 0.03  # 64k draws: 3% is over 5 sigma


def test_tiny_run_writes_rows_json_and_table(tmp_path):
    argv = ["--seq-lens", "32", "--heads", "1", "--features", "8", "--repeats", "1",
            "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "draw")]
    rows = benchmark.main(argv)
    assert [r["N"] for r in rows] == [32]
    assert all(rows[0][f"{name}_ms"] > 0 for name in ("normal", "bulk_normal", "softmax"))
    saved = json.loads((tmp_path / "draw.json").read_text())
    assert saved["rows"] == rows and "torch" in json.dumps(saved["environment"])
    assert saved["config"]["heads"] == 1
    assert saved["command"] == "python benchmarks/linformer_draw.py " + " ".join(argv)
    assert "| 32 |" in (tmp_path / "draw.md").read_text()
