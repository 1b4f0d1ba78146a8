"""Tables, result files and the markdown report of the approximation study."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ...io import atomic_write_text, remove_stale, replacing_together, write_csv, write_json

FILES = {
    "json": "approx.json",
    "csv": "approx.csv",
    "errors": "approx_errors.png",
    "spectra": "approx_spectra.png",
    "leverage": "approx_leverage.png",
    "report": "approx.md",
}


def _order(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, method, target) in display order: methods, floors, baselines."""
    seen = dict.fromkeys((r["kind"], r["method"], r["target"]) for r in rows)
    rank = {"method": 0, "floor": 1, "baseline": 2}
    return sorted(seen, key=lambda key: rank[key[0]])


def _pivot(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(source, N, ms, [(label, target, {m: row})]) blocks; baselines fill every m."""
    blocks = []
    for source, n in dict.fromkeys((r["source"], r["seq_len"]) for r in rows):
        panel = [r for r in rows if r["source"] == source and r["seq_len"] == n]
        ms = sorted({r["num_features"] for r in panel if r["num_features"] is not None})
        lines = []
        for kind, method, target in _order(panel):
            cells = [r for r in panel
                     if (r["kind"], r["method"], r["target"]) == (kind, method, target)]
            by_m = dict.fromkeys(ms, cells[0]) if kind == "baseline" else {
                r["num_features"]: r for r in cells}
            label = {"svd_floor": "rank-m SVD floor", "mean_v": "trivial: mean of V",
                     "constant_row": "trivial: best constant row"}.get(method, method)
            lines.append((label, target, by_m))
        blocks.append((source, n, ms, lines))
    return blocks


WORSE_THAN_TRIVIAL = (
    "! = further from its target than the trivial answer for that target (the best "
    "'trivial' row of the block)."
)


def _trivial(lines: list[tuple[str, str, dict]]) -> dict[str, float]:
    """Per target, the smallest error of the block's trivial baselines."""
    best: dict[str, float] = {}
    for label, target, by_m in lines:
        if label.startswith("trivial") and by_m:
            value = next(iter(by_m.values()))["spectral_mean"]
            best[target] = min(value, best.get(target, value))
    return best


def _worse(label: str, target: str, row: dict[str, Any], trivial: dict[str, float]) -> bool:
    return (not label.startswith(("trivial", "rank-m")) and target in trivial
            and row["spectral_mean"] > trivial[target])


def format_table(rows: list[dict[str, Any]]) -> str:
    """Mean relative spectral error, one block per source and N, one column per m; "!"
    marks a method further from its target than the trivial answer."""
    out = []
    for source, n, ms, lines in _pivot(rows):
        trivial = _trivial(lines)
        # as wide as the longest label (a variant's name may be long), at least 30
        width = max([30] + [len(label) + 2 for label, _, _ in lines])
        header = f"{source} N={n}".ljust(width) + f"{'target':<10}" + "".join(
            f"{'m=' + str(m):>10}" for m in ms)
        out += [header, "-" * len(header)]
        for label, target, by_m in lines:
            cells = "".join(
                (f"{by_m[m]['spectral_mean']:.3g}"
                 + ("!" if _worse(label, target, by_m[m], trivial) else " ")).rjust(10)
                if m in by_m else f"{'-':>10}" for m in ms)
            out.append(f"{label:<{width}}{target:<10}{cells}")
        out.append("")
    out.append(WORSE_THAN_TRIVIAL)
    return "\n".join(out).rstrip()


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for source, n, ms, lines in _pivot(rows):
        trivial = _trivial(lines)
        out.append(f"**{source}, N = {n}** (mean ± std over seeds and heads)\n")
        out.append("| method | target | " + " | ".join(f"m={m}" for m in ms) + " |")
        out.append("|---|---|" + "---|" * len(ms))
        for label, target, by_m in lines:
            cells = [
                f"{by_m[m]['spectral_mean']:.3g} ± {by_m[m]['spectral_std']:.2g}"
                + (" !" if _worse(label, target, by_m[m], trivial) else "")
                if m in by_m else "-"
                for m in ms
            ]
            out.append(f"| {label} | {target} | " + " | ".join(cells) + " |")
        out.append("")
    out.append(WORSE_THAN_TRIVIAL)
    return "\n".join(out)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def analysis_table(analysis: list[dict[str, Any]]) -> str:
    """Stable ranks and Theorem 2 numbers (means over heads), markdown."""
    if not analysis:
        return ""
    out = ["| source | N | srank D^-1 A | residual without | entries removed | srank residual "
           "| srank output (one head) | srank output (heads side by side) |",
           "|---|---|---|---|---|---|---|---|"]
    for a in analysis:
        head = [a["source"], str(a["seq_len"]), f"{_mean(a['softmax_srank']):.2f}"]
        tail = [f"{_mean(a['output_srank']):.2f}", f"{a['layer_output_srank']:.2f}"]
        for i, r in enumerate(a["residuals"]):
            cells = [*(head if i == 0 else [""] * 3), r["description"],
                     f"{100 * _mean(r['density']):.1f}%", f"{_mean(r['srank']):.2f}",
                     *(tail if i == 0 else [""] * 2)]
            out.append("| " + " | ".join(cells) + " |")
    out += ["", "| source | 2n | eps | lambda = eps norm(C, 2) | d_stat | max leverage | beta "
            "| d = d_stat/beta ln(n/delta) (C=1) | d = 56/3 d_stat/beta ln(4n/delta) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a in analysis:
        for lev in a["leverage"]:
            out.append(
                f"| {a['source']} | {2 * lev['n']} | {lev['eps']:g} | {_mean(lev['lambda']):.3g} | "
                f"{_mean(lev['d_stat']):.1f} | {_mean(lev['max_leverage']):.3f} | "
                f"{_mean(lev['beta']):.3f} | {_mean(lev['d_shape']):.0f} | "
                f"{_mean(lev['d_theorem']):.0f} |"
            )
    return "\n".join(out)


def markdown_report(result: Any, command: str | None = None, plots: bool = True) -> str:
    """The report: command, inputs, figures, tables, notes, config, environment."""
    config = result.config
    lines = ["# Approximation study", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += ["Relative spectral error ||O - O_exact||_2 / ||O_exact||_2 of each method against "
              "the exact attention it approximates (softmax or Gaussian kernelized), per head; "
              "mean and spread over seeds and heads (over heads alone for a method that draws "
              "nothing: each seed gives it the same output). References: the error of the best "
              "rank-m approximation of the attention matrix (truncated SVD) times V, and the "
              "trivial answers (every row = the mean row of the exact output, and for softmax "
              "also every row = mean of V; '!' and the plots compare with the better). Zero "
              "output scores 1.0.", "", "## Inputs", ""]
    for s in result.sources:
        lines.append(f"- {s['source']}, N={s['seq_len']}: {s['description']}")
    lines.append("")
    if result.rows:
        lines += ["## Error against the number of features", ""]
        if plots:
            lines += [f"![errors]({FILES['errors']})", ""]
        lines += [_markdown_table(result.rows), ""]
    if result.analysis:
        lines += ["## Spectra, stable rank and statistical dimension", ""]
        if plots:
            lines += [f"![spectra]({FILES['spectra']})", "",
                      f"![leverage]({FILES['leverage']})", ""]
        lines += [analysis_table(result.analysis), ""]
    if result.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    secs = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    env = result.environment
    lines += ["## Run", "", f"Time: {secs}.", "",
              f"Environment: torch {env.get('torch')}, {env.get('torch_threads')} threads, "
              f"{env.get('cpu_count')} CPUs, {env.get('processor')}, load average before/after "
              f"{env.get('loadavg_before')} / {env.get('loadavg_after')}.", "",
              "Config:", "", "```", repr(dataclasses.asdict(config)), "```", ""]
    return "\n".join(lines)


def rounded_floats(obj: Any, digits: int = 6) -> Any:
    """``obj`` with every float rounded to ``digits`` significant digits."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: rounded_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded_floats(v, digits) for v in obj]
    return obj


def write_outputs(result: Any, out_dir: str | Path, *, plots: bool = True,
                  command: str | None = None) -> dict[str, Path]:
    """Write JSON, CSV, PNG plots and the markdown report into ``out_dir``; a plot this run
    does not draw (``plots=False``, no sweep or no analysis) is removed if an earlier run
    left it there."""
    from .plots import plot_errors, plot_leverage, plot_spectra

    out = Path(out_dir)
    made: list[str] = []
    data = result.to_dict()
    if command:
        data["command"] = command
    with replacing_together(out) as stage:  # all of this run's files, or none of them
        # Compact, 6 significant digits: the spectra and samples are long arrays.
        write_json(stage / FILES["json"], rounded_floats(data), indent=None)
        write_csv(stage / FILES["csv"], result.rows, metadata={
            "config": dataclasses.asdict(result.config), "environment": result.environment,
            "command": command,
        })
        made += ["json", "csv"]
        if plots:
            if result.rows:
                plot_errors(result, stage / FILES["errors"])
                made.append("errors")
            if result.analysis:
                plot_spectra(result, stage / FILES["spectra"])
                plot_leverage(result, stage / FILES["leverage"])
                made += ["spectra", "leverage"]
        atomic_write_text(stage / FILES["report"], markdown_report(result, command, plots))
        made.append("report")
    remove_stale(*(out / FILES[kind] for kind in ("errors", "spectra", "leverage")
                   if kind not in made))
    return {kind: out / FILES[kind] for kind in made}
