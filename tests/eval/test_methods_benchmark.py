"""benchmarks/methods.py, the preset of ``skyformer bench`` over every approximate
method: options given after it override the preset's, the lengths included."""

from __future__ import annotations

import json

import pytest

from skyformer.cli import main
from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("methods")


def test_lengths_given_replace_the_preset_s_and_the_run_writes_them(tmp_path):
    for given in (["--seq-lens", "32"], ["--seq-lens=32"], ["--seq", "32"]):
        argv = benchmark.preset(given)
        assert "--min-n" not in argv and "--max-n" not in argv and argv[-len(given):] == given
    argv = benchmark.preset(["--max-n", "2048"])  # one bound given: the other is the preset's
    assert argv[argv.index("--min-n") + 1] == "1024" and argv[-2:] == ["--max-n", "2048"]
    # below the preset's other bound: it moves (bench said "--min-n 1024 is above --max-n
    # 512", a --min-n the user never gave)
    argv = benchmark.preset(["--max-n=512"])
    assert argv[argv.index("--min-n") + 1] == "512"
    argv = benchmark.preset(["--min", "32768"])
    assert argv[argv.index("--max-n") + 1] == "32768" and argv[-2:] == ["--min", "32768"]
    out = tmp_path / "methods"
    argv = benchmark.preset(["--methods", "softmax", "linear", "--seq-lens", "16",
                             "--shapes", "1,1,4", "--repeats", "1", "--warmup", "0",
                             "--no-memory", "--no-plot", "--out", str(out)])
    assert main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["method"], r["n"]) for r in rows] == [("softmax", 16), ("linear", 16)]


@pytest.mark.parametrize(("methods", "sentence"), [
    (["skyformer:bogus"], "the one form after ':' is 'causal'"),
    (["skyformer", "bogus"], "unknown attention method 'bogus'")])
def test_real_vs_random_refuses_unknown_methods_before_loading_the_model(
        methods, sentence, monkeypatch, capsys):
    """An unknown form ran the non-causal method under the name given; an unknown name
    failed with a traceback after the model had loaded and earlier rows were timed."""
    script = load_benchmark("real_vs_random")
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit):
        script.main(["--methods", *methods])
    assert sentence in capsys.readouterr().err
