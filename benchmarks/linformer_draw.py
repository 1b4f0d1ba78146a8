"""Linformer's direct call with its projections drawn two ways, in one run (CPU).

    python benchmarks/linformer_draw.py [--seq-lens 512 2048 8192] [--heads 12]

A direct Linformer call (no ``proj_k`` / ``proj_v``) draws E and F, 2 H k N Gaussian
numbers, every call. This times draw + attention with the numbers from ``rng.normal``
(four 32-bit hashes a number: two 53-bit uniforms, one Box-Muller output) and from
``rng.bulk_normal`` (one hash a number: 24-bit uniforms, both outputs; what
``gaussian_columns`` uses), interleaved, next to exact softmax on the same inputs.
Writes ``benchmarks/results/linformer_draw.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from run_metadata import run_metadata  # benchmarks/, beside this script

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.io import atomic_write_text, write_json
from skyformer.ops.linformer import linformer_attention
from skyformer.sketch.rng import bulk_normal, normal, stream

RESULTS = Path(__file__).parent / "results"
DRAWS = {"normal": normal, "bulk_normal": bulk_normal}


def projections(draw, key: torch.Tensor, heads: int, k: int, n: int) -> list[torch.Tensor]:
    """E and F ``[H, k, n]``, N(0, 1/k), column j from the key and j: the shapes, scale
    and indexing of ``jl_projections``, by ``draw``."""
    return [draw(stream(key, name), (n, heads, k)).movedim(0, -1) / math.sqrt(k)
            for name in ("E", "F")]


def calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor,
          features: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The timed calls: Linformer with each draw (draw included), and exact softmax."""
    heads, n = q.shape[1], q.shape[2]

    def linformer(draw: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            e, f = projections(draw, key, heads, features, n)
            return linformer_attention(q, k, v, num_features=features, proj_k=e, proj_v=f)
        return call

    return {**{name: linformer(draw) for name, draw in DRAWS.items()},
            "softmax": lambda: skyformer.attention(q, k, v, "softmax")}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=positive_int_argument,
                        nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=positive_int_argument, default=12)
    parser.add_argument("--head-dim", type=positive_int_argument, default=32)
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    parser.add_argument("--threads", type=positive_int_argument, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "linformer_draw")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    key = skyformer.random_key(0)
    rows = []
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=g) for _ in range(3))
        timed = calls(q, k, v, key, args.features)
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.repeats + 1):  # interleaved; the first round warms up
            for name, call in timed.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
        rows.append({"N": n, **{f"{name}_ms": value for name, value in ms.items()},
                     "speedup": ms["normal"] / ms["bulk_normal"]})
        print(f"N={n:<6} normal {ms['normal']:9.1f} ms   bulk_normal {ms['bulk_normal']:9.1f} ms"
              f"   ({ms['normal'] / ms['bulk_normal']:.1f}x)   softmax {ms['softmax']:8.1f} ms",
              flush=True)
    write_json(args.out.with_suffix(".json"),
               {**run_metadata(__file__, argv, vars(args)), "rows": rows})
    lines = ["| N | draw by normal, ms | draw by bulk_normal, ms | ratio | exact softmax, ms |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['normal_ms']:.1f} | {r['bulk_normal_ms']:.1f} | "
              f"{r['speedup']:.1f}x | {r['softmax_ms']:.1f} |" for r in rows]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
