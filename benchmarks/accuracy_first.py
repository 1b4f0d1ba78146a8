"""Accuracy-first Skyformer variants against the published methods, on real MiniLM Q/K/V.

    python benchmarks/accuracy_first.py [--parts table,baselines,tolerance,speed]
        [--out benchmarks/results/accuracy_first] [--threads 1]

Parts (each prints a Markdown table and goes into one JSON/CSV pair with the settings,
the environment and the command, in the CSV as ``# key: <json>`` lines first; a PNG
plots the baseline sweep):

- ``table``: pretrained MiniLM-L6, layers 0/2/4, N = 512 and 2048 (windows of 512
  concatenated), every approximate method at 128 features, 3 seeds, mean over the 12
  heads of the relative spectral error against its exact target; the rank-128
  truncated-SVD floor of the attention matrix (randomised subspace iteration with 64
  extra columns and 4 power steps), every row = mean(V) (softmax), every row = the mean
  output row (both targets).
- ``baselines``: the new methods against the trivial answers on every input kind the
  approximation study offers (pretrained, randomly initialised MiniLM, synthetic
  Gaussian Q/K/V with row norm 6), N = 512 and 2048, m = 16 .. 256, 3 seeds: the worst
  ratio error / trivial error over heads, seeds and settings.
- ``tolerance``: the error-targeted mode on pretrained layers 0/2/4 at N = 2048: budget
  chosen per head, its estimate, and the measured errors.
- ``speed``: forward + backward at N = 16384, B = 1, H = 2, D = 32, every method timed in
  turn inside each repetition (medians; ratios to Skyformer); ``uptime`` before and after;
  peak memory of forward + backward in a fresh process per method.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.eval.data.qkv import extract_qkv, load_model
from skyformer.eval.data.text import default_text
from skyformer.eval.measure.memory import MemoryJob, peak_memory_bytes
from skyformer.eval.measure.metrics import relative_error
from skyformer.io import save_figure, write_csv, write_json
from skyformer.linalg import gaussian_scores, softmax_scores
from skyformer.ops.multipole import multipole_with_choice
from skyformer.registry import attention, get_method, list_methods

NEW = ("skyformer_adaptive", "skyformer_multipole", "softmax_multipole")
EXACT = {"softmax": "softmax", "gaussian": "kernelized"}


def uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return "uptime unavailable"


def approximate_methods() -> list[str]:
    return [
        m
        for m in list_methods()
        if not get_method(m).capabilities.exact and not get_method(m).capabilities.fixed_length
    ]


class Data:
    """Q/K/V ``[1, H, N, D]`` (float64) by source, length and layer, loaded once."""

    def __init__(self) -> None:
        self.models: dict[bool, Any] = {}
        self.cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, source: str, n: int, layer: int = 0) -> tuple[torch.Tensor, ...]:
        key = (source, n, layer)
        if key not in self.cache:
            if source == "gaussian":
                g = torch.Generator().manual_seed(n)
                q, k, v = (
                    torch.randn(1, 12, n, 32, generator=g, dtype=torch.float64) for _ in range(3)
                )
                q, k = q * 6 / math.sqrt(32), k * 6 / math.sqrt(32)  # root-mean-square row norm 6
            else:
                pretrained = source == "pretrained"
                if pretrained not in self.models:
                    self.models[pretrained] = load_model(pretrained=pretrained, seed=0)
                model, tok, name = self.models[pretrained]
                x = extract_qkv(
                    model,
                    tok,
                    default_text(),
                    seq_len=n,
                    layer=layer,
                    name=name,
                    pretrained=pretrained,
                )
                q, k, v = (t.double() for t in (x.q, x.k, x.v))
            self.cache[key] = (q, k, v)
        return self.cache[key]


def exact_outputs(q, k, v) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {t: attention(q, k, v, EXACT[t]) for t in EXACT}


def trivial_errors(v, exact) -> dict[str, torch.Tensor]:
    """[H] errors of: every row = mean(V) (softmax only), every row = the mean exact row."""
    out = {
        "mean_v": relative_error(
            v.mean(2, keepdim=True).expand_as(exact["softmax"]), exact["softmax"]
        )[0]
    }
    for t, o in exact.items():
        out[f"constant_row_{t}"] = relative_error(o.mean(2, keepdim=True).expand_as(o), o)[0]
    return out


def floor(scores: torch.Tensor, v: torch.Tensor, exact: torch.Tensor, rank: int) -> torch.Tensor:
    """[H] error of A_r V, A_r the rank-r truncated SVD (randomised subspace iteration)."""
    a = scores[0].float()
    g = torch.Generator().manual_seed(0)
    omega = torch.randn(a.shape[0], a.shape[2], rank + 64, generator=g)
    y = a @ omega
    for _ in range(4):
        y = a @ (a.transpose(-1, -2) @ torch.linalg.qr(y).Q)
    basis = torch.linalg.qr(y).Q  # [H, N, r + 64]
    small = basis.transpose(-1, -2) @ a
    u, s, vh = torch.linalg.svd(small, full_matrices=False)
    a_r = (basis @ u[..., :rank]) * s[..., None, :rank] @ vh[..., :rank, :]
    return relative_error(a_r.double() @ v[0], exact[0])


def run_method(name: str, q, k, v, seed: int, **options) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return attention(q.float(), k.float(), v.float(), name, generator=g, **options)


def part_table(data: Data, seeds: int) -> list[dict[str, Any]]:
    rows = []
    methods = approximate_methods()
    for n in (512, 2048):
        for layer in (0, 2, 4):
            q, k, v = data.get("pretrained", n, layer)
            exact = exact_outputs(q, k, v)
            base = trivial_errors(v, exact)
            floors = {
                "softmax": floor(softmax_scores(q, k), v, exact["softmax"], 128),
                "gaussian": floor(gaussian_scores(q, k), v, exact["gaussian"], 128),
            }
            for t in EXACT:
                rows.append(
                    {
                        "n": n,
                        "layer": layer,
                        "method": "svd_floor",
                        "target": t,
                        "error": floors[t].mean().item(),
                    }
                )
                rows.append(
                    {
                        "n": n,
                        "layer": layer,
                        "method": "constant_row",
                        "target": t,
                        "error": base[f"constant_row_{t}"].mean().item(),
                    }
                )
            rows.append(
                {
                    "n": n,
                    "layer": layer,
                    "method": "mean_v",
                    "target": "softmax",
                    "error": base["mean_v"].mean().item(),
                }
            )
            for name in methods:
                target = get_method(name).capabilities.target
                try:
                    errs = [
                        relative_error(
                            run_method(name, q, k, v, s, num_features=128), exact[target]
                        )
                        .mean()
                        .item()
                        for s in range(seeds)
                    ]
                except (ValueError, RuntimeError) as err:  # a method that cannot run this setting
                    print(f"N={n} layer {layer} {name}: skipped ({err})", flush=True)
                    continue
                rows.append(
                    {
                        "n": n,
                        "layer": layer,
                        "method": name,
                        "target": target,
                        "error": statistics.mean(errs),
                        "error_min": min(errs),
                        "error_max": max(errs),
                    }
                )
                print(f"N={n} layer {layer} {name:<22} {rows[-1]['error']:.3f}", flush=True)
    return rows


def part_baselines(data: Data, seeds: int) -> list[dict[str, Any]]:
    rows = []
    for source in ("pretrained", "init", "gaussian"):
        for n in (512, 2048):
            q, k, v = data.get(source, n, 0)
            exact = exact_outputs(q, k, v)
            base = trivial_errors(v, exact)
            for m in (16, 32, 64, 128, 256):
                for name in NEW:
                    target = get_method(name).capabilities.target
                    trivial = (
                        base["mean_v"] if target == "softmax" else base["constant_row_gaussian"]
                    )
                    errs = torch.stack(
                        [
                            relative_error(
                                run_method(name, q, k, v, s, num_features=m), exact[target]
                            )[0]
                            for s in range(seeds)
                        ]
                    )  # [seeds, H]
                    ratio = (errs / trivial).max().item()
                    rows.append(
                        {
                            "source": source,
                            "n": n,
                            "m": m,
                            "method": name,
                            "target": target,
                            "error": errs.mean().item(),
                            "trivial": trivial.mean().item(),
                            "worst_ratio": ratio,
                        }
                    )
                    print(
                        f"{source:<10} N={n} m={m:<4} {name:<20} err {rows[-1]['error']:.3f} "
                        f"trivial {rows[-1]['trivial']:.3f} worst ratio {ratio:.3f}",
                        flush=True,
                    )
    return rows


def part_tolerance(data: Data) -> list[dict[str, Any]]:
    rows = []
    for layer in (0, 2, 4):
        q, k, v = data.get("pretrained", 2048, layer)
        exact = exact_outputs(q, k, v)
        for name in ("softmax_multipole", "skyformer_multipole"):
            target = get_method(name).capabilities.target
            for tol in (0.05, 0.1, 0.2):
                with torch.no_grad():
                    out, choice = multipole_with_choice(
                        name,
                        q.float(),
                        k.float(),
                        v.float(),
                        generator=torch.Generator().manual_seed(0),
                        num_features=256,
                        tolerance=tol,
                    )
                rows.append(
                    {
                        "layer": layer,
                        "method": name,
                        "tolerance": tol,
                        "features": choice.features[0].tolist(),
                        "mean_features": choice.features.double().mean().item(),
                        "estimate": choice.estimate.mean().item(),
                        "frobenius_error": relative_error(out, exact[target], ord="fro")
                        .mean()
                        .item(),
                        "spectral_error": relative_error(out, exact[target]).mean().item(),
                        "heads_meeting": (relative_error(out, exact[target], ord="fro")[0] <= tol)
                        .sum()
                        .item(),
                    }
                )
                r = rows[-1]
                print(
                    f"layer {layer} {name:<20} tol {tol:<5} features {r['mean_features']:6.1f} "
                    f"estimate {r['estimate']:.3f} frob {r['frobenius_error']:.3f} "
                    f"spectral {r['spectral_error']:.3f}",
                    flush=True,
                )
    return rows


def part_speed(n: int, repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g, requires_grad=True) for _ in range(3))
    methods = ["skyformer", *NEW, "nystrom_softmax"]

    def step(name: str) -> float:
        start = time.perf_counter()
        out = attention(q, k, v, name, generator=torch.Generator().manual_seed(0))
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None
        return time.perf_counter() - start

    for name in methods:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in methods}
    before = uptime()
    for _ in range(repeats):
        for name in methods:
            times[name].append(step(name))
    after = uptime()
    base = statistics.median(times["skyformer"])
    peaks = {
        name: peak_memory_bytes(MemoryJob(name, (1, 2, n, 32), backward=True)) / 2**20
        for name in methods
    }
    return [
        {
            "method": name,
            "n": n,
            "fwd_bwd_ms": statistics.median(times[name]) * 1e3,
            "ratio_to_skyformer": statistics.median(times[name]) / base,
            "peak_mib": peaks[name],
            "peak_ratio_to_skyformer": peaks[name] / peaks["skyformer"],
            "uptime_before": before,
            "uptime_after": after,
        }
        for name in methods
    ]


def markdown(rows: list[dict[str, Any]], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys)
            + " |"
        )
    return "\n".join(lines)


def table_markdown(rows: list[dict[str, Any]]) -> str:
    """One line per (method, target), columns N/layer."""
    cols = sorted({(r["n"], r["layer"]) for r in rows})
    lines = [
        "| method | target | "
        + " | ".join(f"N={n} L{layer}" for n, layer in cols)
        + " | mean N=2048 |",
        "|" + "---|" * (len(cols) + 3),
    ]
    for method, target in dict.fromkeys((r["method"], r["target"]) for r in rows):
        cells = {
            (r["n"], r["layer"]): r["error"]
            for r in rows
            if r["method"] == method and r["target"] == target
        }
        big = [cells[c] for c in cols if c[0] == 2048 and c in cells]
        lines.append(
            f"| {method} | {target} | "
            + " | ".join(f"{cells[c]:.3f}" if c in cells else "-" for c in cols)
            + f" | {statistics.mean(big):.3f} |"
        )
    return "\n".join(lines)


def plot_baselines(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'skyformer[plot]').")
        return
    sources = sorted({r["source"] for r in rows})
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 4), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        for name in NEW:
            for n, style in ((512, "--"), (2048, "-")):
                sel = [
                    r
                    for r in rows
                    if r["source"] == source and r["method"] == name and r["n"] == n
                ]
                ax.plot(
                    [r["m"] for r in sel],
                    [r["error"] / r["trivial"] for r in sel],
                    style,
                    marker="o",
                    label=f"{name} N={n}",
                )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(source)
        ax.set_xlabel("features m")
        ax.set_ylabel("error / trivial answer's error")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)  # atomically, as the JSON and CSV beside it


def write_rows(out: Path, part: str, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
    """``out/PART.json`` and ``out/PART.csv``, both with ``metadata`` (``run_metadata``)."""
    write_json(out / f"{part}.json", {**metadata, "rows": rows})
    write_csv(out / f"{part}.csv", rows, metadata=metadata)


PARTS = ("table", "baselines", "tolerance", "speed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--out", default=str(RESULTS / "accuracy_first"),
                        help="folder of the results (default: the committed ones, which a "
                             "run replaces; pass another folder to keep them)")
    parser.add_argument("--seeds", type=positive_int_argument, default=3)
    parser.add_argument("--threads", type=positive_int_argument, default=1)
    parser.add_argument("--speed-n", type=positive_int_argument, default=16384)
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts.split(",") if part not in PARTS]
    if unknown:  # before any part runs, not after the earlier ones have
        parser.error(f"unknown part(s) {', '.join(map(repr, unknown))}; the parts are "
                     f"{', '.join(PARTS)}.")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    data = Data()
    for part in args.parts.split(","):
        start = time.time()
        if part == "table":
            rows = part_table(data, args.seeds)
            print(table_markdown(rows))
        elif part == "baselines":
            rows = part_baselines(data, args.seeds)
            print(
                markdown(rows, ["source", "n", "m", "method", "error", "trivial", "worst_ratio"])
            )
            plot_baselines(rows, out / "baselines.png")
        elif part == "tolerance":
            rows = part_tolerance(data)
            print(
                markdown(
                    rows,
                    [
                        "layer",
                        "method",
                        "tolerance",
                        "mean_features",
                        "estimate",
                        "frobenius_error",
                        "spectral_error",
                        "heads_meeting",
                    ],
                )
            )
        elif part == "speed":
            rows = part_speed(args.speed_n, args.repeats)
            print(
                markdown(
                    rows,
                    [
                        "method",
                        "n",
                        "fwd_bwd_ms",
                        "ratio_to_skyformer",
                        "peak_mib",
                        "peak_ratio_to_skyformer",
                    ],
                )
            )
            print(rows[0]["uptime_before"], "|", rows[0]["uptime_after"])
        else:
            raise SystemExit(f"unknown part {part!r}; parts: table, baselines, tolerance, speed.")
        config = vars(args) | {"part": part, "seconds": time.time() - start}
        write_rows(out, part, rows, run_metadata(__file__, argv, config, "cpu"))
        print(f"[{part}: {time.time() - start:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
