"""Output files: paths that cannot be written are refused before any work, with a
sentence; written files are readable by all (0644) and figures appear atomically."""

from __future__ import annotations

import os
import stat

import pytest

from skyformer.cli import main
from skyformer.io import check_output_path, save_figure, write_json


def test_unwritable_output_paths_are_refused_up_front(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        check_output_path(afile / "out.json")
    with pytest.raises(IsADirectoryError, match="is a folder; choose a file name"):
        check_output_path(tmp_path)
    with pytest.raises(NotADirectoryError, match=r"output folder .* is a file"):
        check_output_path(afile, folder=True)
    check_output_path(tmp_path / "new" / "deeper" / "out.json")  # creatable: fine
    check_output_path(None)
    # "" was let through: approx --out "" wrote its files (and lock) into the current
    # folder, and compare --json "" wrote nothing without a word
    for folder in (False, True):
        with pytest.raises(ValueError, match="the output path is empty; give a file or folder"):
            check_output_path("", folder=folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_device_or_named_pipe_is_refused_as_an_output_file(tmp_path, capsys):
    """``--json /dev/stdout`` (or a FIFO, or a link to /dev/null) ran the study, then
    renamed the result file over the name: the pipe became a plain file, and as root
    /dev/stdout or /dev/null would have; such a path is refused before any work."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a named pipe, not a regular file"):
        check_output_path(fifo)
    with pytest.raises(ValueError, match="is a named pipe"):
        write_json(fifo, {"a": 1})
    assert main(["compare", "--methods", "nope", "--json", str(fifo)]) == 2
    assert "is a named pipe, not a regular file" in capsys.readouterr().err
    if os.path.exists(os.devnull):
        (tmp_path / "null").symlink_to(os.devnull)
        with pytest.raises(ValueError, match="is a character device"):
            check_output_path(tmp_path / "null")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(os.listdir(tmp_path)) == sorted(
        ["fifo"] + (["null"] if os.path.exists(os.devnull) else []))


def test_a_file_path_ending_in_a_separator_is_refused(tmp_path, capsys):
    """``--json out/`` or ``--out results/`` names a folder: writing ``out`` or
    ``results.json`` next to it instead would put the results where nobody looks."""
    with pytest.raises(IsADirectoryError, match="ends in a path separator"):
        check_output_path(f"{tmp_path / 'new'}{os.sep}")
    check_output_path(f"{tmp_path / 'new'}{os.sep}", folder=True)
    assert main(["compare", "--json", f"{tmp_path / 'results'}{os.sep}"]) == 2
    assert "ends in a path separator" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("made", [False, True])
def test_bench_out_naming_a_folder_writes_bench_files_in_it(tmp_path, made):
    """``bench --out DIR/`` (or an existing folder) writes DIR/bench.json, .csv (and
    .png), as the other commands' ``--out DIR`` write into a folder; any other path is
    the files' prefix."""
    folder = tmp_path / "results"
    if made:
        folder.mkdir()
    out = str(folder) if made else f"{folder}{os.sep}"
    assert main(["bench", "--methods", "linear", "--seq-lens", "16", "--shapes", "1,1,4",
                 "--no-memory", "--repeats", "1", "--no-plot", "--out", out]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["bench.csv", "bench.json"]


@pytest.mark.parametrize("taken", ["bench.json", "bench.csv", "bench.png"])
def test_bench_refuses_an_unwritable_result_file_before_measuring(tmp_path, capsys,
                                                                  monkeypatch, taken):
    """--out PREFIX writes PREFIX.json, .csv and .png: a folder at one of those paths is
    refused before the first measurement (the prefix itself was all that was checked);
    without a plot, a folder at PREFIX.png is no obstacle."""
    import skyformer.eval.bench.run as bench_run

    measured = []
    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: measured.append(1) or [])
    (tmp_path / taken).mkdir()
    argv = ["bench", "--methods", "softmax", "--seq-lens", "16", "--shapes", "1,1,4",
            "--no-memory", "--out", str(tmp_path / "bench")]
    if taken == "bench.png":
        pytest.importorskip("matplotlib")
        assert main([*argv, "--no-plot"]) == 0 and measured == [1]
        measured.clear()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"the output file {tmp_path / taken} is a folder" in err and measured == []


def test_cli_names_an_unwritable_path_without_a_traceback(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(["compare", "--methods", "softmax", "--seq-len", "16",
                 "--json", str(afile / "x.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "skyformer compare: error: cannot write" in err and "Traceback" not in err


def test_figures_are_written_atomically_and_readable(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    path = save_figure(fig, tmp_path / "plot.png", dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]  # no temporary left


PNG = b"\x89PNG\r\n\x1a\n stale"


def test_a_run_without_plots_removes_the_plots_an_earlier_run_left(tmp_path):
    """Without plots (or without the part a plot shows), the PNGs of an earlier run in the
    same place are removed: they would sit beside result files they no longer match."""
    from skyformer.eval.approx import ApproxConfig, run_approx
    from skyformer.eval.approx.report import FILES, write_outputs

    names = [FILES[kind] for kind in ("errors", "spectra", "leverage")]
    for name in names:
        (tmp_path / name).write_bytes(PNG)
    (tmp_path / "other.png").write_bytes(PNG)
    config = ApproxConfig(sources=("gaussian",), seq_lens=(12,), features=(4,), seeds=(0,),
                          heads=(0,), analysis=False, progress=False, methods=("skyformer",))
    written = write_outputs(run_approx(config, log=lambda s: None), tmp_path, plots=False)
    assert set(written) == {"json", "csv", "report"}
    assert not any((tmp_path / name).exists() for name in names)
    assert (tmp_path / "other.png").exists()  # not a name of this command: kept

    prefix = tmp_path / "bench"
    (tmp_path / "bench.png").write_bytes(PNG)
    assert main(["bench", "--methods", "linear", "--seq-lens", "16", "--shapes", "1,1,4",
                 "--repeats", "1", "--warmup", "0", "--no-memory", "--no-error",
                 "--out", str(prefix), "--no-plot"]) == 0
    assert (tmp_path / "bench.json").exists() and not (tmp_path / "bench.png").exists()


def test_hf_eval_without_a_plot_removes_the_plot_an_earlier_run_left(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import skyformer.eval.hf.run as hf_run

    result = SimpleNamespace(texts={}, model="m", rows=[], to_dict=lambda: {
        "config": {}, "environment": {}, "rows": []})
    monkeypatch.setattr(hf_run, "evaluate", lambda config, progress=None: result)
    (tmp_path / "hf_eval.png").write_bytes(PNG)
    assert main(["hf-eval", "--methods", "softmax", "--quiet", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "hf_eval.json").exists() and not (tmp_path / "hf_eval.png").exists()


def test_hf_eval_without_matplotlib_says_so_before_evaluating(tmp_path, monkeypatch, capsys):
    """Its files are replaced together after the plot: a missing matplotlib must stop the
    command before the evaluation, not lose the evaluation's files at the end."""
    import builtins

    import skyformer.eval.hf.run as hf_run

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    evaluated = []
    monkeypatch.setattr(hf_run, "evaluate", lambda config, progress=None: evaluated.append(1))
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["hf-eval", "--methods", "softmax", "--quiet", "--out", str(tmp_path)]) == 2
    assert "pip install 'skyformer[plot]' (or pass --no-plots)." in capsys.readouterr().err
    assert evaluated == [] and list(tmp_path.iterdir()) == []
    # lra report has no --no-plots: its way out is to leave out --plot
    assert main(["lra", "report", str(tmp_path), "--plot", str(tmp_path / "f.png")]) == 2
    assert "(or leave out --plot)." in capsys.readouterr().err


def test_bench_without_matplotlib_says_so_before_measuring(tmp_path, monkeypatch, capsys):
    """bench --out plots at the end of a run that may take hours: a missing matplotlib
    stops it before the first measurement; without --out (no plot) or with --no-plot it
    runs."""
    import builtins

    import skyformer.eval.bench.run as bench_run

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    measured = []
    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: measured.append(1) or [])
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    argv = ["bench", "--methods", "softmax", "--seq-lens", "16", "--shapes", "1,1,4",
            "--no-memory", "--repeats", "1", "--warmup", "0"]
    assert main([*argv, "--out", str(tmp_path / "bench")]) == 2
    assert "pip install 'skyformer[plot]' (or pass --no-plot)." in capsys.readouterr().err
    assert measured == [] and list(tmp_path.iterdir()) == []
    assert main([*argv, "--out", str(tmp_path / "bench"), "--no-plot"]) == 0
    assert main(argv) == 0 and measured == [1, 1]


def test_an_interrupted_approx_write_keeps_the_earlier_run_whole(tmp_path, monkeypatch):
    """approx writes JSON, CSV, plots and a report: interrupted while a plot is drawn it
    leaves the earlier run's files, none replaced, and no staging folder; completed it
    replaces them all."""
    from skyformer.eval.approx import ApproxConfig, run_approx
    from skyformer.eval.approx import plots as approx_plots
    from skyformer.eval.approx.report import FILES, write_outputs

    config = ApproxConfig(sources=("gaussian",), seq_lens=(12,), features=(4,), seeds=(0,),
                          heads=(0,), analysis=False, progress=False, methods=("skyformer",))
    result = run_approx(config, log=lambda s: None)
    for kind in ("json", "csv", "report"):
        (tmp_path / FILES[kind]).write_text("earlier run")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(approx_plots, "plot_errors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_outputs(result, tmp_path, plots=True)
    assert all((tmp_path / FILES[kind]).read_text() == "earlier run"
               for kind in ("json", "csv", "report"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        FILES[kind] for kind in ("json", "csv", "report"))
    monkeypatch.undo()
    written = write_outputs(result, tmp_path, plots=True)
    assert set(written) == {"json", "csv", "errors", "report"}
    assert all(p.read_bytes() != b"earlier run" for p in written.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written.values())
