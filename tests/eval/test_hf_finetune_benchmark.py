"""benchmarks/hf_finetune.py's result files, the fine-tune stubbed: both tables carry what
the run used."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("hf_finetune")


def _run(config, progress=None, save_to=None):
    scores = {"cosine_mean": 0.5, "cosine_min": 0.1, "recall_at_1": 0.25}
    return {"config": {"method": config.method, "num_features": config.num_features,
                       "steps": config.steps},
            "before": scores, "after": scores, "seconds": 1.0, "loss": [0.2, 0.1],
            "train_texts": 8, "test_texts": 2}


def test_the_csv_and_json_record_the_settings_environment_and_command(monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark, "distill", _run)
    out = tmp_path / "finetune"
    argv = ["--methods", "kernelized", "skyformer", "--steps", "2", "--out", str(out)]
    assert benchmark.main(argv) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    lines = out.with_suffix(".csv").read_text().splitlines()
    meta = {line[2:].split(": ", 1)[0]: json.loads(line.split(": ", 1)[1])
            for line in lines if line.startswith("# ")}
    for record in (saved, meta):
        assert record["config"]["methods"] == ["kernelized", "skyformer"]
        assert record["config"]["steps"] == 2 and record["config"]["lr"] == 1e-4
        assert record["environment"]["torch_threads"] == torch.get_num_threads()
        assert record["command"] == "python benchmarks/hf_finetune.py " + " ".join(argv)
    assert [run["config"]["method"] for run in saved["runs"]] == ["kernelized", "skyformer"]
    assert lines[len(meta)].startswith("method,num_features,steps") and len(lines) == len(meta) + 3


def test_a_variants_features_run_and_bad_settings_stop_before_training(monkeypatch, tmp_path,
                                                                        capsys):
    """--features (default 32) overrode skyformer[num_features=8] without a word, and a
    bad --out or --steps failed with a traceback after the training."""
    ran = []
    monkeypatch.setattr(benchmark, "distill", lambda config, progress=None, save_to=None:
                        ran.append(config) or _run(config))
    out = str(tmp_path / "finetune")
    assert benchmark.main(["--methods", "skyformer[num_features=8]", "skyformer",
                           "--steps", "2", "--out", out]) == 0
    assert [c.num_features for c in ran] == [None, 32]  # the brackets' 8 runs
    assert [row.split(",")[1] for row in (tmp_path / "finetune.csv").read_text().splitlines()
            if row.startswith("skyformer")] == ["8", "32"]
    ran.clear()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as ended:  # argparse's line, before anything loads
        benchmark.main(["--methods", "skyformer", "--out", out, "--steps", "0"])
    assert ended.value.code == 2
    assert "argument --steps: must be a positive integer, got 0" in capsys.readouterr().err
    for argv, said in ((["--methods", "nosuch"], "unknown attention method 'nosuch'"),
                       (["--out", str(tmp_path / "file" / "x")], "file is a file, not a folder"),
                       (["--methods", "skyformer[num_features=8]", "--features", "16"],
                        "sets num_features in its brackets and --features 16 sets it too")):
        assert benchmark.main(["--methods", "skyformer", "--out", out, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf_finetune: error: ") and said in err, err
    assert ran == []


def test_own_text_model_and_save_folders_reach_the_runs(monkeypatch, tmp_path, capsys):
    """The script took neither one's own sentences nor model, and kept no fine-tuned
    model: --text, --model, --seq-len, --holdout go to the runs, --save gives each method
    a folder of its own."""
    calls = []

    def run(config, progress=None, save_to=None):
        calls.append((config, save_to))
        return _run(config)

    monkeypatch.setattr(benchmark, "distill", run)
    text = tmp_path / "mine.txt"
    text.write_text("Some sentences of my own.")
    argv = ["--methods", "kernelized", "skyformer[num_features=8]", "--steps", "1", "--text",
            str(text), "--model", "my_model", "--seq-len", "64", "--holdout", "4", "--save",
            str(tmp_path / "saved"), "--out", str(tmp_path / "finetune")]
    assert benchmark.main(argv) == 0
    assert [(c.text, c.model, c.seq_len, c.holdout) for c, _ in calls] == [
        (str(text), "my_model", 64, 4)] * 2
    assert [folder for _, folder in calls] == [tmp_path / "saved" / "kernelized",
                                               tmp_path / "saved" / "skyformer_num_features=8"]
    assert f"saved the fine-tuned model to {tmp_path / 'saved' / 'kernelized'}" in \
        capsys.readouterr().out
