"""benchmarks/causal_window.py: what its result files record."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark

causal_window = load_benchmark("causal_window")


def test_both_files_record_the_config_and_the_environment(tmp_path):
    rows = [{"layer": 0, "method": "skyformer", "causal_local": local, "n": 16,
             "num_features": 4, "error_mean": 0.1, "error_std": 0.01, "seeds": 2}
            for local in (True, False)]
    config = {"n": 16, "m": 4, "layers": [0], "seeds": 2, "out": str(tmp_path / "cw")}
    argv = ["--n", "16", "--m", "4", "--layers", "0", "--seeds", "2"]
    causal_window.write(rows, tmp_path / "cw", config, argv)
    saved = json.loads((tmp_path / "cw.json").read_text())
    assert saved["config"] == config and saved["rows"] == rows
    assert saved["command"] == "python benchmarks/causal_window.py " + " ".join(argv)
    assert {"python", "torch", "torch_threads", "platform", "skyformer"} <= set(
        saved["environment"])
    lines = (tmp_path / "cw.csv").read_text().splitlines()
    assert json.loads(lines[0].removeprefix("# config: ")) == config
    assert json.loads(lines[1].removeprefix("# environment: ")) == saved["environment"]
    assert json.loads(lines[2].removeprefix("# command: ")) == saved["command"]
    assert lines[3].startswith("layer,method,causal_local") and len(lines) == 6
    assert (tmp_path / "cw.png").is_file()
