"""benchmarks/causal_blocks.py: its result files record what it ran with, and a form
measured in this process restores nothing it should not (the measurement itself runs in
fresh processes, stubbed here)."""

from __future__ import annotations

import json

import torch

from skyformer.ops.shared import causal_prefix as causal
from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("causal_blocks")


def _row(method, n, repeats, threads):
    form = {"seconds": 0.5, "peak_mib": 10.0}
    return {"method": method, "n": n, "blocks": form, "whole": {**form, "seconds": 1.0},
            "whole_over_blocks": 2.0}


def test_the_table_and_json_record_the_settings_environment_and_command(monkeypatch,
                                                                         tmp_path):
    monkeypatch.setattr(benchmark, "measure", _row)
    argv = ["--methods", "performer", "--seq-lens", "64", "128", "--out",
            str(tmp_path / "blocks")]
    benchmark.main(argv)
    saved = json.loads((tmp_path / "blocks.json").read_text())
    assert saved["config"]["seq_lens"] == [64, 128]
    assert saved["config"]["stream_rows"] == causal.STREAM_ROWS
    assert saved["command"] == "python benchmarks/causal_blocks.py " + " ".join(argv)
    assert [r["n"] for r in saved["rows"]] == [64, 128]
    assert "| performer | 128 | 500 | 10 | 1000 | 10 | 2.00 |" in (tmp_path / "blocks.md"
                                                                     ).read_text()


def test_a_form_measured_here_times_the_call(monkeypatch):
    monkeypatch.setattr(causal, "STREAM_ROWS", causal.STREAM_ROWS)  # restored after
    threads = torch.get_num_threads()
    try:
        got = benchmark.measure_here("performer", "whole", 96, 1, 1)
    finally:
        torch.set_num_threads(threads)
    assert got["seconds"] > 0 and got["peak_mib"] >= 0
    assert benchmark.FORMS["whole"] == causal.STREAM_ROWS
