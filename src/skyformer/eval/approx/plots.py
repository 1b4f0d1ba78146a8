"""Plots of the approximation study (matplotlib, written as PNG).

- errors: relative spectral error against m, one line per method (mean over seeds and
  heads, shaded from min to max), one panel per source and sequence length, log
  axes; the rank-m SVD floor and the trivial baseline of each target as references
  (Skyformer Figure 1, KDEformer Figure 4);
- spectra: singular values of the softmax matrix and of its sparse residual
  (KDEformer Figure 2) and of the attention outputs (Skyformer Appendix B, Figure 4);
- leverage: sorted ridge leverage scores of the lifted kernel matrix (Theorem 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...io import save_figure

SOURCE_LABEL = {
    "pretrained": "pretrained",
    "init": "randomly initialised",
    "glove": "GloVe",
    "gaussian": "Gaussian",
}
TARGET_STYLE = {"softmax": "-", "gaussian": "--"}
REFERENCE_COLOR = {"softmax": "black", "gaussian": "0.55"}
RESIDUAL_LABEL = {"lsh": "without the LSH blocks", "oracle": "without each row's top entries"}
# After tab10's ten: colours far from them and from the black/grey references.
EXTRA_COLORS = ("#000080", "#9acd32", "#ff1493", "#8b4513", "#00ced1", "#ffa500")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h")


# The trivial baselines' rows and their names in the legend
TRIVIAL = {"mean_v": "mean of V", "constant_row": "best constant row"}


def require_matplotlib(way_out: str | None = None) -> Any:
    """``matplotlib`` (a sentence with the fix where it is missing, and ``way_out``, the
    command's way to go without plots, e.g. ``"pass --no-plots"``). The figures are made
    without pyplot (``matplotlib.figure.Figure``), so the caller's backend (a notebook's,
    a GUI's) stays as it is."""
    try:
        import matplotlib
        import matplotlib.figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'skyformer[plot]'"
                          + (f" (or {way_out})." if way_out else ".")) from None
    return matplotlib


def require_figure_format(path: str | Path, flag: str) -> None:
    """A sentence, before any work, where ``path``'s suffix names a format matplotlib does
    not write (``--plot figure.txt`` failed in matplotlib's words after the tables were
    written); a name without a suffix is written as PNG."""
    require_matplotlib(f"leave out {flag}")
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(f"{flag} {path}: matplotlib writes "
                         f"{', '.join('.' + f for f in sorted(formats))}; end the name with one "
                         f"of them (e.g. .png).")


def _save(fig: Any, path: str | Path) -> Path:
    """Write the PNG through a temporary file and a rename (never half-written)."""
    return save_figure(fig, path, dpi=120, bbox_inches="tight")


def _label(source: str) -> str:
    return SOURCE_LABEL.get(source, source)


def _log_axes(ax: Any, x_base: float = 10) -> None:
    """Log scales on both axes of ``ax`` where a curve has a positive finite point; an
    axes with none (every number NaN: a Gaussian target that underflowed, see the
    notes) stays linear and says so, since matplotlib cannot log-scale it. Horizontal
    reference lines (``axhline``) are not curves: they set no data limits."""
    import math

    drawn = [y for line in ax.get_lines() if line.get_transform() == ax.transData
             for y in line.get_ydata() if math.isfinite(y) and y > 0]
    if not drawn:
        ax.text(0.5, 0.5, "nothing finite to draw on log axes (see the notes)",
                ha="center", va="center", transform=ax.transAxes, fontsize=8)
        return
    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")


def plot_errors(result: Any, path: str | Path) -> Path:
    """Error against m for every method, panels = sources x sequence lengths."""
    mpl = require_matplotlib()
    config = result.config
    rows = result.rows
    methods = list(dict.fromkeys(r["method"] for r in rows if r["kind"] == "method"))
    palette = [mpl.colormaps["tab10"](i) for i in range(10)] + list(EXTRA_COLORS)
    colors = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    markers = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(methods)}
    n_rows, n_cols = len(config.sources), len(config.seq_lens)
    fig = mpl.figure.Figure(figsize=(3.4 * n_cols + 0.6, 2.9 * n_rows + 0.4))
    axes = fig.subplots(n_rows, n_cols, squeeze=False, sharey="row")
    handles: dict[str, Any] = {}
    for i, source in enumerate(config.sources):
        for j, n in enumerate(config.seq_lens):
            ax = axes[i][j]
            panel = [r for r in rows if r["source"] == source and r["seq_len"] == n]
            ms = sorted({r["num_features"] for r in panel if r["num_features"] is not None})
            for method in methods:
                line = sorted((r for r in panel if r["kind"] == "method" and r["method"] == method),
                              key=lambda r: r["num_features"])
                if not line:
                    continue
                target = line[0]["target"]
                x = [r["num_features"] for r in line]
                (h,) = ax.plot(x, [r["spectral_mean"] for r in line], marker=markers[method],
                               markersize=3.5,
                               linestyle=TARGET_STYLE[target], color=colors[method], linewidth=1.4)
                ax.fill_between(x, [r["spectral_min"] for r in line],
                                [r["spectral_max"] for r in line], color=colors[method], alpha=0.12,
                                linewidth=0)
                handles.setdefault(f"{method} ({target})", h)
            for target in ("softmax", "gaussian"):
                floor = sorted((r for r in panel if r["kind"] == "floor" and r["target"] == target),
                               key=lambda r: r["num_features"])
                if floor:
                    (h,) = ax.plot([r["num_features"] for r in floor],
                                   [r["spectral_mean"] for r in floor],
                                   color=REFERENCE_COLOR[target],
                                   linestyle=":", linewidth=1.6)
                    handles.setdefault(f"rank-m SVD floor ({target})", h)
                # the better trivial answer, as the tables' "!" compares with
                base = [r["spectral_mean"] for r in panel
                        if r["method"] in TRIVIAL and r["target"] == target]
                if base and ms:
                    h = ax.axhline(min(base), color=REFERENCE_COLOR[target],
                                   linestyle="-.", linewidth=1.0)
                    names = sorted({TRIVIAL[r["method"]] for r in panel
                                    if r["method"] in TRIVIAL and r["target"] == target})
                    handles.setdefault(f"trivial: {' or '.join(names)}, the better "
                                       f"({target})" if len(names) > 1 else
                                       f"trivial: {names[0]} ({target})", h)
            _log_axes(ax, x_base=2)
            if ms:
                ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_title(f"{_label(source)}, N={n}", fontsize=9)
            ax.grid(True, which="both", alpha=0.25)
            ax.tick_params(labelsize=8)
            if i == n_rows - 1:
                ax.set_xlabel("number of features m", fontsize=8)
            if j == 0:
                ax.set_ylabel("relative spectral error", fontsize=8)
    fig.suptitle("||O - O_exact||_2 / ||O_exact||_2 against the method's exact target "
                 "(line: mean over seeds and heads, band: min to max)", fontsize=9)
    fig.tight_layout()
    # Hung from the figure's lower edge, below the axis labels whatever its height (one
    # row of panels is too short for a legend sized as a fraction of the figure); the
    # saved PNG grows to hold it (bbox_inches="tight").
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center",
               ncol=min(4, len(handles)), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return _save(fig, path)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _mean_curve(values: list[list[float]]) -> tuple[list[int], list[float]]:
    """Mean over heads of per-head curves (equal lengths), indices from 1."""
    import torch

    t = torch.tensor(values, dtype=torch.float64)
    return list(range(1, t.shape[-1] + 1)), t.mean(dim=0).tolist()


def plot_spectra(result: Any, path: str | Path) -> Path:
    """Singular values: softmax matrix vs its residual (top), attention outputs (bottom)."""
    import torch

    mpl = require_matplotlib()
    analysis = result.analysis
    fig = mpl.figure.Figure(figsize=(4.2 * len(analysis), 6.4))
    axes = fig.subplots(2, len(analysis), squeeze=False)
    for j, a in enumerate(analysis):
        ax = axes[0][j]
        soft = torch.tensor(a["spectra"]["softmax"], dtype=torch.float64)  # [H, N]
        top = soft[:, :1]
        idx = list(range(1, soft.shape[-1] + 1))
        ax.plot(idx, (soft / top).mean(0).tolist(), color="C0",
                label=f"softmax D^-1 A (srank {_mean(a['softmax_srank']):.1f})")
        for i, r in enumerate(a["residuals"]):
            res = torch.tensor(r["singular_values"], dtype=torch.float64)
            ax.plot(idx, (res / top).mean(0).tolist(), color=("C3", "C4", "C5")[i % 3],
                    label=f"residual {RESIDUAL_LABEL.get(r['mask'], r['mask'])} "
                          f"(srank {_mean(r['srank']):.1f})")
        ax.set_yscale("log")
        ax.set_title(f"{_label(a['source'])}, N={a['seq_len']}", fontsize=9)
        ax.set_xlabel("index i", fontsize=8)
        ax.set_ylabel("sigma_i / sigma_1(D^-1 A), mean over heads", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.25)
        ax = axes[1][j]
        layer = torch.tensor(a["spectra"]["layer_output"], dtype=torch.float64)
        ax.plot(range(1, layer.numel() + 1), (layer / layer[0]).tolist(), color="C2",
                label=f"heads side by side [N, H Dv] (srank {a['layer_output_srank']:.1f})")
        out = torch.tensor(a["spectra"]["output"], dtype=torch.float64)
        x, y = _mean_curve((out / out[:, :1]).tolist())
        ax.plot(x, y, color="C1",
                label=f"one head [N, Dv], mean (srank {_mean(a['output_srank']):.1f})")
        ax.set_yscale("log")
        ax.set_xlabel("index i", fontsize=8)
        ax.set_ylabel("sigma_i / sigma_1 of the exact output", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.25)
    fig.suptitle("Singular values: softmax matrix and its residuals without a sparse part "
                 "(KDEformer Fig. 2); attention outputs (Skyformer App. B)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def plot_leverage(result: Any, path: str | Path) -> Path:
    """Sorted ridge leverage scores of the lifted kernel matrix, per epsilon."""
    mpl = require_matplotlib()
    analysis = result.analysis
    fig = mpl.figure.Figure(figsize=(4.2 * len(analysis), 3.4))
    axes = fig.subplots(1, len(analysis), squeeze=False)
    for j, a in enumerate(analysis):
        ax = axes[0][j]
        for i, lev in enumerate(a["leverage"]):
            x, y = _mean_curve(lev["leverage_sorted"])
            ax.plot(x, y, color=f"C{i}", label=f"eps={lev['eps']:g}: d_stat="
                    f"{_mean(lev['d_stat']):.0f}, Thm 2 d={_mean(lev['d_theorem']):.3g}")
        _log_axes(ax)
        n2 = 2 * a["seq_len"]
        ax.set_title(f"{_label(a['source'])}, 2n={n2}", fontsize=9)
        ax.set_xlabel("rank of the row of [Q; K]", fontsize=8)
        ax.set_ylabel("ridge leverage score (mean over heads)", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.25)
    fig.suptitle("Ridge leverage scores of the lifted Gaussian kernel matrix "
                 "(Skyformer Theorem 2, lambda = eps ||C||)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)
