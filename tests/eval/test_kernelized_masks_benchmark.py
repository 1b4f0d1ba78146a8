"""benchmarks/kernelized_masks.py runs on tiny shapes and writes its table and JSON, and
its masks are what it says: a padding mask one row per batch element, expanded (which
the default takes at head dim D), a mask with a row per query (which it does not)."""

from __future__ import annotations

import json

from skyformer.ops.kernelized.kernelized import _one_row_per_key
from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("kernelized_masks")


def test_its_masks_take_the_forms_it_names():
    kinds = benchmark.masks(2, 32)
    assert kinds["none"] == (None, None)
    padding, rows = kinds["padding"]
    assert _one_row_per_key(padding) and not rows[-1, -4:].any() and rows[0].all()
    pairs, _ = kinds["per query"]
    assert pairs.shape == (32, 32) and not _one_row_per_key(pairs)


def test_tiny_run_writes_rows_json_and_table(tmp_path):
    argv = ["--shape", "2,1,16", "--seq-lens", "64", "--repeats", "1",
            "--out", str(tmp_path / "masks.md")]
    assert benchmark.main(argv) == 0
    saved = json.loads((tmp_path / "masks.json").read_text())
    assert {(row["mask"], row["form"]) for row in saved["rows"]} == {
        (kind, form) for kind in benchmark.MASKS for form in benchmark.FORMS}
    assert all(row["ms"] > 0 for row in saved["rows"])
    assert saved["command"] == "python benchmarks/kernelized_masks.py " + " ".join(argv)
    assert "| 64 | per query |" in (tmp_path / "masks.md").read_text()


def test_an_out_without_suffix_names_the_table_and_the_json(tmp_path):
    run_metadata = load_benchmark("run_metadata")
    run_metadata.write_report(tmp_path / "km", "| table |\n", {"command": "x"}, rows=[])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["km.json", "km.md"]
    assert (tmp_path / "km.md").read_text() == "| table |\n"
