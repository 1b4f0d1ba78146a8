"""The table ``skyformer compare`` prints."""

from __future__ import annotations

from typing import Any

from ...registry import get_method
from ..measure.memory import CPU_RESOLUTION_BYTES

SMALL = f"<{CPU_RESOLUTION_BYTES / 2**20:g}"  # a peak below the CPU measurement's resolution

# What each number of a row is, in its unit: the table's legend and the result file's
# "columns" (the trivial answer's is TRIVIAL_LEGEND)
COLUMNS = {
    "num_features": "the num_features the method is called with (its default where none "
                    "is given), after the caps a call applies before it runs (Nystromformer's "
                    "landmarks, Reformer's chunks); the Skyformer family and Informer use "
                    "at most the rows the sequence has, BigBird at least its 5 + r blocks "
                    "of one key (8 keys a query by default); - for linear (it has none) "
                    "and for Informer at its default, u = factor * ceil(ln Nq) active "
                    "queries; exact = an exact method",
    "spectral_error": "relative spectral-norm error ||O - O_exact||_2 / ||O_exact||_2 of "
                      "each head's output [Nq, Dv] against the method's exact target (in "
                      "float32 for half-precision inputs; norms in float64); mean +- sample "
                      "std over those with a finite error (all but nonfinite) of the B * H "
                      "heads",
    "spectral_error_std": "sample standard deviation of the spectral error over the same "
                          "heads",
    "spectral_error_median": "median of the spectral error over the same heads",
    "spectral_error_max": "largest spectral error over the same heads: the worst head, "
                          "which a mean over many heads can hide",
    "frobenius_error": "relative Frobenius-norm error against the same target, mean over "
                       "the same heads",
    "samples": "the heads of every sequence, B * H",
    "nonfinite": "heads whose spectral error is not finite: where NaN or inf in the "
                 "inputs reach the exact output (or it is all zero), the head has no error "
                 "and is left out of every row's mean and std alike; where only the "
                 "method's output is not finite, the method failed there and its mean and "
                 "std are NaN (as approx's rows: a method failing on some heads must not "
                 "read as if it had none)",
    "time_ms": "median wall-clock milliseconds of one forward call on the whole batch, over "
               "the timed repeats after one warm-up call",
    "peak_mib": "peak memory in MiB (2^20 bytes) of one forward call above what was there "
                "before it (CUDA: allocated; CPU: resident, in a fresh process); - = not "
                "measured",
}
HEADERS = {"num_features": "features", "spectral_error": "spectral err",
           "spectral_error_max": "worst", "frobenius_error": "frob err", "time_ms": "time ms",
           "peak_mib": "peak MiB"}


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of compare rows (the method column fits the longest name)."""
    width = max([18] + [len(r["method"]) + 2 for r in rows])
    header = (f"{'method':<{width}}{'target':<10}{'features':>9}{'spectral err':>23}"
              f"{'worst':>8}{'trivial':>9}{'frob err':>10}{'time ms':>10}{'peak MiB':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        feats = (
            "exact"
            if r["exact"]
            else str(r["num_features"] if r["num_features"] is not None else "-")
        )
        if r.get("status", "ok") != "ok":
            lines.append(f"{r['method']:<{width}}{r['target']:<10}{feats:>9}  "
                         f"{r['status']}: {r['reason']}")
            continue
        mark = "!" if r.get("worse_than_trivial") else " "
        err = f"{r['spectral_error']:.4f} +- {r['spectral_error_std']:.4f}{mark}"
        trivial = "-" if r.get("trivial_error") is None else f"{r['trivial_error']:.4f}"
        worst = "-" if r.get("spectral_error_max") is None else f"{r['spectral_error_max']:.4f}"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        if r.get("peak_below_resolution"):
            peak = SMALL
        lines.append(
            f"{r['method']:<{width}}{r['target']:<10}{feats:>9}{err:>23}{worst:>8}{trivial:>9}"
            f"{r['frobenius_error']:>10.4f}{r['time_ms']:>10.2f}{peak:>10}{nonfinite(r)}"
        )
    lines += legend(rows)
    if any(nonfinite(r) for r in rows):
        lines.append(f"{NONFINITE_MARK}: {COLUMNS['nonfinite']}.")
    if any(r.get("peak_below_resolution") for r in rows):
        lines.append(f"peak MiB {SMALL}: a CPU peak under {CPU_RESOLUTION_BYTES / 2**20:g} MiB, "
                     f"below the measurement's resolution (it says only \"small\"; the "
                     f"measured value is the row's peak_mib).")
    not_run = not_measured(rows)
    if not_run:
        lines.append(f"{not_run} of {len(rows)} methods not measured on these inputs (their "
                     f"rows say why).")
    return "\n".join(lines)


NONFINITE_MARK = "n of m heads not finite"  # what the legend calls a row's nonfinite


def nonfinite(row: dict[str, Any]) -> str:
    """The end of a row with heads that have no finite error: how many of how many."""
    count = row.get("nonfinite")
    return f"  {count} of {row['samples']} heads not finite" if count else ""


def legend(rows: list[dict[str, Any]]) -> list[str]:
    """The lines under the table that say what each column is (``COLUMNS``)."""
    samples = {r["samples"] for r in rows if r.get("samples")}
    lines = []
    for key, header in HEADERS.items():
        here = f" ({samples.pop()} heads here)" if key == "spectral_error" \
            and len(samples) == 1 else ""
        lines.append(f"{header}: {COLUMNS[key]}{here}.")
    return [*lines, TRIVIAL_LEGEND, *_untrained(rows)]


def _untrained(rows: list[dict[str, Any]]) -> list[str]:
    """A legend line for the methods with learned parameters (Linformer's projections):
    compare calls every method as a function, which draws them anew, untrained, at every
    call."""
    names = [r["method"] for r in rows
             if r.get("status", "ok") == "ok" and _learns(r["method"])]
    if not names:
        return []
    return [f"{', '.join(names)}: learned parameters, here drawn anew and untrained at every "
            f"call (a direct call; Linformer's random projections): the time includes the "
            f"drawing and the error is that of untrained parameters, not of a trained model "
            f"(bench times it as a layer, its parameters held)."]


def _learns(name: str) -> bool:
    try:
        return get_method(name).capabilities.learned_parameters
    except (ValueError, TypeError):  # a row of a method no longer registered, or none
        # named (a result file read back)
        return False


def not_measured(rows: list[dict[str, Any]]) -> int:
    """How many rows have no numbers: methods that could not run the inputs."""
    return sum(r.get("status", "ok") != "ok" for r in rows)


TRIVIAL_LEGEND = (
    "trivial: spectral error of the better trivial answer against the same target, every "
    "row = the mean of V or all zeros (error 1); ! = the method is further from its target "
    "than that answer, or its error is not finite."
)
