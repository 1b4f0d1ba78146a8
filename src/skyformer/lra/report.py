"""``skyformer lra report``: collect finished runs into the papers' tables and Figure 2.

Reads every ``result.json`` (and its ``metrics.jsonl``) under the given folders:

- Table 1: test accuracy (%) per method and task, mean +- std over seeds, and the
  average over the tasks a method has results for;
- Table 2: training time (hours) and peak memory (GB) per method and task, means over
  seeds (CUDA: ``max_memory_allocated``; CPU: max RSS, which is not comparable);
- Figure 2: dev accuracy against training time, one panel per task.

Runs on synthetic data or whose dev split is the test split are flagged.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import save_figure
from ..registry import list_methods
from .tasks import TASKS


@dataclass
class Run:
    folder: Path
    result: dict[str, Any]
    dev_curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds, accuracy)

    @property
    def key(self) -> tuple[str, str]:
        return self.result["task"], self.result["attention"]


def collect_runs(paths: list[str | os.PathLike[str]]) -> list[Run]:
    """Every finished run (a folder with ``result.json``) under ``paths``."""
    runs = []
    for path in paths:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist.")
        files = [root] if root.is_file() else sorted(root.rglob("result.json"))
        for file in files:
            try:
                result = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise ValueError(f"{file} is not valid JSON ({err}).") from None
            run = Run(file.parent, result)
            metrics = file.parent / "metrics.jsonl"
            if metrics.is_file():
                for line in metrics.read_text(encoding="utf-8").splitlines():
                    entry = json.loads(line)
                    if entry.get("kind") == "dev":
                        run.dev_curve.append((entry["seconds"], entry["accuracy"]))
            runs.append(run)
    if not runs:
        raise FileNotFoundError(f"no result.json under {', '.join(map(str, paths))}; finish a "
                                "run with `skyformer lra train` first.")
    return runs


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


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def tables(runs: list[Run]) -> str:
    """Tables 1 and 2 as markdown."""
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.key].append(run)
    tasks = [t for t in TASKS if any(task == t for task, _ in groups)]
    methods = _method_order({m for _, m in groups})
    rows = []
    for method in methods:
        row, means = [method], []
        for task in tasks:
            accs = [r.result["test_accuracy"] for r in groups.get((task, method), [])]
            row.append(_cell(accs, 100) + (f" ({len(accs)})" if accs else ""))
            if accs:
                means.append(statistics.fmean(accs) * 100)
        row.append(f"{statistics.fmean(means):.2f}" if means else "-")
        rows.append(row)
    titles = [TASKS[t].title for t in tasks]
    out = ["Table 1: test accuracy (%) of the best dev checkpoint, mean ± std over seeds "
           "(number of seeds); avg over the tasks a method has results for.", "",
           _table(["method", *titles, "avg"], rows), ""]
    rows = []
    for method in methods:
        row = [method]
        for task in tasks:
            hours = [r.result["train_seconds"] / 3600 for r in groups.get((task, method), [])]
            row.append(_cell(hours, digits=3, spread=False))
        for task in tasks:
            gib = [r.result["peak_memory_bytes"] / 2**30 for r in groups.get((task, method), [])]
            row.append(_cell(gib, digits=3, spread=False))
        rows.append(row)
    kinds = sorted({r.result.get("peak_memory_kind", "?") for r in runs})
    out += [f"Table 2: training time (hours, excluding evaluation) and peak memory (GiB; "
            f"{', '.join(kinds)}), means over seeds.", "",
            _table(["method", *(f"time {t}" for t in titles), *(f"memory {t}" for t in titles)],
                   rows), ""]
    notes = []
    for (task, method), group in sorted(groups.items()):
        steps = sorted({r.result["steps"] for r in group})
        if any(r.result.get("synthetic_data") for r in group):
            notes.append(f"{task}/{method}: synthetic data (not the LRA release).")
        if any(r.result.get("dev_is_test") for r in group):
            notes.append(f"{task}/{method}: the dev split is the test split (LRA's IMDb setup).")
        if steps != [50_000]:
            notes.append(f"{task}/{method}: trained for {', '.join(map(str, steps))} steps "
                         "(the papers: 50000).")
    if notes:
        out += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(out)


def plot_dev_curves(runs: list[Run], path: str | os.PathLike[str]) -> Path:
    """Figure 2: dev accuracy against training time, one panel per task."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'skyformer[plot]').") from None
    tasks = [t for t in TASKS if any(r.key[0] == t for r in runs)]
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    methods = _method_order({r.key[1] for r in runs})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for ax, task in zip(axes.flat, tasks, strict=False):
        seen = set()
        for run in sorted((r for r in runs if r.key[0] == task), key=lambda r: r.key[1]):
            if not run.dev_curve:
                continue
            method = run.key[1]
            xs, ys = zip(*run.dev_curve, strict=True)
            ax.plot(xs, [100 * y for y in ys], color=colors[method], alpha=0.8, linewidth=1.2,
                    label=None if method in seen else method)
            seen.add(method)
        synthetic = any(r.result.get("synthetic_data") for r in runs if r.key[0] == task)
        ax.set_title(TASKS[task].title + (" (synthetic)" if synthetic else ""))
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("dev accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
