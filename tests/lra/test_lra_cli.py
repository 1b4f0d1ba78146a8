"""``skyformer lra ...`` as a user runs it: generate, prepare, train, report, stability."""

from __future__ import annotations

import json
import os
import sys

import pytest

from skyformer.cli import main
from skyformer.lra.checkpoint import load_checkpoint
from tests.streams import FlushRecorder


def test_generate_prepare_train_report_stability(tmp_path, capsys):
    src, cache, runs = tmp_path / "listops", tmp_path / "cache", tmp_path / "runs"
    assert main(["lra", "generate", "listops", "--out", str(src), "--train", "64", "--dev", "16",
                 "--test", "16", "--max-depth", "2", "--max-args", "4", "--min-length", "3",
                 "--max-length", "7"]) == 0
    assert main(["lra", "prepare", "listops", "--src", str(src), "--cache", str(cache),
                 "--max-len", "8"]) == 0
    assert "prepared listops" in capsys.readouterr().out
    for method in ("softmax", "skyformer"):
        assert main(["lra", "train", "listops", "--attn", method, "--quick", "--steps", "4",
                     "--eval-every", "2", "--option", "num_features=4" if method == "skyformer"
                     else "scale=0.2", "--cache", str(cache), "--out", str(runs / method),
                     "--no-tensorboard"]) == 0
    result = json.loads((runs / "skyformer" / "result.json").read_text())
    assert result["config"]["attention_options"] == {"num_features": 4}
    assert result["config"]["steps"] == 4 and result["config"]["batch_size"] == 16
    assert result["command"].startswith("skyformer lra train listops --attn skyformer --quick")
    capsys.readouterr()
    assert main(["lra", "report", str(runs), "--markdown", str(tmp_path / "tables.md")]) == 0
    out = capsys.readouterr().out
    label = "batch_size=16, eval_batches=4, eval_every=2, max_len=8{}, steps=4, warmup=20"
    assert f"| skyformer ({label.format(', num_features=4')}) |" in out  # the preset's others
    assert f"| softmax ({label.format(', scale=0.2')}) |" in out
    assert (tmp_path / "tables.md").read_text().startswith("Table 1")
    written = runs / "softmax" / "result.json"  # --markdown at a result: it was replaced
    before = written.read_text()
    assert main(["lra", "report", str(runs), "--markdown", str(written)]) == 2
    assert (f"--markdown {written} is {written}, a file the report reads: writing it would "
            f"replace what the run reads") in capsys.readouterr().err
    assert written.read_text() == before
    copied = tmp_path / "seed0.json"  # a result given as a file of another name
    copied.write_text(before)
    for output in (copied, runs / "softmax" / "metrics.jsonl"):
        kept = output.read_text()
        assert main(["lra", "report", str(copied), str(runs), "--markdown", str(output)]) == 2
        assert f"--markdown {output} is {output}, a file the report reads" in \
            capsys.readouterr().err
        assert output.read_text() == kept
    assert main(["lra", "stability", "--tasks", "listops", "--methods", "kernelized",
                 "--steps", "2", "--batch-size", "16", "--cache", str(cache)]) == 0
    assert "| kernelized |" in capsys.readouterr().out


def test_runs_of_two_option_values_get_two_default_folders():
    """The default folder was named after --attn alone: the second value of a sweep found
    the first's run there and was refused. One setting written several ways (brackets or
    --option, another order, spaces, quotes) is one folder: it was several, and a resume
    written the other way started a new run beside the unfinished one."""
    from skyformer.lra import make_config
    from skyformer.lra.train import default_run_dir

    def folder(attention, options):
        return default_run_dir(make_config("listops", attention=attention,
                                           attention_options=options, seed=1)).as_posix()

    folders = {folder(attention, options)
               for attention, options in [("skyformer", {"num_features": 8}),
                                          ("skyformer", {"num_features": 16}),
                                          ("skyformer", {}),
                                          ('skyformer[pinv_gradient="implicit"]', {}),
                                          ("skyformer", {"pinv_gradient": "implicit"})]}
    assert folders == {
        "runs/lra/listops/skyformer[num_features=8]/seed1",
        "runs/lra/listops/skyformer[num_features=16]/seed1",
        "runs/lra/listops/skyformer/seed1",
        "runs/lra/listops/skyformer[pinv_gradient=implicit]/seed1"}
    same = {folder(attention, options)
            for attention, options in [("skyformer", {"num_features": 16, "gamma": 0.2}),
                                       ("skyformer", {"gamma": 0.2, "num_features": 16}),
                                       ("skyformer[num_features=16, gamma=0.2]", {}),
                                       ("skyformer[gamma=0.2]", {"num_features": 16})]}
    assert same == {"runs/lra/listops/skyformer[gamma=0.2,num_features=16]/seed1"}


def test_seeds_stop_after_then_resume(tmp_path, capsys, listops_cache):
    args = ["lra", "train", "listops", "--attn", "softmax", "--steps", "6", "--eval-every", "3",
            "--batch-size", "16", "--cache", str(listops_cache), "--out", str(tmp_path),
            "--no-tensorboard", "--quiet", "--seeds", "0", "1"]
    assert main([*args, "--stop-after", "3"]) == 0
    assert "continue with --resume" in capsys.readouterr().out
    assert not (tmp_path / "seed0" / "result.json").exists()
    assert not (tmp_path / "seed1").exists(), "the next seed waits for the first"
    # again at 3: seed 0 trains nothing (it said "continue with --resume", and that went
    # round forever), so seed 1 goes on to step 3; each line names its folder
    assert main([*args, "--stop-after", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert (f"{tmp_path / 'seed0'}: nothing trained: the run is already at step 3 "
            f"(--stop-after 3); to go on, resume with a later --stop-after or none") in out
    assert f"{tmp_path / 'seed1'}: stopped after step 3; continue with --resume" in out
    assert main([*args, "--resume"]) == 0
    results = [json.loads((tmp_path / f"seed{s}" / "result.json").read_text()) for s in (0, 1)]
    assert [r["steps"] for r in results] == [6, 6] and [r["seed"] for r in results] == [0, 1]
    before = (tmp_path / "seed0" / "result.json").stat().st_mtime_ns
    assert main([*args, "--resume"]) == 0  # finished runs are left alone
    assert (tmp_path / "seed0" / "result.json").stat().st_mtime_ns == before


def test_ctrl_c_during_one_of_several_seeds_names_that_seeds_checkpoint(
        tmp_path, capsys, listops_cache, monkeypatch):
    """--seeds trains one folder a seed: the Ctrl-C line said "last.pt" without the
    folder it lies in."""
    from skyformer.lra.train import Trainer

    ran = []

    def interrupted(trainer):
        ran.append(trainer.folder)
        if len(ran) == 2:
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(Trainer, "run", interrupted)
    assert main(["lra", "train", "listops", "--attn", "softmax", "--steps", "6",
                 "--batch-size", "16", "--cache", str(listops_cache), "--out", str(tmp_path),
                 "--no-tensorboard", "--quiet", "--seeds", "0", "1"]) == 130
    assert ran == [tmp_path / "seed0", tmp_path / "seed1"]
    assert (f"interrupted; its last checkpoint ({tmp_path / 'seed1' / 'last.pt'}), if one "
            f"was written yet, is kept: run the same command again with --resume to "
            f"continue") in capsys.readouterr().err


def test_stop_after_stops_at_that_step_and_says_where(tmp_path, capsys, listops_cache):
    args = ["lra", "train", "listops", "--attn", "softmax", "--steps", "6", "--eval-every", "3",
            "--batch-size", "16", "--cache", str(listops_cache), "--out", str(tmp_path),
            "--no-tensorboard", "--quiet"]
    for extra, said in ((["--stop-after", "4"], "stopped after step 4;"),
                        (["--stop-after", "4", "--resume"],
                         "nothing trained: the run is already at step 4 (--stop-after 4);"),
                        (["--stop-after", "2", "--resume"],
                         "nothing trained: the run is already at step 4, past --stop-after 2")):
        assert main([*args, *extra]) == 0
        assert said in capsys.readouterr().out
        assert load_checkpoint(tmp_path / "last.pt")["state"]["step"] == 4
    # A new run stopped at step 0 writes the checkpoint its message says to continue from.
    assert main([*args, "--stop-after", "0", "--out", str(tmp_path / "zero")]) == 0
    assert "stopped after step 0; continue with --resume" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "zero" / "last.pt")["state"]["step"] == 0
    assert main([*args, "--stop-after", "0", "--out", str(tmp_path / "zero"), "--resume"]) == 0
    assert "nothing trained: the run is already at step 0 (--stop-after 0)" in \
        capsys.readouterr().out
    assert main([*args, "--stop-after", "-2", "--out", str(tmp_path / "negative")]) == 2
    assert "--stop-after) must be a number of steps >= 0, got -2" in capsys.readouterr().err
    assert not (tmp_path / "negative").exists()


def test_a_run_already_at_or_past_stop_after_says_so_in_one_line(
        tmp_path, capsys, listops_cache):
    """Resumed at or past --stop-after, nothing is trained and one line says so, also
    without --quiet, where the trainer's own messages are printed."""
    args = ["lra", "train", "listops", "--attn", "softmax", "--steps", "6", "--eval-every", "3",
            "--batch-size", "16", "--cache", str(listops_cache), "--out", str(tmp_path),
            "--no-tensorboard"]
    assert main([*args, "--stop-after", "4"]) == 0
    capsys.readouterr()
    for stop, said in (("4", "nothing trained: the run is already at step 4 (--stop-after 4); "
                        "to go on, resume with a later --stop-after or none"),
                       ("2", "nothing trained: the run is already at step 4, past --stop-after "
                        "2; to go on, resume with a later --stop-after or none")):
        assert main([*args, "--stop-after", stop, "--resume"]) == 0
        out = capsys.readouterr().out
        assert [line for line in out.splitlines() if "stop" in line] == [said], out
        assert load_checkpoint(tmp_path / "last.pt")["state"]["step"] == 4


def test_model_shape_flags_set_the_model(tmp_path, capsys, listops_cache):
    """--dim, --hidden, --heads and --layers override the preset's model, and the run's
    config records them."""
    assert main(["lra", "train", "listops", "--attn", "softmax", "--steps", "2",
                 "--eval-every", "2", "--batch-size", "16", "--dim", "24", "--hidden", "40",
                 "--heads", "3", "--layers", "1", "--cache", str(listops_cache),
                 "--out", str(tmp_path), "--no-tensorboard", "--quiet"]) == 0
    config = json.loads((tmp_path / "result.json").read_text())["config"]
    assert (config["dim"], config["hidden"], config["heads"], config["layers"]) == (24, 40, 3, 1)
    weights = load_checkpoint(tmp_path / "last.pt")["model"]
    assert weights["encoder.tokens.weight"].shape[1] == 24
    assert sum(name.endswith("norm1.weight") for name in weights) == 1
    assert any(w.shape == (40, 24) for w in weights.values())


def test_user_errors_are_one_line(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "imgs").mkdir()
    cases = [
        (["lra", "prepare", "listops", "--src", str(tmp_path / "none")], "does not exist"),
        (["lra", "prepare", "listops", "--src", str(tmp_path), "--dev-fraction", "0.1"],
         "--dev-fraction does not apply to listops"),
        (["lra", "prepare", "text", "--src", str(tmp_path), "--listops-tokens", "reference"],
         "--listops-tokens does not apply to text"),
        (["lra", "train", "image", "--cache", str(tmp_path)], "lra prepare image"),
        (["lra", "train", "listops", "--attn", "nope", "--cache", str(tmp_path)],
         "unknown attention method 'nope'"),
        (["lra", "generate", "listops", "--out", str(tmp_path), "--max-args", "1"],
         "max_args must be at least 2"),
        (["lra", "report", str(tmp_path)], "no result.json"),
        (["lra", "train", "listops", "--dim", "63", "--cache", str(tmp_path)],
         "dim (--dim) must be divisible by heads (--heads), got 63 and 2"),
        (["lra", "train", "listops", "--layers", "0", "--cache", str(tmp_path)],
         "layers (--layers) must be a positive integer, got 0"),
        (["lra", "train", "listops", "--dropout", "1", "--cache", str(tmp_path)],
         "dropout (--dropout) must be in [0, 1), got 1.0"),
        (["lra", "generate", "pathfinder", "--out", str(used), "--count", "2"],
         "or pass --replace to replace"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys, listops_cache):
    """Every lra output path that cannot be written (a file where a folder is needed, a
    folder where a file is needed) is named in one line before data is read or trained."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cache = ["--cache", str(listops_cache)]
    train = ["lra", "train", "listops", "--attn", "softmax", "--steps", "2", "--eval-every", "1",
             "--batch-size", "16", *cache, "--no-tensorboard", "--quiet"]
    cases = [
        ([*train, "--out", str(afile)], "is a file; choose another path"),
        ([*train, "--out", str(afile / "run")], "is a file, not a folder"),
        ([*train, "--seeds", "0", "1", "--out", str(afile)], "is a file, not a folder"),
        (["lra", "generate", "listops", "--out", str(afile / "data")], "is a file, not a folder"),
        (["lra", "prepare", "listops", "--src", str(tmp_path), "--cache", str(afile)],
         "is a file; choose another path"),
        (["lra", "report", str(tmp_path), "--markdown", str(tmp_path)], "is a folder"),
        (["lra", "report", str(tmp_path), "--plot", str(afile / "f.png")],
         "is a file, not a folder"),
        (["lra", "stability", "--steps", "1", "--batch-size", "16", *cache, "--json",
          str(tmp_path)], "is a folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert message in captured.err and "Errno" not in captured.err, (argv, captured.err)
        assert captured.out == "", (argv, captured.out)


def test_a_seed_given_twice_is_refused_before_any_run(tmp_path, capsys, listops_cache):
    """--seeds 0 0 1 would train seed 0, then fail on its own folder and never reach 1."""
    cache = ["--cache", str(listops_cache)]
    for argv in (["train", "listops", "--steps", "2", "--eval-every", "1", "--batch-size", "16",
                  "--out", str(tmp_path / "runs"), "--no-tensorboard", "--quiet"],
                 ["stability", "--steps", "1", "--batch-size", "16"]):
        assert main(["lra", *argv, *cache, "--seeds", "0", "0", "1"]) == 2
        captured = capsys.readouterr()
        assert "--seeds lists 0 more than once" in captured.err and captured.out == ""
    assert not (tmp_path / "runs").exists()


def test_an_option_given_twice_is_refused(tmp_path, capsys, listops_cache):
    """--option num_features=8 --option num_features=16 ran with 16 alone, silently."""
    assert main(["lra", "train", "listops", "--steps", "2", "--batch-size", "16", "--cache",
                 str(listops_cache), "--out", str(tmp_path / "run"), "--no-tensorboard",
                 "--option", "num_features=8", "--option", "num_features=16"]) == 2
    captured = capsys.readouterr()
    assert "--option lists num_features more than once" in captured.err and captured.out == ""
    assert not (tmp_path / "run").exists()


def test_report_refuses_a_plot_format_matplotlib_lacks_before_writing(tmp_path, capsys):
    """--plot figure.txt wrote --markdown first, then failed in matplotlib's words."""
    pytest.importorskip("matplotlib")
    assert main(["lra", "report", str(tmp_path), "--markdown", str(tmp_path / "t.md"),
                 "--plot", str(tmp_path / "figure.txt")]) == 2
    err = capsys.readouterr().err
    assert f"--plot {tmp_path / 'figure.txt'}: matplotlib writes " in err and ".png" in err
    assert not (tmp_path / "t.md").exists()


def test_a_warmup_as_long_as_the_run_is_noted(tmp_path, capsys, listops_cache):
    """--steps 200 kept ListOps' 1000-step warm-up: the learning rate never reached --lr
    and never decayed, and the run looked as if it did not learn, without a word."""
    assert main(["lra", "train", "listops", "--attn", "softmax", "--steps", "2",
                 "--batch-size", "16", "--cache", str(listops_cache), "--out",
                 str(tmp_path / "run"), "--no-tensorboard", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert ("the warm-up of 1000 steps (--warmup where given, else the task's preset or "
            "--quick's) is not shorter than the run's 2 steps: the learning rate rises for the "
            "whole run") in \
        captured.err + captured.out
    assert main(["lra", "train", "listops", "--attn", "softmax", "--steps", "2", "--warmup",
                 "1", "--batch-size", "16", "--cache", str(listops_cache), "--out",
                 str(tmp_path / "short"), "--no-tensorboard", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "the warm-up of" not in captured.err + captured.out


def test_an_option_in_the_brackets_and_in_option_is_refused(tmp_path, capsys, listops_cache):
    """--attn "skyformer[num_features=16]" --option num_features=8 ran with 8, in a folder
    named after 16."""
    assert main(["lra", "train", "listops", "--attn", "skyformer[num_features=16]", "--steps",
                 "2", "--cache", str(listops_cache), "--out", str(tmp_path / "run"),
                 "--no-tensorboard", "--option", "num_features=8"]) == 2
    assert ("--option num_features sets what --attn skyformer[num_features=16] sets in its "
            "brackets (num_features=16); give it one way.") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_every_seed_folder_is_checked_before_the_first_seed_trains(
        tmp_path, capsys, listops_cache):
    """A later seed's folder that holds a run (without --resume), or a run of other
    settings (with --resume), is refused before seed 0 trains, not after."""
    args = ["lra", "train", "listops", "--attn", "softmax", "--steps", "2", "--eval-every", "1",
            "--warmup", "1", "--batch-size", "16", "--cache", str(listops_cache),
            "--no-tensorboard", "--quiet"]
    assert main([*args, "--seed", "2", "--out", str(tmp_path / "seed2")]) == 0
    for extra, said in (([], "seed2 already holds a run (last.pt); pass --resume"),
                        (["--resume", "--lr", "0.01"], "seed2/last.pt: the settings differ")):
        assert main([*args, *extra, "--seeds", "0", "2", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
        assert not (tmp_path / "seed0").exists()


def test_full_dev_and_eval_batches_are_refused_together(tmp_path, capsys, listops_cache):
    """--full-dev dropped --eval-batches without a word: the run evaluated on all of dev."""
    with pytest.raises(SystemExit) as exit_:
        main(["lra", "train", "listops", "--full-dev", "--eval-batches", "5", "--steps", "1",
              "--batch-size", "16", "--cache", str(listops_cache), "--out", str(tmp_path / "run"),
              "--no-tensorboard", "--quiet"])
    assert exit_.value.code == 2
    assert "--eval-batches: not allowed with argument --full-dev" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_task_given_twice_to_stability_is_refused(tmp_path, capsys, listops_cache):
    """--tasks listops listops measured listops twice and showed it in two columns."""
    assert main(["lra", "stability", "--tasks", "listops", "listops", "--methods", "kernelized",
                 "--steps", "1", "--batch-size", "16", "--cache", str(listops_cache)]) == 2
    captured = capsys.readouterr()
    assert "--tasks lists listops more than once; give each task once." in captured.err
    assert captured.out == ""


def test_stability_progress_lines_are_flushed_to_stderr(monkeypatch, listops_cache):
    """``skyformer lra stability 2> log``: each 'mean tau' line reaches the log when
    measured (it sat in a buffer until the run ended), on stderr as bench's progress, so
    that stdout holds the table alone."""
    recorder, out = FlushRecorder(), FlushRecorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["lra", "stability", "--tasks", "listops", "--methods", "kernelized",
                 "--steps", "1", "--batch-size", "16", "--cache", str(listops_cache)]) == 0
    assert "listops kernelized seed 0: mean tau" in recorder.flushed
    assert "mean tau" not in out.getvalue()


def test_stability_json_records_features_options_command_and_environment(
        tmp_path, capsys, listops_cache):
    """Two files measured with other --features differed only in their numbers."""
    argv = ["lra", "stability", "--tasks", "listops", "--methods", "skyformer", "kernelized",
            "--steps", "1", "--batch-size", "16", "--features", "4", "--cache",
            str(listops_cache), "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["num_features"] == 4
    options = data["attention_options"]["listops"]
    assert set(options) == {"softmax", "skyformer", "kernelized"}
    assert options["skyformer"]["num_features"] == 4 and "num_features" not in options["softmax"]
    assert "attention_options" not in data["settings"]["listops"]
    assert data["command"].startswith("skyformer lra stability --tasks listops")
    assert data["environment"]["device"] == "cpu" and "torch" in data["environment"]


def test_stability_resume_measures_only_what_an_interrupted_run_left(
        tmp_path, capsys, listops_cache, monkeypatch):
    """--json was written at the end only: a run killed in its last measurement lost
    all the others."""
    from skyformer.lra import stability

    out = tmp_path / "s.json"
    argv = ["lra", "stability", "--tasks", "listops", "--methods", "kernelized", "--steps",
            "1", "--batch-size", "16", "--cache", str(listops_cache), "--json", str(out)]
    measure = stability.instability_taus
    calls = []

    def interrupted(cfg, *args, **kwargs):
        calls.append(cfg.attention)
        if cfg.attention == "kernelized" and len(calls) == 2:
            raise KeyboardInterrupt
        return measure(cfg, *args, **kwargs)

    monkeypatch.setattr(stability, "instability_taus", interrupted)
    assert main(argv) == 130
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and list(kept["taus"]["listops"]["softmax"]) == ["0"]
    kept["taus"]["listops"]["softmax"]["0"][0] = None  # a NaN tau, as the file holds it
    out.write_text(json.dumps(kept))  # (resumed, it raised a TypeError in the ratio)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert calls == ["softmax", "kernelized", "kernelized"]
    assert f"resuming from {out}" in captured.err and "softmax seed" not in captured.out
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["taus"]["listops"]["softmax"] == \
        kept["taus"]["listops"]["softmax"]
    assert data["ratios"]["listops"]["kernelized"] is None  # NaN, written as null
    assert set(data["ratios"]["listops"]) == {"kernelized"}


def test_stability_resume_needs_json_and_a_stability_file(tmp_path, capsys, listops_cache):
    base = ["lra", "stability", "--tasks", "listops", "--methods", "kernelized", "--steps",
            "1", "--batch-size", "16", "--cache", str(listops_cache), "--resume"]
    assert main(base) == 2
    assert "--resume continues the taus written to --json; give --json." in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    (tmp_path / ".other.json.abcdefgh.tmp").write_text("cut short")  # a killed write's
    assert main([*base, "--json", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {other}: not an lra stability result" in err
    assert "removed 1 temporary file(s)" in err and sorted(os.listdir(tmp_path)) == \
        ["other.json"]
    # hand-edited files whose parts have other shapes: raw tracebacks, or int('x')'s words
    for text, problem in [
        ('{"taus": {"listops": []}}', "its taus of listops are no object of methods"),
        ('{"taus": {}, "settings": [], "environment": []}', "its settings is no object"),
        ('{"taus": {}, "attention_options": {"listops": []}}',
         "its attention_options of listops is no object"),
        ('{"taus": {"listops": {"softmax": {"x": [1]}}}}',
         "its taus of softmax on listops name the seed 'x'"),
        ('{"taus": {"listops": {"softmax": {"0": [1, "a"]}}}}',
         "its taus of softmax on listops, seed 0, are no list of numbers"),
    ]:
        other.write_text(text)
        assert main([*base, "--json", str(other)]) == 2
        err = capsys.readouterr().err
        assert f"cannot resume from {other}: not an lra stability result as --json writes " \
            f"it ({problem}" in err and "Traceback" not in err


def test_prepare_refuses_a_max_len_below_one_by_its_flag_before_reading(tmp_path, capsys):
    """It said 'max_len must be ...' after reading every release file (here: none, so
    it named a missing file instead)."""
    assert main(["lra", "prepare", "listops", "--src", str(tmp_path), "--cache",
                 str(tmp_path / "cache"), "--max-len", "0"]) == 2
    assert "--max-len must be a positive integer, got 0." in capsys.readouterr().err


def test_stability_resume_refuses_to_drop_taus_the_file_holds(tmp_path, capsys, listops_cache):
    """Resumed with fewer --seeds (or methods, tasks), the file was rewritten without the
    taus of the others: measurements lost without a word."""
    out = tmp_path / "s.json"
    base = ["lra", "stability", "--tasks", "listops", "--methods", "kernelized", "--steps",
            "1", "--batch-size", "16", "--cache", str(listops_cache), "--json", str(out)]
    assert main([*base, "--seeds", "0", "1"]) == 0
    before = out.read_text()
    capsys.readouterr()
    assert main([*base, "--seeds", "1", "--resume"]) == 2
    assert (f"{out} holds taus this run does not ask for (listops softmax seed 0, listops "
            "kernelized seed 0)") in capsys.readouterr().err
    assert out.read_text() == before
    assert main([*base, "--seeds", "0", "1", "2", "--resume"]) == 0  # more is fine
    capsys.readouterr()
    before = out.read_text()  # without --resume the file was rewritten: every tau lost
    assert main([*base, "--seeds", "0"]) == 2
    assert (f"{out} holds the taus of an earlier run, which this run would replace: pass "
            f"--resume to continue them, or write to another --json") in capsys.readouterr().err
    assert out.read_text() == before


@pytest.mark.parametrize(("given", "value"), [
    ("shared_qk=True", True), ("shared_qk=true", True), ("shared_qk=False", False)])
def test_an_option_takes_the_words_a_variant_takes(tmp_path, capsys, listops_cache, given,
                                                   value):
    """--option shared_qk=True failed with "shared_qk must be True or False, got 'True'"
    where "reformer[shared_qk=True]" ran: the option's value stayed the string."""
    assert main(["lra", "train", "listops", "--attn", "reformer", "--steps", "1",
                 "--batch-size", "16", "--eval-every", "1", "--cache", str(listops_cache),
                 "--out", str(tmp_path / "run"), "--no-tensorboard", "--quiet",
                 "--option", given]) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["config"]["attention_options"] == {"shared_qk": value}


def test_an_option_set_to_none_is_none(tmp_path, capsys, listops_cache):
    assert main(["lra", "train", "listops", "--attn", "performer", "--steps", "1",
                 "--batch-size", "16", "--eval-every", "1", "--cache", str(listops_cache),
                 "--out", str(tmp_path / "run"), "--no-tensorboard", "--quiet",
                 "--option", "feature_redraw_interval=None"]) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["config"]["attention_options"] == {"feature_redraw_interval": None}


def test_stability_refuses_a_second_run_writing_the_same_json(tmp_path, capsys, listops_cache):
    """--json is rewritten after every measurement: two runs with one file (a job requeued
    while the first still runs) wrote each over the other's taus."""
    from skyformer.io import results_lock

    out = tmp_path / "s.json"
    argv = ["lra", "stability", "--tasks", "listops", "--methods", "kernelized", "--steps",
            "1", "--batch-size", "16", "--cache", str(listops_cache), "--json", str(out)]
    with results_lock(out):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out} is being written by another run (process" in err
    assert "choose another --json" in err and not out.exists()


def test_the_commands_task_names_are_the_tasks_and_presets_says_the_quick_batch(capsys):
    from skyformer.cli.lra_cmd import TASK_NAMES
    from skyformer.lra.presets import QUICK_MAX_BATCH
    from skyformer.lra.tasks import TASKS

    assert tuple(TASKS) == TASK_NAMES
    assert main(["lra", "presets"]) == 0
    assert f"batch_size<={QUICK_MAX_BATCH}" in capsys.readouterr().out


def test_every_option_of_train_generate_and_stability_says_what_it_sets():
    """lra train --help listed --steps, --lr, --warmup ... with no word, and lra generate
    listops none of the defaults docs/lra.md gives."""
    import argparse

    from skyformer.cli import build_parser

    def subparsers(parser):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices

    lra = subparsers(build_parser())["lra"]
    commands = subparsers(lra)
    parsers = [commands["train"], commands["stability"], *subparsers(commands["generate"])
               .values()]
    silent = [f"{p.prog} {a.option_strings[-1]}" for p in parsers for a in p._actions
              if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert silent == []
