"""benchmarks/sequence_parallel.py's result files, with the measurement stubbed (it starts
a group of processes per configuration): both tables carry what the run used."""

from __future__ import annotations

import json

import torch

from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("sequence_parallel")


def _row(procs, n, args):
    ring_forward, ring = benchmark.ring_bytes(n, procs)
    return {"procs": procs, "n": n, "bytes": 100, "forward_bytes": 50, "collectives": 2,
            "ring_forward_bytes": ring_forward, "ring_bytes": ring, "ring_over_ours": 1.0,
            "seconds": 0.1, "peak_rss_mib": 2.0, "peak_above_start_mib": 1.0, "ranks": []}


def test_the_csv_and_json_record_the_settings_environment_and_command(monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark, "measure", _row)
    argv = ["--procs", "1", "2", "--seq-lens", "64", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    lines = (tmp_path / "results.csv").read_text().splitlines()
    meta = {line[2:].split(": ", 1)[0]: json.loads(line.split(": ", 1)[1])
            for line in lines if line.startswith("# ")}
    for record in (saved, meta):
        assert record["config"]["procs"] == [1, 2] and record["config"]["dtype"] == "float32"
        assert record["environment"]["torch_threads"] == torch.get_num_threads()
        assert record["command"] == "python benchmarks/sequence_parallel.py " + " ".join(argv)
    assert lines[len(meta)].startswith("procs,n,bytes") and len(lines) == len(meta) + 3
