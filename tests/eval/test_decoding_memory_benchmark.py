"""benchmarks/decoding_memory.py at tiny lengths: its table and a JSON that records what
it ran with."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("transformers")

benchmark = load_benchmark("decoding_memory")


def test_tiny_run_writes_its_table_settings_environment_and_command(tmp_path):
    argv = ["--lengths", "2", "4", "--prompt", "4", "--m", "4", "--out", str(tmp_path)]
    benchmark.main(argv)
    saved = json.loads((tmp_path / "decoding_memory.json").read_text())
    assert saved["config"] | {"out": None} == {"lengths": [2, 4], "prompt": 4, "m": 4,
                                               "threads": None, "out": None}
    assert saved["environment"]["torch_threads"] == torch.get_num_threads()
    assert saved["command"] == "python benchmarks/decoding_memory.py " + " ".join(argv)
    assert {row["method"] for row in saved["rows"]} == set(benchmark.METHODS)
    assert "| skyformer |" in (tmp_path / "decoding_memory.md").read_text()
