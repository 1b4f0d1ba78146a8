"""Tables, result files and plots of ``skyformer bench`` results."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...io import remove_stale, save_figure, write_csv, write_json
from ..measure.memory import CPU_RESOLUTION_BYTES, above_resolution
from ..measure.metrics import worse_than_trivial as trivial_rule
from .run import HALF, BenchResult


def _times(ratio: float) -> str:
    """A speed-up: three significant digits below 100 (0.0417x, not 0.0x; 12.5x), whole
    numbers above (1235x, not 1.23e+03x)."""
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _ratio(ratio: float) -> str:
    """A ratio of the narrow table: two decimals, two significant digits below 0.1 (a
    method 250 times slower: 0.004x, not 0.00x)."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _share(fraction: float) -> str:
    """A speed-of-light fraction: whole percents, one significant digit below 1 %
    (0.4 %, not 0 %)."""
    return f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction * 100:.1g}%"


COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("N", "n", "{:d}".format),
    ("fwd ms", "fwd_ms", "{:.2f}".format),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.2f}".format),
    ("speed-up", "speedup", _ratio),
    ("N->2N", "growth", "{:.2f}".format),
    ("peak MiB", "peak_mib", "{:.1f}".format),
    ("memory", "memory_ratio", _ratio),
    ("rel. error", "rel_error", "{:.2e}".format),
    ("SOL", "sol_fraction", _share),
]


def _cell(row: dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return fmt(value) + ("!" if key == "rel_error" and worse_than_trivial(row) else "")


def worse_than_trivial(row: dict[str, Any]) -> bool:
    """Whether the method's error exceeds the trivial answer's (mean of V or zeros), or
    is not finite (``measure.metrics.worse_than_trivial``)."""
    return trivial_rule(row.get("rel_error"), row.get("trivial_error"))


def _groups(result: BenchResult) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in result.rows:
        g = (row["device"], row["dtype"], row["batch"], row["heads"], row["head_dim"])
        groups.setdefault(g, []).append(row)
    return groups


def _title(g: tuple) -> str:
    device, dtype, b, h, d = g
    return f"B={b} H={h} D={d} {dtype} {device}"


def _header(result: BenchResult) -> str:
    cfg = result.config
    timed = "forward+backward" if cfg.backward else "forward"
    rates = _rates(result)
    if any(dtype in HALF for dtype in cfg.dtypes):
        rates += "; half inputs at the faster of theirs and float32's"
    return (
        f"times: median of {cfg.repeats} after an untimed first call and {cfg.warmup} "
        f"warm-up, {cfg.clock} clock, {_timing(cfg)}; "
        f"speed-up: {cfg.reference}'s time / the method's ({timed}); {PEAK[cfg.backward]}; "
        f"memory: the method's peak / {cfg.reference}'s; N->2N: time growth (within one "
        "run); rel. error: spectral norm against the exact target, ! where it exceeds the "
        "trivial answer's (every row = mean of V, or all zeros) or is not finite; SOL: the "
        "method's matmul "
        f"FLOPs at the measured matmul throughput ({rates}) over the measured time"
    )


# the memory column, by whether the backward pass ran (``memory.measure_in_this_process``)
PEAK = {True: "peak MiB: the peak of one forward+backward call above its inputs and the "
              "output gradient",
        False: "peak MiB: the peak of one forward call above its inputs"}


def _rates(result: BenchResult) -> str:
    """The matmul rates the rows' speed of light was taken at: those of the run that
    measured them (one list per run where the rows come from several, ``--resume``)."""
    def listed(rates: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in rates.items())

    held = sorted({r.get("run") or 0 for r in result.rows})
    if len(result.runs) < 2 or not held:
        return listed(result.matmul_gflops)
    if len(held) == 1:
        return listed(result.runs[held[0]]["matmul_gflops"])
    return "; ".join(f"{_run_name(result, i)}: {listed(result.runs[i]['matmul_gflops'])}"
                     for i in held)


def _run_name(result: BenchResult, index: int) -> str:
    """``run I`` with its start time where known (files before runs were kept have none)."""
    started = result.runs[index].get("started") if index < len(result.runs) else None
    return f"run {index}" + (f" (started {started})" if started else "")


def _timing(cfg: Any) -> str:
    """How the repeats were ordered (``BenchConfig.timing``)."""
    if cfg.timing == "blocked":
        return f"each method's repeats in a block after {cfg.pause:g} s idle"
    return "the methods' repeats interleaved"


def _notes(result: BenchResult, g: tuple, rows: list[dict[str, Any]]) -> list[str]:
    """Crossover and scaling exponent per method, and the load during the runs."""
    ref = result.config.reference
    summary = {(s["device"], s["dtype"], s["batch"], s["heads"], s["head_dim"], s["method"]): s
               for s in result.summary}
    notes = []
    for method in dict.fromkeys(r["method"] for r in rows):
        # a length it did not run leaves the crossover and the exponent to the others
        skipped = sorted(r["n"] for r in rows if r["method"] == method and r["status"] != "ok")
        s = summary.get((*g, method))
        if not s:
            if skipped:
                notes.append(f"{method}: skipped at every N (the rows say why)")
            continue
        parts = []
        ran = " of the lengths it ran" if skipped else ""
        if method != ref and s["crossover"] is not None:  # None: never timed beside it
            if s["crossover"] == "across runs":
                parts.append(f"crossover with {ref} not given: the lengths it lies "
                             "between come from different runs")
            elif s["crossover"] == "never":
                parts.append(f"slower than {ref} at every N measured{ran}")
            elif s["crossover"] == "not at the largest":
                parts.append(f"faster than {ref} at N = {', '.join(map(str, s['faster_at']))} "
                             f"alone, slower at the largest N measured{ran}")
            elif s["crossover"] == "at most":
                parts.append(f"faster than {ref} at every N measured{ran}, the smallest "
                             f"N = {s['crossover_n']:.0f} (the crossover lies at or below it)")
            else:
                parts.append(f"faster than {ref} from N ~ {s['crossover_n']:.0f}{ran}")
        if skipped:
            parts.append(f"skipped at N = {', '.join(map(str, skipped))} (the rows say why)")
        if s["exponent"] is not None:
            lo, hi = s["exponent_range"]
            parts.append(f"time ~ N^{s['exponent']:.2f} (N {lo}..{hi})")
        elif s.get("exponent_across_runs"):
            lo, hi = s["exponent_range"]
            parts.append(f"time exponent not given: N {lo}..{hi} come from different runs")
        if parts:
            notes.append(f"{method}: {', '.join(parts)}")
    loads = {r["n"]: r.get("load_avg") for r in rows if r.get("load_avg") is not None}
    if loads:
        notes.append("1-minute load average while timing: "
                     + ", ".join(f"N={n}: {load:.1f}" for n, load in sorted(loads.items())))
    return notes + _runs_note(result, rows)


def _runs_note(result: BenchResult, rows: list[dict[str, Any]]) -> list[str]:
    """Which run measured which lengths, where the rows come from more than one."""
    lengths: dict[int, set[int]] = {}
    for row in rows:
        lengths.setdefault(row.get("run") or 0, set()).add(row["n"])
    if len(lengths) < 2:
        return []
    parts = [f"N = {', '.join(map(str, sorted(ns)))} by {_run_name(result, i)}"
             for i, ns in sorted(lengths.items())]
    return [f"rows of more than one run (--resume): {'; '.join(parts)}; N->2N growth, "
            "exponents and crossovers are taken within one run only"]


def format_table(result: BenchResult, *, markdown: bool = False) -> str:
    """Every row, grouped by shape/dtype and method, with the summary under each group."""
    lines = [_header(result)]
    for g, rows in _groups(result).items():
        lines += ["", f"{'### ' if markdown else ''}{_title(g)}", ""]
        header = ["method"] + [c[0] for c in COLUMNS]
        order = list(dict.fromkeys(r["method"] for r in rows))
        table = []
        for row in sorted(rows, key=lambda r: (order.index(r["method"]), r["n"])):
            if row["status"] != "ok":
                table.append([row["method"], str(row["n"]), f"skipped: {row['reason']}"]
                             + [""] * (len(COLUMNS) - 2))
                continue
            table.append([row["method"]] + [_cell(row, key, fmt) for _, key, fmt in COLUMNS])
        lines += _render(header, table, markdown)
        lines.append("")
        lines += [("- " if markdown else "  ") + note for note in _notes(result, g, rows)]
    return "\n".join(lines)


WIDE = [  # (title, value key, ratio key or None, format)
    (
        "{timed} ms, {clock} clock ({ref} time / method time)",
        "{time}",
        "speedup",
        "{:.1f}".format,
        _times,
    ),
    ("Peak memory MiB (x {ref}'s)", "peak_mib", "memory_ratio", "{:.1f}".format, _ratio),
    ("Relative spectral error against the exact target", "rel_error", None, "{:.2e}".format, ""),
    (
        "Speed of light: matmul FLOPs at the measured matmul rate / measured time",
        "sol_fraction",
        None,
        _share,
        "",
    ),
]


def format_wide(result: BenchResult) -> str:
    """Markdown tables with one column per N: time (with the speed-up over the reference),
    peak memory, relative error and speed of light, then crossover, exponent and load."""
    cfg = result.config
    time_key = "fwd_bwd_ms" if cfg.backward else "fwd_ms"
    timed = "Forward+backward" if cfg.backward else "Forward"
    lines = [_header(result)]
    for g, rows in _groups(result).items():
        by = {(r["method"], r["n"]): r for r in rows}
        ns = sorted({r["n"] for r in rows})
        methods = list(dict.fromkeys(r["method"] for r in rows))
        lines += ["", f"### {_title(g)}"]
        for title, key, ratio, fmt, ratio_fmt in WIDE:
            key = time_key if key == "{time}" else key
            shown = [m for m in methods if any(by[(m, n)].get(key) is not None for n in ns)]
            if not shown:
                continue
            lines += ["", title.format(timed=timed, clock=cfg.clock, ref=cfg.reference) + ":", "",
                      "| method | " + " | ".join(f"N={n}" for n in ns) + " |",
                      "|---" * (len(ns) + 1) + "|"]
            for m in shown:
                cells = []
                for n in ns:
                    r = by[(m, n)]
                    if r["status"] != "ok":
                        cells.append("skipped")
                    elif r.get(key) is None:
                        cells.append("-")
                    else:
                        cell = fmt(r[key])
                        if key == "rel_error" and worse_than_trivial(r):
                            cell += " !"
                        if ratio and m != cfg.reference and r.get(ratio) is not None:
                            cell += f" ({ratio_fmt(r[ratio])})"
                        cells.append(cell)
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
        skipped = [
            f"{r['method']} at N={r['n']}: {r['reason']}" for r in rows if r["status"] != "ok"
        ]
        lines.append("")
        lines += [
            "- " + note for note in _notes(result, g, rows) + [f"skipped {s}" for s in skipped]
        ]
    return "\n".join(lines)


def _render(header: list[str], table: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in table:
            if row[2].startswith("skipped"):
                row = row[:3] + [""] * (len(header) - 3)
            out.append("| " + " | ".join(row) + " |")
        return out
    widths = [
        max([len(header[i]),  # every row skipped: the header's width
             *(len(r[i]) for r in table if not r[2].startswith("skipped") or i < 2)])
        for i in range(len(header))
    ]
    out = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    out.append("-" * len(out[0]))
    for row in table:
        if row[2].startswith("skipped"):
            out.append(f"{row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2]}")
            continue
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return out


RESULT_SUFFIXES = (".json", ".csv", ".png")


def result_path(prefix: str | Path, suffix: str) -> Path:
    """``prefix`` + ``suffix`` (``results/bench_torch2.13`` -> ``...2.13.json``; a prefix
    already ending in one of ``RESULT_SUFFIXES`` has it replaced)."""
    path = Path(prefix)
    if path.suffix in RESULT_SUFFIXES:
        path = path.with_suffix("")
    return path.with_name(path.name + suffix)


def write_results(
    result: BenchResult, prefix: str | Path, *, plot: bool = True, command: str | None = None,
    complete: bool = True,
) -> list[Path]:
    """``prefix``.json (config, this run's environment and command, every run's in
    ``runs``, rows, summary), .csv (rows, the rest in its first lines) and .png, each
    written atomically. ``command`` is this run's (the last of ``runs``).
    ``complete=False`` marks a run still going (or interrupted), in the JSON and in the
    CSV's first comment line: ``skyformer bench --resume`` continues it. Without
    ``plot``, a .png an earlier run left is removed."""
    prefix = Path(prefix)
    data = result.to_dict()
    data["complete"] = complete
    if command:
        data["command"] = command
        if data["runs"]:
            data["runs"] = [*data["runs"][:-1], {**data["runs"][-1], "command": command}]
    # the JSON last: a run whose plot or CSV failed (a full disk) is not yet marked
    # complete there, so --resume writes them again
    drawn = [plot_results(result, result_path(prefix, ".png"))] if plot else []
    if not plot:
        remove_stale(result_path(prefix, ".png"))
    # ``# key: <json>`` lines first, as approx's CSV: pandas.read_csv(path, comment="#")
    table = write_csv(result_path(prefix, ".csv"), result.rows, metadata={
        "complete": complete, "config": data["config"], "environment": data["environment"],
        "command": command, "runs": data["runs"],
    })
    return [write_json(result_path(prefix, ".json"), data), table, *drawn]


def _drawn_peaks(points: list[tuple[int, float | None]], device: str
                 ) -> list[tuple[int, float]]:
    """The (N, peak MiB) points the memory panel draws: measured peaks above the
    measurement's resolution (a CPU peak under 1 MiB says only "small", and one of 0
    has no place on a log axis), as the memory ratios are taken."""
    return [(n, mib) for n, mib in points
            if mib is not None and above_resolution(mib * 2**20, device)]


def plot_results(result: BenchResult, path: str | Path) -> Path:
    """Log-log time and peak memory against N, one row of panels per shape/dtype, with
    the reference (exact SDPA) drawn as a thick dashed black line."""
    try:  # no pyplot: the caller's backend stays as it is
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'skyformer[plot]'") from err
    key = "fwd_bwd_ms" if result.config.backward else "fwd_ms"
    groups = _groups(result)
    fig = Figure(figsize=(11, 4.2 * len(groups)))
    axes = fig.subplots(len(groups), 2, squeeze=False)
    # dark shades first, then light; red kept for Skyformer
    tab20 = matplotlib.colormaps["tab20"].colors
    colors = [c for i, c in enumerate(tab20[0::2]) if i != 3] + [
        c for i, c in enumerate(tab20[1::2]) if i != 3
    ]
    markers = "os^vD<>ph*"
    for (g, rows), (ax_t, ax_m) in zip(groups.items(), axes, strict=True):
        hidden = False  # a measured peak left out (below the CPU's resolution)
        for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
            pts = sorted(
                (r["n"], r[key], r["peak_mib"])
                for r in rows
                if r["method"] == method and r["status"] == "ok"
            )
            style: dict[str, Any] = {
                "color": colors[i % len(colors)],
                "marker": markers[i % len(markers)],
                "markersize": 3,
            }
            if method == result.config.reference:
                style = {"color": "black", "linestyle": "--", "linewidth": 2.5}
            elif method == "skyformer":
                style.update(color="tab:red", linewidth=2.5, markersize=5)
            if pts:
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], label=method, **style)
                mem = _drawn_peaks([(p[0], p[2]) for p in pts], g[0])
                hidden = hidden or len(mem) < sum(p[2] is not None for p in pts)
                if mem:
                    ax_m.plot([p[0] for p in mem], [p[1] for p in mem], label=method, **style)
        for ax, ylabel in (
            (ax_t, f"{'forward+backward' if result.config.backward else 'forward'} ms"),
            (ax_m, "peak MiB"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.set_title(_title(g))
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
        if not any(r["peak_mib"] is not None for r in rows):  # an empty panel, said so
            ax_m.set_xlim(ax_t.get_xlim())
            ax_m.set_yscale("linear")
            ax_m.set_yticks([])
            ax_m.text(0.5, 0.5, "peak memory not measured" + (
                " (--no-memory)" if not result.config.memory else ""),
                transform=ax_m.transAxes, ha="center", va="center")
        elif hidden:
            ax_m.text(0.01, 0.01, f"peaks under {CPU_RESOLUTION_BYTES / 2**20:g} MiB (the CPU "
                      "measurement's resolution) not drawn", transform=ax_m.transAxes,
                      fontsize=7, va="bottom")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
