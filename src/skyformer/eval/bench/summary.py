"""The summary of a ``skyformer bench`` run: per method, ratios to the reference, N -> 2N
growth, the crossover length and the fitted scaling exponent, each taken within one
run (``run``, an index into ``BenchResult.runs``)."""

from __future__ import annotations

import math
from typing import Any

from ..measure.memory import above_resolution


def _fit_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log t against log N over the points given."""
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def crossover(points: list[tuple[int, float]]) -> tuple[float | None, str]:
    """Where a method becomes faster than the reference for good.

    ``points``: (N, reference time / method time). Returns (N*, how): the length from
    which the method is faster at every larger measured N, interpolated in log-log
    between the last slower and the first faster length ("interpolated"); the first
    length if it is faster everywhere ("at most"); None if it is slower at the largest:
    "never" where it is slower at every length, else "not at the largest".
    """
    points = sorted(points)
    if not points or points[-1][1] < 1:
        return None, "never" if all(r < 1 for _, r in points) else "not at the largest"
    i = len(points) - 1
    while i > 0 and points[i - 1][1] >= 1:
        i -= 1
    if i == 0:
        return float(points[0][0]), "at most"
    (n0, r0), (n1, r1) = points[i - 1], points[i]
    lr0, lr1 = math.log(r0), math.log(r1)
    frac = -lr0 / (lr1 - lr0) if lr1 != lr0 else 0.0
    return math.exp(math.log(n0) + frac * (math.log(n1) - math.log(n0))), "interpolated"


def summarise(rows: list[dict[str, Any]], reference: str, backward: bool) -> list[dict[str, Any]]:
    """Per (shape, dtype, device) and method: ratios to the reference, N -> 2N growth,
    crossover length and the scaling exponent of time over the longest quarter of
    the sweep (at least the two longest lengths). Each is taken between rows of one run
    (``run``, --resume): growth between runs is left out, and an exponent whose points
    span runs, or a crossover interpolated between two runs' lengths, is None
    (``exponent_across_runs``, crossover "across runs")."""
    key = "fwd_bwd_ms" if backward else "fwd_ms"
    groups: dict[tuple, dict[str, dict[int, dict[str, Any]]]] = {}
    for row in rows:
        g = (row["device"], row["dtype"], row["batch"], row["heads"], row["head_dim"])
        groups.setdefault(g, {}).setdefault(row["method"], {})[row["n"]] = row
    out = []
    for g, by_method in groups.items():
        ref = by_method.get(reference, {})
        for method, by_n in by_method.items():
            ok = sorted((n, r) for n, r in by_n.items() if r["status"] == "ok" and r[key])
            _ratios(ok, ref, key, g[0])
            _growth(ok, key)
            out.append({"device": g[0], "dtype": g[1], "batch": g[2], "heads": g[3],
                        "head_dim": g[4], "method": method,
                        **_crossover_of(ok, method != reference), **_exponent_of(ok, key)})
    return out


def _run_of(row: dict[str, Any]) -> int:
    """The index of the run that measured ``row`` (0 for rows of files without runs)."""
    return row.get("run") or 0


def _ratios(ok: list[tuple[int, dict[str, Any]]], ref: dict[int, dict[str, Any]], key: str,
            device: str) -> None:
    """Each row's speed-up and memory ratio against the reference's row at its N."""
    for n, r in ok:
        base = ref.get(n)
        if not (base and base["status"] == "ok" and base[key]
                and _run_of(base) == _run_of(r)):
            continue
        r["speedup"] = base[key] / r[key]
        peaks = [None if x["peak_mib"] is None else x["peak_mib"] * 2**20 for x in (r, base)]
        if peaks[1] and all(above_resolution(peak, device) for peak in peaks):
            r["memory_ratio"] = r["peak_mib"] / base["peak_mib"]


def _growth(ok: list[tuple[int, dict[str, Any]]], key: str) -> None:
    """Each row's time over that at N/2, measured in the same run (any measured N/2,
    not only the previous length)."""
    by_length = dict(ok)
    for n1, r1 in ok:
        r0 = by_length.get(n1 // 2) if n1 % 2 == 0 else None
        if r0 is not None and r0[key] and _run_of(r0) == _run_of(r1):
            r1["growth"] = r1[key] / r0[key]


def _crossover_of(ok: list[tuple[int, dict[str, Any]]], against: bool) -> dict[str, Any]:
    """``crossover_n`` and ``crossover`` (how) of the rows' speed-ups: none for the
    reference itself or where nothing was timed beside it, "across runs" where it is
    interpolated between two lengths measured by different runs (--resume). Each
    speed-up is a ratio of one run's times at one length, so only the interpolation
    mixes runs: "at most", "never" and "not at the largest" hold whatever run measured
    each length. ``faster_at``: the lengths where it was faster (for "not at the
    largest")."""
    timed = sorted((n, r) for n, r in ok if r["speedup"])
    if not (timed and against):
        return {"crossover_n": None, "crossover": None}
    cross, how = crossover([(n, r["speedup"]) for n, r in timed])
    if how == "not at the largest":
        return {"crossover_n": None, "crossover": how,
                "faster_at": [n for n, r in timed if r["speedup"] >= 1]}
    if how == "interpolated":
        first = len(timed) - 1  # the first length of the faster tail, as crossover's
        while first > 0 and timed[first - 1][1]["speedup"] >= 1:
            first -= 1
        if _run_of(timed[first - 1][1]) != _run_of(timed[first][1]):
            return {"crossover_n": None, "crossover": "across runs"}
    return {"crossover_n": cross, "crossover": how}


def _exponent_of(ok: list[tuple[int, dict[str, Any]]], key: str) -> dict[str, Any]:
    """The fitted exponent of time over the longest quarter of the lengths (at least the
    two longest), its range, and whether it was left out for spanning runs."""
    longest = [(n, r) for n, r in ok if n * 4 >= ok[-1][0]] if ok else []
    if len(longest) < 2:
        longest = ok[-2:]
    across = len({_run_of(r) for _, r in longest}) > 1
    return {
        "exponent": None if across else _fit_exponent([(n, r[key]) for n, r in longest]),
        "exponent_range": [longest[0][0], longest[-1][0]] if len(longest) >= 2 else None,
        "exponent_across_runs": across,
    }
