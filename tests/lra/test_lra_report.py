"""Tables 1-2 and Figure 2 from finished runs."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from skyformer.lra import make_config
from skyformer.lra.report import collect_runs, plot_dev_curves, tables
from skyformer.lra.tasks import TASKS


def _fake_run(root, task, method, seed, accuracy, seconds=7200.0, memory=2**30, **extra):
    folder = root / task / method / f"seed{seed}"
    folder.mkdir(parents=True)
    result = {"task": task, "attention": method, "seed": seed, "test_accuracy": accuracy,
              "train_seconds": seconds, "peak_memory_bytes": memory, "steps": 50_000,
              "peak_memory_kind": "cuda max_memory_allocated", **extra}
    (folder / "result.json").write_text(json.dumps(result))
    rows = [{"kind": "dev", "step": s, "seconds": s / 10, "accuracy": accuracy * s / 300}
            for s in (100, 200, 300)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_tables_average_seeds_and_tasks(tmp_path):
    for seed, acc in enumerate((0.60, 0.62, 0.64)):
        _fake_run(tmp_path, "text", "skyformer", seed, acc)
    _fake_run(tmp_path, "listops", "skyformer", 0, 0.38, seconds=3600, memory=3 * 2**30)
    _fake_run(tmp_path, "listops", "softmax", 0, 0.36)
    text = tables(collect_runs([tmp_path]))
    std = statistics.stdev([60, 62, 64])
    row = next(line for line in text.splitlines() if line.startswith("| skyformer |")
               and "±" in line)
    assert f"62.00 ± {std:.2f} (3)" in row and "38.00 (1)" in row
    assert row.rstrip(" |").endswith(f"{(62 + 38) / 2:.2f}")  # average over its tasks
    assert row.index("62.00") < row.index("38.00"), "paper order: Text before ListOps"
    time_row = [line for line in text.splitlines() if line.startswith("| skyformer |")][1]
    assert "| 2.000 | 1.000 | 1.000 | 3.000 |" in time_row
    assert "softmax" in text and "Notes" not in text


def test_a_short_runs_hours_and_memory_keep_their_digits(tmp_path):
    """Table 2 printed three decimals: a 10-second run showed 0.000 hours."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.36, seconds=10.0, memory=2**20)
    time_row = [line for line in tables(collect_runs([tmp_path])).splitlines()
                if line.startswith("| softmax |")][1]
    assert time_row == "| softmax | 0.0028 | 0.00098 |"


def test_a_one_second_run_keeps_positional_notation(tmp_path):
    """Two significant digits by ``.2g`` printed 2.8e-04 hours for a one-second run."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.36, seconds=1.0, memory=2**10)
    time_row = [line for line in tables(collect_runs([tmp_path])).splitlines()
                if line.startswith("| softmax |")][1]
    assert time_row == "| softmax | 0.00028 | 0.00000095 |"


@pytest.mark.parametrize(("seconds", "hours"), [(18.0, "0.0050"), (35.99, "0.010")])
def test_a_small_mean_keeps_two_significant_digits_after_rounding(tmp_path, seconds, hours):
    """0.005 hours printed 0.005 (one digit), and 0.0099996 printed 0.01 beside the
    three decimals of 0.010 and above."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.36, seconds=seconds, memory=2**30)
    time_row = [line for line in tables(collect_runs([tmp_path])).splitlines()
                if line.startswith("| softmax |")][1]
    assert time_row == f"| softmax | {hours} | 1.000 |"


def test_synthetic_and_short_runs_are_flagged(tmp_path):
    _fake_run(tmp_path, "pathfinder", "softmax", 0, 0.7, synthetic_data=True)
    _fake_run(tmp_path, "text", "softmax", 0, 0.5, dev_is_test=True)
    folder = _fake_run(tmp_path, "image", "softmax", 0, 0.4)
    result = json.loads((folder / "result.json").read_text())
    (folder / "result.json").write_text(json.dumps({**result, "steps": 200}))
    text = tables(collect_runs([tmp_path]))
    assert "pathfinder/softmax: synthetic data" in text
    assert "text/softmax: the dev split is the test split" in text
    assert "image/softmax: trained for 200 steps" in text


def test_a_diverged_run_is_noted_whether_or_not_its_result_records_the_step(tmp_path):
    """A result records diverged_at_step; one written before it did is known by its
    test loss, written null when not finite."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.12, test_loss=None)
    _fake_run(tmp_path, "listops", "softmax", 1, 0.12, test_loss=None, diverged_at_step=500)
    _fake_run(tmp_path, "listops", "softmax", 2, 0.30, test_loss=1.8, diverged_at_step=None)
    text = tables(collect_runs([tmp_path]))
    assert ("- listops/softmax: diverged (training loss not finite) in seed(s) 0 (its test "
            "loss is not finite), 1 at step 500; its numbers are of the best dev checkpoint, "
            "which may be from before.") in text


def test_figure_two_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    _fake_run(tmp_path, "text", "skyformer", 0, 0.6)
    _fake_run(tmp_path, "text", "softmax", 0, 0.55)
    runs = collect_runs([tmp_path])
    assert [x for x, _ in runs[0].dev_curve] == [10.0, 20.0, 30.0]
    path = plot_dev_curves(runs, tmp_path / "fig" / "figure2.png")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def _first_panel(tmp_path, monkeypatch):
    """The first panel of Figure 2 drawn from the runs under ``tmp_path`` (not saved)."""
    figures = []
    monkeypatch.setattr("skyformer.lra.report.save_figure",
                        lambda fig, path, **kw: figures.append(fig) or path)
    plot_dev_curves(collect_runs([tmp_path]), tmp_path / "figure2.png")
    return figures[0].axes[0]


def test_figure_two_draws_each_table_row_as_its_own_curve(tmp_path, monkeypatch):
    """Runs of one method with other settings are rows of their own in the tables; the
    figure names them as the rows are named, each row in its own colour (they were one
    legend entry, in one colour, so the curves could not be told apart)."""
    pytest.importorskip("matplotlib")
    config = {"task": "listops", "attention": "skyformer", "steps": 50_000, "lr": 1e-4}
    for root, seed, changes in (("a", 0, {}), ("b", 1, {}), ("c", 0, {"lr": 1e-3})):
        _fake_run(tmp_path / root, "listops", "skyformer", seed, 0.3,
                  config={**config, "seed": seed, **changes})
    ax = _first_panel(tmp_path, monkeypatch)
    assert ax.get_legend_handles_labels()[1] == ["skyformer", "skyformer (lr=0.001)"]
    colours = [str(line.get_color()) for line in ax.get_lines()]  # one curve per run
    assert len(colours) == 3 and len(set(colours)) == 2


def test_figure_two_says_the_settings_every_curve_shares_once_under_the_title(
        tmp_path, monkeypatch):
    """Every row of a short CPU run differs from the preset in the same steps and lr: the
    legend repeated them in each entry and squeezed the panel; they now stand under the
    title, and an entry names what is its own (the tables keep the full names)."""
    pytest.importorskip("matplotlib")
    config = {"task": "listops", "steps": 2000, "lr": 1e-3}
    for attention, options in (("softmax", {}), ("skyformer", {"num_features": 32})):
        _fake_run(tmp_path, "listops", attention, 0, 0.3,
                  config={**config, "seed": 0, "attention": attention,
                          "attention_options": options})
    ax = _first_panel(tmp_path, monkeypatch)
    assert ax.get_legend_handles_labels()[1] == ["softmax", "skyformer (num_features=32)"]
    assert ax.get_title() == "ListOps\nlr=0.001, steps=2000"
    assert "| skyformer (lr=0.001, num_features=32, steps=2000) |" in tables(
        collect_runs([tmp_path]))


def test_figure_two_tells_more_than_ten_rows_apart_and_keeps_the_legend_off_the_curves(
        tmp_path, monkeypatch):
    """Twelve rows: colours came from tab10 modulo 10 (rows 1 and 11 alike) and the legend
    sat inside the panel, over the curves; now each row has its own look and the legend
    stands beside the panel."""
    pytest.importorskip("matplotlib")
    config = {"task": "listops", "attention": "skyformer", "steps": 50_000}
    for i in range(12):
        _fake_run(tmp_path / f"r{i}", "listops", "skyformer", 0, 0.3,
                  config={**config, "seed": 0, "lr": 1e-4 * (i + 1)})
    figures = []
    monkeypatch.setattr("skyformer.lra.report.save_figure",
                        lambda fig, path, **kw: figures.append((fig, kw)) or path)
    plot_dev_curves(collect_runs([tmp_path]), tmp_path / "figure2.png")
    fig, saved = figures[0]
    ax = fig.axes[0]
    looks = {(str(line.get_color()), line.get_linestyle()) for line in ax.get_lines()}
    assert len(ax.get_lines()) == 12 and len(looks) == 12
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # beside the panel, not over it
    assert saved.get("bbox_inches") == "tight"  # and inside the saved image


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no result.json"):
        collect_runs([tmp_path])


@pytest.mark.parametrize("text", ["[1]", '{"task": "listops"}',
                                  '{"task": "sorting", "attention": "softmax"}'])
def test_a_result_json_of_another_kind_is_named(tmp_path, text):
    """A result.json that is not a training result (another tool's, below the same
    folder) is named with what it lacks, not a KeyError or TypeError in the tables."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "result.json").write_text(text)
    with pytest.raises(ValueError, match=r"other/result.json is not a result of `skyformer lra "
                       "train`"):
        tables(collect_runs([tmp_path]))


@pytest.mark.parametrize("field, value", [("test_accuracy", None), ("train_seconds", "2h"),
                                          ("peak_memory_bytes", True), ("steps", 1.5),
                                          ("test_accuracy", float("nan")),
                                          ("attention", 3)])
def test_a_result_json_with_a_value_of_another_type_is_named(tmp_path, field, value):
    """A hand-edited result.json (a null accuracy, a string of hours) names the field
    and the value, not a TypeError from inside the tables."""
    folder = _fake_run(tmp_path, "listops", "softmax", 0, 0.3)
    result = json.loads((folder / "result.json").read_text())
    (folder / "result.json").write_text(json.dumps({**result, field: value}))
    with pytest.raises(ValueError, match=rf"seed0/result.json is not a result of `skyformer "
                       rf"lra train` \({field} is {re.escape(json.dumps(value))}"):
        tables(collect_runs([tmp_path]))


def test_other_settings_are_rows_of_their_own_and_a_seed_counts_once(tmp_path):
    config = {"task": "listops", "attention": "skyformer", "steps": 50_000, "lr": 1e-4,
              "attention_options": {"num_features": 128}, "log_every": 100}

    def run(root, seed, accuracy, **changes):
        _fake_run(tmp_path / root, "listops", "skyformer", seed, accuracy,
                  config={**config, "seed": seed, **changes})

    run("a", 0, 0.30)
    run("a", 1, 0.40, log_every=7)  # logging does not change the experiment
    run("b", 0, 0.34)  # seed 0 again with the same settings
    run("c", 0, 0.20, lr=1e-3)
    run("d", 0, 0.10, attention_options={"num_features": 4})
    text = tables(collect_runs([tmp_path]))
    table1 = text.split("Table 2")[0]
    rows = [line for line in table1.splitlines() if line.startswith("| skyformer")]
    std = statistics.stdev([32, 40])  # seed 0: mean of 30 and 34
    assert rows == [f"| skyformer | 36.00 ± {std:.2f} (2) | 36.00 |",
                    "| skyformer (lr=0.001) | 20.00 (1) | 20.00 |",
                    "| skyformer (num_features=4) | 10.00 (1) | 10.00 |"]
    assert "seed(s) 0 ran more than once" in text


def test_only_settings_other_than_the_tasks_preset_are_labelled(tmp_path):
    """Runs with the paper's settings are one unlabelled row per method across tasks,
    however many variants a task also has; a variant is labelled with what it changed
    (Retrieval's preset lr is 2e-4, ListOps' 1e-4), not with what its cell's runs share."""
    def run(task, seed, accuracy, **changes):
        config = {**make_config(task, attention="linformer").to_dict(), "seed": seed, **changes}
        options = {"max_seq_len": changes.get("max_len") or TASKS[task].max_len}
        model = {"max_len": options["max_seq_len"], "attention_options": options}
        _fake_run(tmp_path / f"{task}{seed}{len(changes)}", task, "linformer", seed, accuracy,
                  config=config, model=model)

    run("listops", 0, 0.30)
    run("listops", 1, 0.40, lr=2e-4, log_every=7, checkpoint_every=9)
    run("retrieval", 0, 0.70, lr=2e-4)
    run("retrieval", 1, 0.80, max_len=100, log_every=7)
    rows = [line for line in tables(collect_runs([tmp_path])).split("Table 2")[0].splitlines()
            if line.startswith("| linformer")]
    assert rows == ["| linformer | 30.00 (1) | 70.00 (1) | 50.00 |",
                    "| linformer (lr=0.0002) | 40.00 (1) | - | 40.00 |",
                    "| linformer (max_len=100) | - | 80.00 (1) | 80.00 |"], rows


def test_a_plot_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    """The figures are made without pyplot: plotting from a notebook or a GUI program
    (here the svg backend, chosen before the call) must not switch the process to Agg,
    after which plt.show() shows nothing. In a process of its own (the backend is the
    process's)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, matplotlib\n"
            "from pathlib import Path\n"
            "from tests.lra.test_lra_report import _fake_run\n"
            "from skyformer.lra.report import collect_runs, plot_dev_curves\n"
            "out = Path(sys.argv[1])\n"
            "_fake_run(out, 'text', 'softmax', 0, 0.55)\n"
            "plot_dev_curves(collect_runs([out]), out / 'figure2.png')\n"
            "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n")
    env = {**os.environ, "MPLBACKEND": "svg",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["svg", "False"]
    assert (tmp_path / "figure2.png").read_bytes()[:4] == b"\x89PNG"


def test_the_library_never_picks_a_matplotlib_backend():
    """No module of the package imports pyplot or calls matplotlib.use (each would pick
    the process's backend for its caller); the figures use matplotlib.figure.Figure."""
    from pathlib import Path

    import skyformer

    package = Path(skyformer.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if "matplotlib.use(" in (text := p.read_text()) or "import matplotlib.pyplot"
                 in text or "from matplotlib import pyplot" in text]
    assert offenders == []


def test_a_default_typed_or_not_is_one_experiment(tmp_path):
    """Seeds of one experiment, one typing num_features=128 (skyformer's default) and one
    not, are one row: settings hold every option the attention ran with."""
    config = {"task": "listops", "attention": "skyformer", "steps": 50_000, "lr": 1e-4}
    for seed, options in ((0, {}), (1, {"num_features": 128})):
        _fake_run(tmp_path, "listops", "skyformer", seed, 0.3 + 0.1 * seed,
                  config={**config, "seed": seed, "attention_options": options})
    rows = [line for line in tables(collect_runs([tmp_path])).split("Table 2")[0].splitlines()
            if line.startswith("| skyformer")]
    assert len(rows) == 1 and "(2)" in rows[0], rows


def test_a_variant_and_its_method_with_the_same_options_are_one_experiment(tmp_path):
    """--attn "skyformer[num_features=32]" and --attn skyformer --option num_features=32
    train the same model: one row, named by the method and the option it changed."""
    config = {"task": "listops", "steps": 50_000, "lr": 1e-4}
    for seed, (attention, options) in enumerate((("skyformer[num_features=32]", {}),
                                                 ("skyformer", {"num_features": 32}))):
        _fake_run(tmp_path, "listops", attention, seed, 0.3 + 0.1 * seed,
                  config={**config, "seed": seed, "attention": attention,
                          "attention_options": options})
    _fake_run(tmp_path, "listops", "skyformer", 2, 0.9,
              config={**config, "seed": 2, "attention": "skyformer"})
    rows = [line for line in tables(collect_runs([tmp_path])).split("Table 2")[0].splitlines()
            if line.startswith("| skyformer")]
    std = statistics.stdev([30, 40])
    assert rows == ["| skyformer | 90.00 (1) | 90.00 |",
                    f"| skyformer (num_features=32) | 35.00 ± {std:.2f} (2) | 35.00 |"], rows


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "older result"])
def test_a_variant_of_a_method_not_registered_here_is_its_own_row(tmp_path, recorded):
    """A plugin's runs reported without --plugin: the variant's options, kept only in its
    name, were lost and its seeds averaged into the method's row."""
    config = {"task": "listops", "steps": 50_000, "lr": 1e-4}
    for seed, attention in enumerate(("mean_v", "mean_v[num_features=4]")):
        ran_with = {"attention_ran_with": {"num_features": 4 if seed else 8}} if recorded else {}
        _fake_run(tmp_path, "listops", attention, 0, 0.3 + 0.1 * seed,
                  config={**config, "seed": 0, "attention": attention,
                          "attention_options": {}}, **ran_with)
    text = tables(collect_runs([tmp_path]))
    rows = [line for line in text.split("Table 2")[0].splitlines()
            if line.startswith("| mean_v")]
    # with every option recorded both are named by it (the default is not known here)
    plain = "| mean_v (num_features=8) |" if recorded else "| mean_v |"
    assert sorted(rows) == sorted([f"{plain} 30.00 (1) | 30.00 |",
                                   "| mean_v (num_features=4) | 40.00 (1) | 40.00 |"]), rows
    assert "ran more than once" not in text


@pytest.mark.parametrize(("damage", "message"), [
    (lambda lines: [*lines[:-1], lines[-1][:-20]], r"line 3 is not JSON \("),
    (lambda lines: [lines[0].replace('"seconds": 10.0, ', ""), *lines[1:]],
     r"line 1 is a dev entry without seconds: the file is damaged; delete that line"),
])
def test_a_damaged_metrics_jsonl_is_named_with_its_line(tmp_path, damage, message):
    """A truncated line gave a JSON error without the file, a dev entry without seconds a
    KeyError with a traceback. Only the plot reads the file: the tables are made (they
    stopped at it, while the sentence said only the plot reads it)."""
    pytest.importorskip("matplotlib")
    folder = _fake_run(tmp_path, "listops", "softmax", 0, 0.4)
    metrics = folder / "metrics.jsonl"
    metrics.write_text("\n".join(damage(metrics.read_text().splitlines())) + "\n")
    runs = collect_runs([tmp_path])
    assert "| softmax |" in tables(runs)
    with pytest.raises(ValueError, match=rf"{re.escape(str(metrics))} {message}"):
        plot_dev_curves(runs, tmp_path / "figure2.png")


def test_runs_on_other_prepared_data_are_not_averaged_together(tmp_path):
    """The data a run recorded (meta.json) tells its rows apart, its source path and
    preparation time aside (the same files prepared again, or a moved copy, are the same
    data); each row names the records in which its task's runs differ."""
    data = {"format": 1, "task": "listops", "max_len": 2000, "created": "2026-01-01",
            "source": "/data/listops", "generated": {"seed": 0, "rules": {"max_depth": 10}}}
    _fake_run(tmp_path / "a", "listops", "softmax", 0, 0.30, data=data)
    _fake_run(tmp_path / "b", "listops", "softmax", 1, 0.40,
              data={**data, "created": "2026-02-02", "source": "/elsewhere/listops"})
    _fake_run(tmp_path / "c", "listops", "softmax", 0, 0.90, data={**data, "tokens": "reference"})
    _fake_run(tmp_path / "d", "listops", "softmax", 0, 0.20,
              data={**data, "generated": {"seed": 1, "rules": {"max_depth": 10}}})
    _fake_run(tmp_path / "e", "text", "softmax", 0, 0.60)  # the only Text data: no label
    rows = [line for line in tables(collect_runs([tmp_path])).split("Table 2")[0].splitlines()
            if line.startswith("| softmax")]
    std = statistics.stdev([30, 40])
    assert rows == ["| softmax | 60.00 (1) | - | 60.00 |",
                    f"| softmax (data.generated.seed=0, data.tokens=None) | - | 35.00 ± {std:.2f} "
                    "(2) | 35.00 |",
                    "| softmax (data.generated.seed=0, data.tokens=reference) | - | 90.00 (1) | "
                    "90.00 |",
                    "| softmax (data.generated.seed=1, data.tokens=None) | - | 20.00 (1) | "
                    "20.00 |"], rows


def test_runs_of_another_world_size_are_not_averaged_together(tmp_path):
    """Randomised attention's evaluations depend on how examples are batched over the
    processes: runs of one world size are one experiment (a result without it: 1)."""
    _fake_run(tmp_path / "a", "listops", "skyformer", 0, 0.30, world_size=2)
    _fake_run(tmp_path / "b", "listops", "skyformer", 1, 0.40, world_size=1)
    _fake_run(tmp_path / "c", "listops", "skyformer", 2, 0.50)
    rows = [line for line in tables(collect_runs([tmp_path])).split("Table 2")[0].splitlines()
            if line.startswith("| skyformer")]
    std = statistics.stdev([40, 50])
    assert rows == [f"| skyformer (world_size=1) | 45.00 ± {std:.2f} (2) | 45.00 |",
                    "| skyformer (world_size=2) | 30.00 (1) | 30.00 |"], rows


def test_runs_on_other_hardware_are_not_averaged_together(tmp_path):
    """Table 2 would average a CPU's max RSS with a GPU's allocated memory; two GPUs of
    one kind (cuda:0, cuda:1) are one experiment."""
    gpu = {"device": "cuda:0", "device_name": "NVIDIA H200"}
    _fake_run(tmp_path / "a", "listops", "softmax", 0, 0.30, environment=gpu)
    _fake_run(tmp_path / "b", "listops", "softmax", 1, 0.40,
              environment={**gpu, "device": "cuda:1"})
    _fake_run(tmp_path / "c", "listops", "softmax", 0, 0.50, memory=2**32,
              environment={"device": "cpu"}, peak_memory_kind="cpu max RSS")
    table = tables(collect_runs([tmp_path]))
    rows = [line for line in table.split("Table 2")[0].splitlines()
            if line.startswith("| softmax")]
    std = statistics.stdev([30, 40])
    assert rows == ["| softmax (hardware=cpu) | 50.00 (1) | 50.00 |",
                    f"| softmax (hardware=cuda NVIDIA H200) | 35.00 ± {std:.2f} (2) | 35.00 |"
                    ], rows
    memory = [line for line in table.split("Table 2")[1].splitlines()
              if line.startswith("| softmax")]
    assert memory == ["| softmax (hardware=cpu) | 2.000 | 4.000 |",
                      "| softmax (hardware=cuda NVIDIA H200) | 2.000 | 1.000 |"], memory


def test_a_run_reached_by_several_paths_counts_once(tmp_path):
    """The same run given twice, with its parent, or through a link, was counted as a
    second run (a seed run twice, in the notes)."""
    folder = _fake_run(tmp_path / "runs", "listops", "softmax", 0, 0.30)
    _fake_run(tmp_path / "runs", "listops", "softmax", 1, 0.40)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    runs = collect_runs([tmp_path / "runs", folder, folder / "result.json", tmp_path / "link",
                         tmp_path / "runs" / ".." / "runs"])
    assert sorted(r.result["seed"] for r in runs) == [0, 1]
    assert "ran more than once" not in tables(runs)


def test_a_run_without_result_json_is_named_not_left_out_silently(tmp_path, capsys):
    """A seed still training, stopped by --stop-after or failed was left out of the tables
    without a word: the row showed one seed fewer."""
    from skyformer.cli import main

    _fake_run(tmp_path, "listops", "softmax", 0, 0.30)
    folder = tmp_path / "listops" / "softmax" / "seed1"
    folder.mkdir()
    config = make_config("listops", attention="softmax", seed=1, steps=50)
    (folder / "config.json").write_text(json.dumps({"train": config.to_dict()}))
    entries = [{"kind": "train", "step": 10}, {"kind": "dev", "step": 20, "seconds": 1.0,
                                                 "accuracy": 0.2}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries)
                                          + '{"kind": "tr')  # cut short by a kill
    (folder / "last.pt").write_bytes(b"")  # a checkpoint to resume from
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bert"}')  # not a run's
    assert main(["lra", "report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"- {folder}: not finished (no result.json; logged up to step 20 of 50), so not " \
           "in the tables." in out
    assert "hf" not in out


def test_a_folder_of_unfinished_runs_only_names_them(tmp_path, capsys):
    """A folder whose only run had not finished was refused as holding no result.json,
    as an empty folder is, without naming the run or how far it got."""
    from skyformer.cli import main

    folder = tmp_path / "listops" / "softmax" / "seed0"
    folder.mkdir(parents=True)
    config = make_config("listops", attention="softmax", seed=0, steps=50)
    (folder / "config.json").write_text(json.dumps({"train": config.to_dict()}))
    (folder / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 10}) + "\n")
    assert main(["lra", "report", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"the runs there have not finished: {folder} (logged up to step 10 of 50, no " \
           "last.pt yet: --resume starts it again); continue each with its `skyformer lra " \
           "train` command and --resume" in err, err


def test_a_panel_without_dev_curves_says_so(tmp_path, monkeypatch):
    """A task whose runs have no dev entries (no metrics.jsonl) drew an empty panel and
    matplotlib's "No artists with labels found to put in legend" warning."""
    pytest.importorskip("matplotlib")
    folder = _fake_run(tmp_path, "text", "softmax", 0, 0.55)
    (folder / "metrics.jsonl").unlink()
    figures = []
    monkeypatch.setattr("skyformer.lra.report.save_figure",
                        lambda fig, path, **kw: figures.append(fig) or path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_dev_curves(collect_runs([tmp_path]), tmp_path / "figure2.png")
    ax = figures[0].axes[0]
    assert ax.get_legend() is None
    assert [t.get_text() for t in ax.texts] == ["no dev entries in the runs' metrics.jsonl"]


def test_a_binary_result_json_is_named(tmp_path):
    """A result.json that is not text (a copy cut short, another tool's binary) is named
    with the file, as invalid JSON is, not by the codec's words alone."""
    folder = _fake_run(tmp_path, "listops", "softmax", 0, 0.5)
    (folder / "result.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"result.json is not valid JSON"):
        collect_runs([tmp_path])


def test_a_result_json_cut_short_says_what_to_do(tmp_path):
    """A damaged result.json was named with the parser's words alone, no way out."""
    _fake_run(tmp_path, "listops", "softmax", 0, 0.5)
    folder = _fake_run(tmp_path, "listops", "softmax", 1, 0.5)
    (folder / "result.json").write_text((folder / "result.json").read_text()[:40])
    with pytest.raises(ValueError, match=r"seed1/result.json is not valid JSON \(.*\): .*cut "
                                         r"short since; run that seed again, or move its "
                                         r"folder out of the folders given"):
        collect_runs([tmp_path])


def test_one_reader_of_metrics_jsonl_skips_or_names_a_line_a_kill_cut_short(tmp_path):
    """Whether a run finished, its last step and its dev curve read metrics.jsonl through
    one reader: a cut line is skipped where the file only guides (resume, the list of
    unfinished runs) and named with its number where its numbers are drawn."""
    from skyformer.lra.runlog import read_entries

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"kind": "dev", "step": 2, "seconds": 1.0, "accuracy": 0.5}\n'
                       '\n7\n{"kind": "test", "st')
    assert list(read_entries(metrics)) == [
        (1, {"kind": "dev", "step": 2, "seconds": 1.0, "accuracy": 0.5})]
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 4 is not JSON .*delete that "
                                         r"line \(what reads it\)\.$"):
        list(read_entries(metrics, damaged="what reads it"))
    assert list(read_entries(tmp_path / "missing.jsonl")) == []


def test_a_run_on_the_whole_dev_split_is_labelled_so_not_none(tmp_path):
    """--full-dev records eval_batches None, which the row label wrote as
    "eval_batches=None", as if the setting were left at its default."""
    config = {**make_config("listops", attention="softmax").to_dict(), "eval_batches": None}
    assert make_config("listops", attention="softmax").eval_batches is not None  # preset's
    model = {"max_len": TASKS["listops"].max_len, "attention_options": {}}
    _fake_run(tmp_path, "listops", "softmax", 0, 0.3, config=config, model=model)
    assert "| softmax (eval_batches=all) | 30.00 (1) |" in tables(collect_runs([tmp_path]))
