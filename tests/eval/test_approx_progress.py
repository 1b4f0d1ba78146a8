"""``approx --resume``: the blocks a run does not ask for, and the data files it was
measured on (``skyformer.eval.approx.progress``)."""

from __future__ import annotations

import json
import os
import re

import pytest

from skyformer.cli import main
from skyformer.eval.approx import ApproxConfig
from skyformer.eval.approx.progress import PARTS, PROGRESS_FILE, ProgressFile

TINY = ["approx", "--sources", "gaussian", "--features", "4", "--seeds", "0", "--heads", "0",
        "--methods", "skyformer", "--analysis-len", "12", "--eps", "0.1", "--no-plots",
        "--no-progress"]
SETTINGS = {"features": (4,), "seeds": (0,), "heads": (0,), "methods": ("skyformer",),
            "analysis_seq_len": 12, "eps": (0.1,), "progress": False}


def config(**overrides) -> ApproxConfig:
    return ApproxConfig(**{"sources": ("gaussian",), "seq_lens": (12,), **SETTINGS,
                           **overrides})


def saved(path, cfg: ApproxConfig, *keys: str) -> None:
    """A progress file of ``cfg`` at ``path`` holding empty blocks ``keys``."""
    progress = ProgressFile(path, cfg, resume=False, methods=list(cfg.methods))
    for key in keys:
        progress.save(key, {part: [] for part in PARTS})


def resumed(path, cfg: ApproxConfig) -> ProgressFile:
    return ProgressFile(path, cfg, resume=True, methods=list(cfg.methods))


def test_a_resumed_run_of_fewer_lengths_keeps_the_blocks_it_does_not_take(
        tmp_path, monkeypatch, capsys):
    """Resumed with --seq-lens 12 of a run of 12 and 24, the block of N = 24 was dropped
    without a word and the progress file removed with it once the results were written:
    it is now said, kept, and a run of both lengths takes every block from it."""
    import skyformer.eval.approx.run as approx_run

    out = tmp_path / "run"
    with monkeypatch.context() as patched:  # Ctrl-C in the analysis, after both sweeps
        def interrupted(*args):
            raise KeyboardInterrupt

        patched.setattr(approx_run, "_analysis_block", interrupted)
        assert main([*TINY, "--seq-lens", "12", "24", "--out", str(out)]) == 130
    progress = out / PROGRESS_FILE
    assert sorted(json.loads(progress.read_text())["blocks"]) == [
        "sweep/gaussian/12", "sweep/gaussian/24"]
    capsys.readouterr()
    assert main([*TINY, "--seq-lens", "12", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "also holds 1 block this run does not ask for (sweep/gaussian/24); they stay in " \
           "it, which is kept after the results are written: run again with --seq-lens 12 " \
           "24 and --resume to have them in the results" in err
    assert f"note: kept {progress}: it also holds 1 block these results do not " \
           f"(sweep/gaussian/24); run again with --seq-lens 12 24 and --resume" in err
    assert sorted(json.loads(progress.read_text())["blocks"]) == [
        "analysis/gaussian", "sweep/gaussian/12", "sweep/gaussian/24"]
    assert {row["seq_len"] for row in json.loads((out / "approx.json").read_text())["rows"]} \
        == {12}

    def measured(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(approx_run, "_sweep_block", measured)
    monkeypatch.setattr(approx_run, "_analysis_block", measured)
    assert main([*TINY, "--seq-lens", "12", "24", "--out", str(out), "--resume"]) == 0
    assert "does not ask for" not in capsys.readouterr().err
    assert not progress.exists()  # the results hold every block now
    result = json.loads((out / "approx.json").read_text())
    assert {row["seq_len"] for row in result["rows"]} == {12, 24}
    assert result["notes"][-1].startswith("resumed: 3 blocks (")


def test_blocks_of_other_sources_are_said_with_the_sources_to_take_them(tmp_path, capsys):
    path = tmp_path / PROGRESS_FILE
    saved(path, config(sources=("gaussian", "init"), seq_lens=(12, 24)),
          "sweep/gaussian/12", "sweep/gaussian/24", "analysis/gaussian", "sweep/init/12")
    progress = resumed(path, config())
    assert progress.left_out == ["sweep/gaussian/24", "sweep/init/12"]
    assert "run again with --sources gaussian init --seq-lens 12 24 and --resume" in \
        capsys.readouterr().err
    progress = resumed(path, config(seq_lens=(24, 12)))
    assert progress.left_out == ["sweep/init/12"]
    assert "run again with --sources gaussian init and --resume" in capsys.readouterr().err
    assert resumed(path, config(sources=("init", "gaussian"), seq_lens=(12, 24))).left_out \
        == []


def test_a_data_file_is_compared_by_where_it_resolves_not_how_it_is_spelt(
        tmp_path, monkeypatch):
    """``./g.txt`` and ``g.txt`` were refused as other settings."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.txt").write_text("a 1 2\n")
    path = tmp_path / PROGRESS_FILE
    saved(path, config(glove="g.txt"), "sweep/gaussian/12")
    assert list(resumed(path, config(glove="./g.txt")).blocks) == ["sweep/gaussian/12"]
    assert list(resumed(path, config(glove=str(tmp_path / "g.txt"))).blocks) == [
        "sweep/gaussian/12"]
    (tmp_path / "h.txt").write_text("a 1 2\n")
    with pytest.raises(ValueError, match=r"other settings \(glove='.*g.txt' there, "
                                         r"'.*h.txt' now\)"):
        resumed(path, config(glove="h.txt"))


def test_a_data_file_changed_under_the_same_name_is_refused(tmp_path):
    """A GloVe file regenerated under its name: its blocks were taken as if measured on it."""
    glove = tmp_path / "g.txt"
    glove.write_text("a 1 2\n")
    stamp = os.stat(glove).st_mtime_ns
    path = tmp_path / PROGRESS_FILE
    saved(path, config(glove=str(glove)), "sweep/gaussian/12")
    refused = (rf"cannot resume from .*: since its blocks were measured, --glove "
               rf"{re.escape(str(glove))} has changed \(size or modification time\); run "
               rf"without --resume into a fresh --out, or restore the file\.")
    glove.write_text("a 1 2 3\n")  # another size
    with pytest.raises(ValueError, match=refused):
        resumed(path, config(glove=str(glove)))
    glove.write_text("a 3 4\n")  # the same size, written later
    os.utime(glove, ns=(stamp + 10**9, stamp + 10**9))
    with pytest.raises(ValueError, match=refused):
        resumed(path, config(glove=str(glove)))
    os.utime(glove, ns=(stamp, stamp))  # restored
    assert list(resumed(path, config(glove=str(glove))).blocks) == ["sweep/gaussian/12"]
    glove.unlink()
    with pytest.raises(ValueError, match=f"--glove {re.escape(str(glove))} has been removed"):
        resumed(path, config(glove=str(glove)))


def test_a_model_folder_is_compared_by_its_config_weight_and_tokenizer_files(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (model / name).write_text(name)
    path = tmp_path / PROGRESS_FILE
    saved(path, config(model=str(model)), "sweep/gaussian/12")
    (model / "README.md").write_text("another readme")  # not read by the loader
    assert list(resumed(path, config(model=str(model))).blocks) == ["sweep/gaussian/12"]
    (model / "model.safetensors").write_text("other weights")
    (model / "vocab.txt").write_text("a")
    (model / "tokenizer.json").unlink()
    folder = re.escape(str(model))
    with pytest.raises(ValueError, match=rf"measured, model.safetensors of --model {folder} "
                                         rf"has changed \(size or modification time\), "
                                         rf"tokenizer.json of --model {folder} has been "
                                         rf"removed, vocab.txt of --model {folder} has been "
                                         rf"added; run without --resume"):
        resumed(path, config(model=str(model)))


def _written_before_stamps(path, **paths) -> None:
    """Rewrite the progress file at ``path`` as one written before the stamps were kept:
    the data settings as the paths given, no "data"."""
    data = json.loads(path.read_text())
    data["settings"].pop("data")
    data["settings"].update({"text": None, "glove": None, "model": None, **paths})
    path.write_text(json.dumps(data))


def test_a_progress_file_written_before_the_stamps_resumes_on_its_paths(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.txt").write_text("a 1 2\n")
    path = tmp_path / PROGRESS_FILE
    saved(path, config(glove="g.txt"), "sweep/gaussian/12")
    _written_before_stamps(path, glove="g.txt")
    assert list(resumed(path, config(glove="./g.txt")).blocks) == ["sweep/gaussian/12"]
    assert "was written before approx kept a stamp (size, modification time) of --glove; " \
           "resuming on the path alone" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"other settings \(glove='.*g.txt' there, "
                                         r"'.*h.txt' now\)"):
        resumed(path, config(glove="h.txt"))
    saved(path, config(), "sweep/gaussian/12")  # no data file: nothing to say
    _written_before_stamps(path)
    assert list(resumed(path, config()).blocks) == ["sweep/gaussian/12"]
    assert "was written before" not in capsys.readouterr().err


@pytest.mark.parametrize("data", [None, [], {"glove": "g.txt"}, {"glove": {"path": 1}}])
def test_a_progress_file_with_malformed_stamps_is_refused(tmp_path, data):
    path = tmp_path / PROGRESS_FILE
    saved(path, config(), "sweep/gaussian/12")
    content = json.loads(path.read_text())
    content["settings"]["data"] = data
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="not an approx progress file"):
        resumed(path, config())


def test_the_order_of_features_seeds_and_eps_is_not_another_setting(tmp_path):
    """--features 64 16 after --features 16 64 was refused as other settings, though
    every block measures the same (the sweep sorts m; seeds and eps are sets)."""
    path = tmp_path / PROGRESS_FILE
    saved(path, config(features=(4, 8), seeds=(0, 1), eps=(0.1, 0.01)), "sweep/gaussian/12")
    progress = resumed(path, config(features=(8, 4), seeds=(1, 0), eps=(0.01, 0.1)))
    assert progress.restore("sweep/gaussian/12") is not None
    with pytest.raises(ValueError, match=r"other settings \(features=\[4, 8\] there, "
                                         r"\[4, 16\] now\)"):
        resumed(path, config(features=(4, 16), seeds=(0, 1), eps=(0.1, 0.01)))


@pytest.mark.parametrize("damage", ["cut short", "empty", "not UTF-8", "no blocks"])
def test_a_damaged_progress_file_says_how_to_start_over(tmp_path, damage):
    """A progress file cut short by a full disk was called "not an approx progress
    file", with only "write to another --out" for a fix."""
    path = tmp_path / PROGRESS_FILE
    saved(path, config(), "sweep/gaussian/12")
    text = path.read_bytes()
    path.write_bytes({"cut short": text[: len(text) // 2], "empty": b"",
                      "not UTF-8": b"\xff\xfe" + text,
                      "no blocks": b'{"settings": {}}'}[damage])
    with pytest.raises(ValueError, match=r"cannot resume from .*: not an approx progress "
                                         r"file.*, or .*damaged.*; remove it to start over "
                                         r"there, or write to another --out\."):
        resumed(path, config())
