"""benchmarks/causal_lm.py: held-out scoring, resumable results, refusals (tiny shapes)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

causal_lm = load_benchmark("causal_lm")

TINY = ["--ns", "16", "32", "--steps", "2", "--eval-every", "1", "--dim", "16", "--heads", "2",
        "--m", "4", "--tokens-per-step", "64", "--layers", "1"]


@pytest.mark.parametrize("n", [4, 7, 16])
def test_every_heldout_byte_is_scored_once_with_half_a_window_of_context(n):
    data = torch.arange(100)
    cut = 90
    windows = causal_lm.heldout_windows(data, cut, n)
    targets = torch.cat([w[-scored:] for w, scored in windows])
    assert targets.tolist() == list(range(cut, 100))
    for window, scored in windows:
        assert len(window) == n + 1 and n + 1 - scored >= n // 2 + 1


def small_text(tmp_path):
    """About 600 bytes: a held-out part of about 60 bytes keeps the evaluations short."""
    path = tmp_path / "text.txt"
    path.write_text("Four score and seven years ago our fathers brought forth a new nation. " * 8)
    return str(path)


def test_a_rerun_keeps_the_finished_rows_and_a_changed_config_is_refused(tmp_path, capsys):
    out = tmp_path / "lm"
    args = [*TINY, "--text", small_text(tmp_path), "--methods", "softmax", "linear",
            "--out", str(out)]
    rows = causal_lm.main(args)
    assert [(r["n"], r["method"]) for r in rows] == [
        (16, "softmax"), (16, "linear"), (32, "softmax"), (32, "linear")]
    assert all(len(r["curve"]) == 2 and r["best_heldout_loss"] <= r["heldout_loss"]
               for r in rows)
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert saved["command"] == "python benchmarks/causal_lm.py " + " ".join(args)
    assert f"# command: {json.dumps(saved['command'])}" in out.with_suffix(".csv").read_text()
    assert out.with_suffix(".csv").is_file() and out.with_suffix(".png").is_file()
    capsys.readouterr()

    again = causal_lm.main(args)
    assert again == saved["rows"] and capsys.readouterr().out == ""  # nothing retrained

    with pytest.raises(SystemExit, match=r"holds 4 rows of another configuration \(seed "
                                         r"differ\): pass --fresh to replace them"):
        causal_lm.main([*args, "--seed", "1"])
    changed = causal_lm.main([*args, "--seed", "1", "--fresh"])
    assert len(changed) == 4 and capsys.readouterr().out.count("\n") == 4


def test_a_non_finite_setting_still_finds_the_rows_saved_with_it(tmp_path):
    """The JSON holds an infinite (or NaN) setting as null: a rerun with the same settings
    compares its config as written, so it reuses the rows instead of retraining them."""
    from skyformer.io import write_json

    config = causal_lm.run_config(causal_lm.parse_args([*TINY, "--lr", "inf"]))
    path = tmp_path / "lm.json"
    write_json(path, {"config": config, "environment": {}, "rows": [{"n": 16}]})
    assert causal_lm.load_rows(path, config) == [{"n": 16}]
    with pytest.raises(SystemExit, match=r"\(lr differ\)"):
        causal_lm.load_rows(path, config | {"lr": 1e-3})


def test_refuses_a_method_that_cannot_attend_causally(tmp_path):
    with pytest.raises(SystemExit, match="nystromformer cannot attend causally"):
        causal_lm.main([*TINY, "--methods", "nystromformer", "--out", str(tmp_path / "x")])


def test_refuses_a_text_too_short_for_the_context(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("a short text. " * 2)  # 28 bytes: 90 % cannot hold 33
    with pytest.raises(SystemExit, match="too short for N = 32"):
        causal_lm.main([*TINY, "--text", str(text), "--out", str(tmp_path / "x")])
