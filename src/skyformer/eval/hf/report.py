"""Table, CSV and plot of ``skyformer hf-eval`` results (rows from ``hf_eval.evaluate``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...io import save_figure
from ...io import write_csv as write_rows_csv

COLUMNS = ("setting", "method", "target", "drop_in", "num_features", "exact", "seed", "texts",
           "cosine_mean", "cosine_min", "recall_at_1", "time_ms", "peak_mib", "note", "error")


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table; methods that are not drop-ins say why."""
    methods = [r["method"] + (" (transformers)" if r["method"] == "sdpa" else "") for r in rows]
    width = max([len("method"), *map(len, methods)]) + 1  # as wide as the longest name
    header = (f"{'setting':<8}{'method':<{width}}{'features':>9}{'cos mean':>10}"
              f"{'cos min':>9}{'R@1':>7}{'time ms':>10}{'peak MiB':>10}  note")
    lines = [header, "-" * len(header)]
    for r, method in zip(rows, methods, strict=True):
        features = "exact" if r["exact"] else _num(r["num_features"], "d")
        note = ("not run: " + r["error"]) if r["error"] else r["note"]
        lines.append(
            f"{r['setting']:<8}{method:<{width}}{features:>9}{_num(r['cosine_mean'], '.4f'):>10}"
            f"{_num(r['cosine_min'], '.4f'):>9}{_num(r['recall_at_1'], '.3f'):>7}"
            f"{_num(r['time_ms'], '.1f'):>10}{_num(r['peak_mib'], '.1f'):>10}  {note}".rstrip()
        )
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The same table in Markdown (for docs)."""
    out = ["| setting | method | features | cos mean | cos min | recall@1 | time ms | peak MiB "
           "| note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        features = "exact" if r["exact"] else _num(r["num_features"], "d")
        note = ("not run: " + r["error"]) if r["error"] else r["note"]
        method = "sdpa (transformers)" if r["method"] == "sdpa" else f"`{r['method']}`"
        out.append(
            f"| {r['setting']} | {method} | {features} | {_num(r['cosine_mean'], '.4f')} | "
            f"{_num(r['cosine_min'], '.4f')} | {_num(r['recall_at_1'], '.3f')} | "
            f"{_num(r['time_ms'], '.1f')} | {_num(r['peak_mib'], '.1f')} | {note} |"
        )
    return "\n".join(out)


def write_csv(path: str | os.PathLike[str], rows: list[dict[str, Any]], *,
              metadata: dict[str, Any] | None = None) -> Path:
    """Atomically write the rows as CSV (one line per setting, method and feature count;
    the ``COLUMNS``), ``metadata`` first as ``# key: <json>`` lines, as the other
    commands' CSV files (``io.write_csv``; ``pandas.read_csv(path, comment="#")``)."""
    return write_rows_csv(path, [{c: row.get(c) for c in COLUMNS} for row in rows],
                          metadata=metadata)


def plot(path: str | os.PathLike[str], rows: list[dict[str, Any]], title: str = "") -> Path:
    """PNG: cosine similarity, recall@1 and forward time against num_features, one column
    per setting; exact methods are horizontal lines, methods that are not drop-ins dashed."""
    try:  # no pyplot: the caller's backend stays as it is
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'skyformer[plot]'.") from None
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    metrics = (("cosine_mean", "cosine similarity to exact"), ("recall_at_1", "recall@1 vs exact"),
               ("time_ms", "forward time (ms)"))
    fig = Figure(figsize=(5.5 * len(settings), 9))
    axes = fig.subplots(len(metrics), len(settings), squeeze=False)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for col, setting in enumerate(settings):
        here = [r for r in rows if r["setting"] == setting and r["error"] is None]
        features = sorted({r["num_features"] for r in here if r["num_features"] is not None})
        for row_index, (key, label) in enumerate(metrics):
            ax = axes[row_index][col]
            for m_index, method in enumerate(methods):
                points = [r for r in here if r["method"] == method and r[key] is not None]
                if not points:
                    continue
                style = {"color": colours[m_index % len(colours)],
                             "linestyle": "--" if not points[0]["drop_in"] else "-"}
                name = method + ("" if points[0]["drop_in"] else " (not a drop-in)")
                if points[0]["num_features"] is None:
                    ax.axhline(points[0][key], linewidth=1, label=name, alpha=0.8, **style)
                else:
                    ax.plot([p["num_features"] for p in points], [p[key] for p in points],
                            marker="o", label=name, **style)
            if features:
                ax.set_xscale("log", base=2)
                ax.set_xticks(features, [str(f) for f in features])
            ax.set_xlabel("num_features")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row_index == 0:
                ax.set_title(f"{setting} inputs")
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    labels = list(legend)
    fig.legend([legend[k] for k in labels], labels, loc="lower center",
               ncol=min(4, max(1, len(labels))), fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    return save_figure(fig, path, dpi=110)
