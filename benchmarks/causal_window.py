"""Does the exact local window help causal Skyformer / causal nystrom_softmax?

    python benchmarks/causal_window.py [--n 1024] [--m 128] [--layers 0 2 4] [--seeds 3]

On Q/K/V of pretrained MiniLM-L6 over the shipped public-domain text
(``skyformer.eval.data.qkv.load_qkv``), the relative Frobenius error (mean over
heads) of each causal approximation against its exact causal target (causal kernelized attention for
skyformer, causal softmax for nystrom_softmax), with ``causal_local`` True (exact keys
in the query's chunk of 64, landmarks for earlier chunks) and False (landmarks for
every key). Mean and standard deviation over seeds. Writes
``benchmarks/results/causal_window.{json,csv,png}`` (the config, the environment and
the command in both tables). Errors, not timings: runs anywhere.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.eval.data.qkv import load_qkv
from skyformer.eval.measure.metrics import relative_error
from skyformer.io import save_figure, write_csv, write_json
from skyformer.registry import attention

TARGET = {"skyformer": "kernelized", "nystrom_softmax": "softmax"}


def measure(n: int, m: int, layers: list[int], seeds: int) -> list[dict]:
    rows = []
    for layer in layers:
        data = load_qkv(seq_len=n, layer=layer)
        q, k, v = (t.double() for t in (data.q, data.k, data.v))
        for method, target in TARGET.items():
            exact = attention(q, k, v, target, causal=True)
            for local in (True, False):
                errors = [float(relative_error(
                    attention(q, k, v, method, causal=True, causal_local=local,
                              num_features=m, generator=torch.Generator().manual_seed(s)),
                    exact, ord="fro").mean()) for s in range(seeds)]
                rows.append({"layer": layer, "method": method, "causal_local": local, "n": n,
                             "num_features": m, "error_mean": statistics.mean(errors),
                             "error_std": statistics.pstdev(errors), "seeds": seeds})
                print(f"layer {layer} {method:16s} local={local!s:5s} "
                      f"error {rows[-1]['error_mean']:.4f} +- {rows[-1]['error_std']:.4f}")
    return rows


def write(rows: list[dict], out: Path, config: dict, argv: list[str] | None = None) -> None:
    """``out.{json,csv,png}``, each written atomically; both tables with the config, the
    environment and the command (``argv``: its arguments; None: this process's)."""
    metadata = run_metadata(__file__, argv, config)
    write_json(out.with_suffix(".json"), {**metadata, "rows": rows}, indent=2)
    write_csv(out.with_suffix(".csv"), rows, metadata=metadata)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['method']}\nL{r['layer']} {'local' if r['causal_local'] else 'landmarks'}"
              for r in rows]
    ax.bar(range(len(rows)), [r["error_mean"] for r in rows],
           yerr=[r["error_std"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("relative error vs exact causal")
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int_argument, default=1024)
    parser.add_argument("--m", type=positive_int_argument, default=128)
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--seeds", type=positive_int_argument, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "causal_window")
    args = parser.parse_args(argv)
    rows = measure(args.n, args.m, args.layers, args.seeds)
    write(rows, args.out, {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in vars(args).items()}, argv)


if __name__ == "__main__":
    main()
