"""``skyformer lra report``: collect finished runs into the papers' tables and Figure 2.

Reads every ``result.json`` (and its ``metrics.jsonl``) under the given folders:

- Table 1: test accuracy (%) per method and task, mean +- std over seeds, and the
  average over the tasks a method has results for;
- Table 2: training time (hours) and peak memory (GB) per method and task, means over
  seeds (CUDA: ``max_memory_allocated``; CPU: peak RSS, which is not comparable);
- Figure 2: dev accuracy against training time, one panel per task.

Runs of a method on a task are averaged over seeds only when the rest of their training
config is the same (logging and checkpoint intervals aside). A row is labelled with the
settings in which its runs differ from the task's preset (``skyformer lra presets``, the
method at the paper's options): runs with the preset settings are one unlabelled row
per method. Runs trained on other prepared data (the records of its ``meta.json``, the
source path aside) or on other hardware (a CPU, a GPU by its name: Table 2's time and
memory depend on it) are not averaged together either: where a task's runs differ in
those, each row also names the records that differ (``data.tokens=reference``,
``hardware=cuda NVIDIA H200``). Runs on synthetic data or whose dev split is the test
split are flagged.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import json
import math
import os
import statistics
import textwrap
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io import save_figure
from ..registry import get_method, list_methods
from ..registry.variants import base_name, is_variant, parse_variant
from .cache import data_fingerprint
from .model import resolve_attention_options
from .presets import make_config
from .runlog import read_entries
from .tasks import TASKS

# Config entries that do not change what a run measures, besides the seed.
NOT_EXPERIMENT = ("seed", "log_every", "checkpoint_every")


@dataclass
class Run:
    folder: Path
    result: dict[str, Any]
    source: Path | None = None  # the file read (folder/result.json, or one named so)

    @functools.cached_property
    def dev_curve(self) -> list[tuple[float, float]]:
        """(seconds, accuracy) of the run's dev entries, read from its ``metrics.jsonl``
        when first asked for (by the plot alone: a damaged file stops no table)."""
        metrics = self.folder / "metrics.jsonl"
        return _dev_curve(metrics) if metrics.is_file() else []

    @property
    def key(self) -> tuple[str, str]:
        """(task, method): a variant (``skyformer[num_features=32]``) is its method, the
        options it set being settings (``settings``), so that it and the method given the
        same options are one experiment."""
        return self.result["task"], base_name(str(self.result["attention"]))

    @property
    def settings(self) -> dict[str, Any]:
        """The experiment: the training config without the seed and logging intervals,
        with the model's sequence length (the prepared one when the config has none) and
        every option the attention ran with (defaults included: a run that typed a
        default is the same experiment as one that did not)."""
        config = self.result.get("config") or {}
        out = {k: v for k, v in config.items()
               if k not in (*NOT_EXPERIMENT, "task", "attention", "attention_options")}
        model = self.result.get("model") or {}
        ran_with = self.result.get("attention_ran_with")
        if not isinstance(ran_with, dict):  # a result written before it was recorded
            given = model.get("attention_options", config.get("attention_options")) or {}
            ran_with = _every_option(self.result.get("attention"), given)
        for key, value in ran_with.items():
            out[f"option {key}" if key in out else key] = value
        model_len = model.get("max_len")
        if model_len is not None:
            out["max_len"] = model_len
        return out

    @property
    def data(self) -> dict[str, Any]:
        """The prepared data's records (``data_fingerprint`` of the ``meta.json`` the run
        recorded: no source path, so a moved copy is the same data), one entry per
        value, nested records flattened: ``{"data.tokens": ..., "data.generated.seed":
        ...}``. Of each split, its count and digest (its first ``DIGEST_CHARS``
        characters): its label counts and lengths follow from its examples."""
        records = data_fingerprint(self.result.get("data") or {})
        splits = records.pop("splits", None)
        if isinstance(splits, dict):
            records["splits"] = {name: _split_identity(split) for name, split in splits.items()}
        return _leaves(records, "data")

    @property
    def hardware(self) -> str | None:
        """Where the run trained, as Table 2's time and memory depend on it: the device
        type and, for a GPU, its name (``cuda NVIDIA H200``); None where the result does
        not record it."""
        environment = self.result.get("environment") or {}
        device = environment.get("device")
        if device is None:
            return None
        name = environment.get("device_name")
        kind = str(device).split(":")[0]
        return f"{kind} {name}" if name else kind

    @property
    def context(self) -> dict[str, Any]:
        """What a run measured on besides its settings: ``data``, ``hardware`` and the
        number of processes (randomised attention's evaluations depend on how the
        examples are batched, docs/lra.md)."""
        return {**self.data, "hardware": self.hardware,
                "world_size": self.result.get("world_size", 1)}


DIGEST_CHARS = 12  # of a split's SHA-256 in a row's label: enough to tell data apart


def _split_identity(split: Any) -> Any:
    """A split's record in ``meta.json`` reduced to what identifies it: its count and a
    prefix of its digest (each where recorded)."""
    if not isinstance(split, dict):
        return split
    out = {k: split[k] for k in ("count", "sha256") if k in split}
    if isinstance(out.get("sha256"), str):
        out["sha256"] = out["sha256"][:DIGEST_CHARS]
    return out


def _leaves(value: Any, name: str) -> dict[str, Any]:
    """``{name: value}``, or for a non-empty dict its entries' leaves, named ``name.key``."""
    if not isinstance(value, dict) or not value:
        return {name: value}
    return {k: v for key, item in value.items() for k, v in _leaves(item, f"{name}.{key}").items()}


def _every_option(method: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the method's defaults filled in, when the method is registered
    here and takes them (else as they are, with a variant's options read from its name:
    a run of a method registered elsewhere, from before results recorded them all)."""
    try:
        return get_method(method).bind(**options).options()
    except (KeyError, TypeError, ValueError):
        preset: tuple[tuple[str, Any], ...] = ()
        if isinstance(method, str) and is_variant(method):
            with contextlib.suppress(ValueError):
                preset = parse_variant(method)[1]
        return {**dict(preset), **options}


def collect_runs(paths: list[str | os.PathLike[str]]) -> list[Run]:
    """Every finished run (a folder with ``result.json``) under ``paths``, each once
    however many of ``paths`` reach it (a folder and its parent, a link)."""
    runs, seen = [], set()
    for path in paths:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist.")
        files = [root] if root.is_file() else sorted(root.rglob("result.json"))
        for file in files:
            if file.resolve() in seen:
                continue
            seen.add(file.resolve())
            try:
                result = json.loads(file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{file} is not valid JSON ({err}): `skyformer lra train` "
                                 "writes it whole, so it was damaged or cut short since; run "
                                 "that seed again, or move its folder out of the folders "
                                 "given.") from None
            _check_result(file, result)
            runs.append(Run(file.parent, result, file))
    if not runs:
        raise FileNotFoundError(_no_finished_run(paths))
    return runs


def _no_finished_run(paths: list[str | os.PathLike[str]]) -> str:
    """The sentence for ``paths`` without a ``result.json``, naming the run folders they
    hold that have not finished (``unfinished_runs``) and how far each got."""
    where = ", ".join(map(str, paths))
    unfinished = unfinished_runs(paths)
    if not unfinished:
        return f"no result.json under {where}; finish a run with `skyformer lra train` first."
    named = "; ".join(f"{run.folder} ({run.progress})" for run in unfinished)
    return (f"no result.json under {where}; the runs there have not finished: {named}; "
            "continue each with its `skyformer lra train` command and --resume, or wait for it "
            "to end.")


@dataclass
class Unfinished:
    """A run folder a training run started (``config.json``) without finishing it (no
    ``result.json``): still training, stopped by ``--stop-after``, or failed."""

    folder: Path
    step: int | None  # the last step its metrics.jsonl logged (None: nothing logged)
    steps: Any  # the steps its config asks for

    @property
    def progress(self) -> str:
        """How far it got: ``logged up to step 20 of 50`` or ``nothing logged``, and where
        it holds no ``last.pt`` yet (killed before its first checkpoint), that --resume
        starts it again from step 0."""
        said = "nothing logged" if self.step is None \
            else f"logged up to step {self.step} of {self.steps}"
        if not (self.folder / "last.pt").exists():
            said += ", no last.pt yet: --resume starts it again"
        return said


def unfinished_runs(paths: list[str | os.PathLike[str]]) -> list[Unfinished]:
    """Every run folder under ``paths`` holding a training ``config.json`` but no
    ``result.json``, each once: left out of the tables, they are named in their notes."""
    found, seen = [], set()
    for path in paths:
        root = Path(path)
        for file in sorted(root.rglob("config.json")) if root.is_dir() else []:
            folder = file.parent.resolve()
            if folder in seen or (folder / "result.json").exists():
                continue
            seen.add(folder)
            try:
                config = json.loads(file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            train = config.get("train") if isinstance(config, dict) else None
            if isinstance(train, dict) and train.get("task") in TASKS:  # not another tool's
                found.append(Unfinished(file.parent, _last_step(file.parent / "metrics.jsonl"),
                                        train.get("steps")))
    return found


def _last_step(metrics: Path) -> int | None:
    """The largest step of the entries of ``metrics`` that parse (a line a kill cut short
    is skipped); None without any."""
    return max((entry["step"] for _, entry in read_entries(metrics)
                if isinstance(entry.get("step"), int)), default=None)


def _dev_curve(metrics: Path) -> list[tuple[float, float]]:
    """(seconds, accuracy) of the dev entries of a run's ``metrics.jsonl``; a line that is
    not JSON, or a dev entry without either, is named with its line number."""
    curve = []
    readers = "only the dev curves of --plot read this file"
    for number, entry in read_entries(metrics, damaged=readers):
        if entry.get("kind") != "dev":
            continue
        missing = [k for k in ("seconds", "accuracy") if k not in entry]
        if missing:
            raise ValueError(f"{metrics} line {number} is a dev entry without "
                             f"{' and '.join(missing)}: the file is damaged; delete that line "
                             f"({readers}).")
        curve.append((entry["seconds"], entry["accuracy"]))
    return curve


REQUIRED = ("task", "attention", "test_accuracy", "train_seconds", "peak_memory_bytes", "steps")


def _diverged_at(result: dict[str, Any]) -> int | str | None:
    """The step at which a run's training loss stopped being finite; "?" for a result
    written before that step was recorded whose test loss is not finite (null); None."""
    step = result.get("diverged_at_step")
    if isinstance(step, int):
        return step
    if "diverged_at_step" not in result and "test_loss" in result \
            and result["test_loss"] is None:
        return "?"
    return None


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "attention": lambda v: isinstance(v, str),
    "test_accuracy": _finite_number,
    "train_seconds": _finite_number,
    "peak_memory_bytes": _finite_number,
    "steps": lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def _check_result(file: Path, result: Any) -> None:
    """Refuse a ``result.json`` that ``Trainer`` did not write, naming what it lacks or
    the value that is not of the type ``Trainer`` writes (a hand-edited null accuracy)."""
    if not isinstance(result, dict):
        problem = f"a JSON {type(result).__name__}, not an object"
    elif missing := [k for k in REQUIRED if k not in result]:
        problem = f"no {', '.join(missing)}"
    elif result["task"] not in TASKS:
        problem = f"task {result['task']!r} is not an LRA task"
    elif wrong := next((k for k, ok in _TYPES.items() if not ok(result[k])), None):
        problem = f"{wrong} is {json.dumps(result[wrong])}"
    else:
        return
    raise ValueError(f"{file} is not a result of `skyformer lra train` ({problem}); move it "
                     "out of the folders given, or give the run folders themselves.")


def _method_order(methods: set[str]) -> list[str]:
    known = [m for m in list_methods() if m in methods]
    return known + sorted(methods - set(known))


def _cell(values: list[float], scale: float = 1.0, digits: int = 2, spread: bool = True) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    if spread and len(values) > 1:
        return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"
    return f"{mean:.{digits}f}"


def _amount_cell(values: list[float]) -> str:
    """The mean of Table 2's hours or GiB: three decimals, two significant digits below
    0.01 (a short run's 0.0028 hours, not 0.000), in positional notation throughout
    (a second's 0.00028 hours, not 2.8e-04)."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if not 0 < mean < 0.01:  # NaN, where a run recorded none, too
        return f"{mean:.3f}"
    # rounded first, its zeros kept: 0.005 -> 0.0050, 0.0099996 -> 0.010 (as .3f)
    return format(decimal.Decimal(f"{mean:#.2g}"), "f")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _preset_settings(run: Run) -> dict[str, Any]:
    """``Run.settings`` of the task's preset with the run's method at the paper's options
    (for the run's sequence length: a fixed-length method's ``max_seq_len`` follows it,
    so a shorter run is labelled by ``max_len`` alone) and the task's LRA length."""
    task, method = run.key
    model = run.result.get("model") or {}
    length = model.get("max_len") or TASKS[task].max_len
    try:
        options = resolve_attention_options(method, {}, length)
    except (KeyError, TypeError, ValueError):  # a method registered elsewhere: no defaults
        options = {}
    preset = {"attention": method, "config": make_config(task).to_dict(),
              "model": {"max_len": TASKS[task].max_len, "attention_options": options}}
    return Run(run.folder, preset).settings


def _variant_label(run: Run, context_keys: list[str]) -> str:
    """Row label suffix of a run: the settings it has other than its task's preset, e.g.
    ``lr=0.001, steps=200``, then its value of each of ``context_keys`` (the data records
    and hardware in which its task's runs differ); empty for a run with the preset's
    settings on the task's only data and hardware. A setting the run's config does not
    record (written before it existed) counts as the preset's."""
    return ", ".join(_label_parts(run, context_keys))


def _label_parts(run: Run, context_keys: list[str]) -> list[str]:
    """The ``key=value`` items of ``_variant_label``."""
    settings, preset, context = run.settings, _preset_settings(run), run.context
    other = [f"{k}={_NONE_LABEL.get(k, 'none') if settings[k] is None else settings[k]}"
             for k in sorted(settings) if _plain(settings[k]) != _plain(preset.get(k))]
    return other + [f"{k}={context.get(k)}" for k in context_keys]


# What an unset (None) setting means in a row label ("eval_batches=None" read as a default)
_NONE_LABEL = {"eval_batches": "all", "max_len": "full"}


def _differing_context(runs: list[Run]) -> list[str]:
    """The data records and the hardware (``Run.context`` keys) in which ``runs``
    differ: runs on a CPU and on a GPU measure other times and memories."""
    records = [r.context for r in runs]
    keys = sorted({k for d in records for k in d})
    return [k for k in keys if len({json.dumps(d.get(k), sort_keys=True, default=str)
                                    for d in records}) > 1]


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back: a default tuple equals the list a result holds."""
    return json.loads(json.dumps(value, default=str))


def _by_seed(group: list[Run], value: Callable[[Run], float]) -> list[float]:
    """One value per distinct seed: the mean over runs that repeat a seed."""
    seeds: dict[Any, list[float]] = defaultdict(list)
    for run in group:
        seeds[run.result.get("seed")].append(value(run))
    return [statistics.fmean(v) for v in seeds.values()]


def _groups(runs: list[Run]) -> dict[tuple[str, str, str], list[Run]]:
    """Runs by (task, method, settings label): the runs that are seeds of one experiment."""
    context_keys = {task: _differing_context([r for r in runs if r.key[0] == task])
                 for task in {r.key[0] for r in runs}}
    groups: dict[tuple[str, str, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(*run.key, _variant_label(run, context_keys[run.key[0]]))].append(run)
    return groups


def _row_names(groups: dict[tuple[str, str, str], list[Run]]) -> dict[tuple[str, str], str]:
    """The tables' rows, in their order: (method, settings label) -> the row's name,
    ``skyformer (lr=0.001)`` (the method alone for the preset's settings)."""
    order = _method_order({m for _, m, _ in groups})
    rows_of = sorted({(m, label) for _, m, label in groups},
                     key=lambda row: (order.index(row[0]), row[1]))
    return {(m, label): f"{m} ({label})" if label else m for m, label in rows_of}


def tables(runs: list[Run], unfinished: list[Unfinished] = ()) -> str:
    """Tables 1 and 2 as markdown; ``unfinished`` runs (``unfinished_runs``) are named in
    the notes."""
    groups = _groups(runs)
    tasks = [t for t in TASKS if any(task == t for task, _, _ in groups)]
    names = _row_names(groups)
    rows_of = list(names)
    rows = []
    for method, label in rows_of:
        row, means = [names[method, label]], []
        for task in tasks:
            accs = _by_seed(groups.get((task, method, label), []),
                            lambda r: r.result["test_accuracy"])
            row.append(_cell(accs, 100) + (f" ({len(accs)})" if accs else ""))
            if accs:
                means.append(statistics.fmean(accs) * 100)
        row.append(f"{statistics.fmean(means):.2f}" if means else "-")
        rows.append(row)
    titles = [TASKS[t].title for t in tasks]
    out = ["Table 1: test accuracy (%) of the best dev checkpoint, mean ± std over seeds "
           "(number of distinct seeds); avg over the tasks a row has results for. Runs with "
           "settings other than the task's preset are separate rows, labelled with those "
           "settings.", "",
           _table(["method", *titles, "avg"], rows), ""]
    rows = []
    for method, label in rows_of:
        row = [names[method, label]]
        for task in tasks:
            hours = _by_seed(groups.get((task, method, label), []),
                             lambda r: r.result["train_seconds"] / 3600)
            row.append(_amount_cell(hours))
        for task in tasks:
            gib = _by_seed(groups.get((task, method, label), []),
                           lambda r: r.result["peak_memory_bytes"] / 2**30)
            row.append(_amount_cell(gib))
        rows.append(row)
    kinds = sorted({r.result.get("peak_memory_kind", "?") for r in runs})
    out += [f"Table 2: training time (hours, excluding evaluation) and peak memory (GiB; "
            f"{', '.join(kinds)}), means over seeds.", "",
            _table(["method", *(f"time {t}" for t in titles), *(f"memory {t}" for t in titles)],
                   rows), ""]
    notes = []
    for (task, method, label), group in sorted(groups.items()):
        name = f"{task}/{names[method, label]}"
        steps = sorted({r.result["steps"] for r in group})
        if any(r.result.get("synthetic_data") for r in group):
            notes.append(f"{name}: synthetic data (not the LRA release).")
        diverged = sorted({(r.result.get("seed"), _diverged_at(r.result)) for r in group
                           if _diverged_at(r.result) is not None}, key=str)
        if diverged:
            notes.append(f"{name}: diverged (training loss not finite) in seed(s) "
                         + ", ".join(f"{seed} at step {step}" if step != "?" else
                                     f"{seed} (its test loss is not finite)"
                                     for seed, step in diverged)
                         + "; its numbers are of the best dev checkpoint, which may be "
                         "from before.")
        if any(r.result.get("dev_is_test") for r in group):
            notes.append(f"{name}: the dev split is the test split (LRA's IMDb setup).")
        if steps != [50_000]:
            notes.append(f"{name}: trained for {', '.join(map(str, steps))} steps "
                         "(the papers: 50000).")
        seeds = [r.result.get("seed") for r in group]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1}, key=str)
        if repeated:
            notes.append(f"{name}: seed(s) {', '.join(map(str, repeated))} ran more than once "
                         "with the same settings; each seed's runs are averaged and count once.")
    for run in unfinished:
        notes.append(f"{run.folder}: not finished (no result.json; {run.progress}), so not in "
                     "the tables.")
    if notes:
        out += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(out)


_LINE_STYLES = ("-", "--", ":", "-.")


def _panel_labels(task: str, groups: dict[tuple[str, str, str], list[Run]],
                  names: dict[tuple[str, str], str]
                  ) -> tuple[dict[tuple[str, str], str], list[str]]:
    """Legend entries of ``task``'s panel, each row's method and the settings in which
    it differs from the panel's other rows, and the settings all of them share (said
    once, under the title: repeated in every entry they squeezed the panel)."""
    context_keys = _differing_context([r for g in groups.values() for r in g
                                       if r.key[0] == task])
    parts = {(method, label): _label_parts(runs[0], context_keys)
             for (t, method, label), runs in groups.items() if t == task}
    shared = [p for p in next(iter(parts.values()), []) if all(p in q for q in parts.values())]
    shared = shared if len(parts) > 1 else []
    legends = {}
    for row in names:
        own = [p for p in parts.get(row, []) if p not in shared]
        legends[row] = f"{row[0]} ({', '.join(own)})" if own else row[0]
    return legends, shared


def plot_dev_curves(runs: list[Run], path: str | os.PathLike[str]) -> Path:
    """Figure 2: dev accuracy against training time, one panel per task, one colour per
    row of the tables (a method with other settings is a row, and a curve, of its own)."""
    try:  # no pyplot: the caller's backend stays as it is
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'skyformer[plot]').") from None
    tasks = [t for t in TASKS if any(r.key[0] == t for r in runs)]
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = Figure(figsize=(5 * cols, 3.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    groups = _groups(runs)
    names = _row_names(groups)
    # one look per row: ten colours, then the same colours dashed, dotted, ...
    looks = {name: (matplotlib.colormaps["tab10"](i % 10), _LINE_STYLES[i // 10 % 4])
             for i, name in enumerate(names.values())}
    for ax, task in zip(axes.flat, tasks, strict=False):
        legends, shared = _panel_labels(task, groups, names)
        for row, name in names.items():
            for i, run in enumerate(r for r in groups.get((task, *row), []) if r.dev_curve):
                xs, ys = zip(*run.dev_curve, strict=True)
                label = None if i else textwrap.fill(legends[row], 40, break_long_words=False)
                color, style = looks[name]
                ax.plot(xs, [100 * y for y in ys], color=color, linestyle=style, alpha=0.8,
                        linewidth=1.2, label=label)  # one legend entry per row
        synthetic = any(r.result.get("synthetic_data") for r in runs if r.key[0] == task)
        title = TASKS[task].title + (" (synthetic)" if synthetic else "")
        if shared:  # the settings every curve of the panel has, once, under its title
            title += "\n" + textwrap.fill(", ".join(shared), 60, break_long_words=False)
        ax.set_title(title, fontsize=9 if shared else None)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("dev accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_lines():  # beside the panel: many rows would cover the curves
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                      borderaxespad=0.0)
        else:  # no run of the task logged a dev entry (metrics.jsonl missing)
            ax.text(0.5, 0.5, "no dev entries in the runs' metrics.jsonl", ha="center",
                    va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120, bbox_inches="tight")  # the legends included
