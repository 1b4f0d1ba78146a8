"""Output files: paths that cannot be written are refused before any work, with a
sentence; written files are readable by all (0644) and figures appear atomically."""

from __future__ import annotations

import os
import stat

import pytest

from skyformer.cli import main
from skyformer.io import check_output_path, save_figure


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


def test_a_file_path_ending_in_a_separator_is_refused(tmp_path, capsys):
    """``--json out/`` or ``--out results/`` names a folder: writing ``out`` or
    ``results.json`` next to it instead would put the results where nobody looks."""
    with pytest.raises(IsADirectoryError, match="ends in a path separator"):
        check_output_path(f"{tmp_path / 'new'}{os.sep}")
    check_output_path(f"{tmp_path / 'new'}{os.sep}", folder=True)
    for argv in (["compare", "--json"], ["bench", "--methods", "linear", "--out"]):
        assert main([*argv, f"{tmp_path / 'results'}{os.sep}"]) == 2
        assert "ends in a path separator" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


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
