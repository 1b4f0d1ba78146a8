"""benchmarks/accuracy_first.py's result files, the measurement stubbed: the JSON and the
CSV of a part both carry what the run used."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("accuracy_first")


def _speed(n, repeats):
    return [{"method": name, "n": n, "fwd_bwd_ms": 1.0, "ratio_to_skyformer": 1.0,
             "peak_mib": 1.0, "peak_ratio_to_skyformer": 1.0, "uptime_before": "up",
             "uptime_after": "up"} for name in ("skyformer", "nystrom_softmax")]


def test_a_parts_csv_and_json_record_the_settings_environment_and_command(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setattr(benchmark, "part_speed", _speed)
    argv = ["--parts", "speed", "--speed-n", "8", "--repeats", "2", "--threads",
            str(torch.get_num_threads()), "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    saved = json.loads((tmp_path / "speed.json").read_text())
    lines = (tmp_path / "speed.csv").read_text().splitlines()
    meta = {line[2:].split(": ", 1)[0]: json.loads(line.split(": ", 1)[1])
            for line in lines if line.startswith("# ")}
    for record in (saved, meta):
        assert record["config"]["speed_n"] == 8 and record["config"]["repeats"] == 2
        assert record["config"]["part"] == "speed"
        assert record["environment"]["torch_threads"] == torch.get_num_threads()
        assert record["command"] == "python benchmarks/accuracy_first.py " + " ".join(argv)
    assert lines[len(meta)].startswith("method,n,fwd_bwd_ms") and len(lines) == len(meta) + 3
    assert [row["method"] for row in saved["rows"]] == ["skyformer", "nystrom_softmax"]


def test_the_plot_replaces_its_file_whole(tmp_path):
    """The figure was saved straight to its path (a run stopped while saving left half a
    PNG where the committed one had been): it goes through a temporary file now, and
    none is left beside it."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "baselines.png"
    path.write_bytes(b"the earlier figure")
    rows = [{"source": "bert", "method": name, "n": n, "m": m, "error": 0.1 * m, "trivial": 1.0}
            for name in benchmark.NEW for n in (512, 2048) for m in (16, 32)]
    saved = []
    real_replace = os.replace
    with mock.patch("os.replace", lambda src, dst: saved.append(src) or real_replace(src, dst)):
        benchmark.plot_baselines(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and saved
    assert list(tmp_path.iterdir()) == [path]
