"""Forward+backward time and peak memory of the foundation methods against exact SDPA.

    python benchmarks/foundation.py [--out benchmarks/results/foundation] [--max-n 16384]

Compares, in one run on one machine: exact softmax attention through PyTorch's
scaled_dot_product_attention, exact kernelized attention (SDPA augmentation), the
same kernelized attention through the materialised n x n matrix, and Skyformer
(m = 128). B=1, H=2, D=32 as in the Long Range Arena experiments. Times are
medians after warm-up; peak memory is measured in a fresh process per configuration.
Writes JSON and CSV (with the environment) and prints a table with ratios.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

import torch

from skyformer.eval.memory import MemoryJob, peak_memory_bytes
from skyformer.eval.timing import median_seconds
from skyformer.io import atomic_write_text, environment, write_json
from skyformer.registry import attention

NAIVE_KERNELIZED = "skyformer.ops.kernelized:reference_materialised_kernelized_attention"
METHODS = ["softmax", "kernelized", "skyformer", NAIVE_KERNELIZED]
LABEL = {NAIVE_KERNELIZED: "kernelized (materialised)"}


def fwd_bwd_seconds(method: str, n: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g, requires_grad=True) for _ in range(3))
    if ":" in method:
        module, name = method.split(":")
        fn = getattr(__import__(module, fromlist=[name]), name)
        call = lambda: fn(q, k, v)  # noqa: E731
    else:
        call = lambda: attention(q, k, v, method, generator=torch.Generator().manual_seed(0))  # noqa: E731

    def step() -> None:
        out = call()
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    return median_seconds(step, warmup=1, repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/foundation")
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    n = args.min_n
    while n <= args.max_n:
        for method in METHODS:
            seconds = fwd_bwd_seconds(method, n, args.repeats)
            peak = peak_memory_bytes(MemoryJob(method, (1, 2, n, 32), backward=True))
            rows.append({"method": LABEL.get(method, method), "n": n, "fwd_bwd_ms": seconds * 1e3,
                         "peak_mib": peak / 2**20})
            print(f"N={n:>6} {LABEL.get(method, method):<26} {seconds * 1e3:>10.1f} ms "
                  f"{peak / 2**20:>9.1f} MiB", flush=True)
        n *= 2
    out = Path(args.out)
    env = environment("cpu")
    config = {"B": 1, "H": 2, "D": 32, "num_features": 128, "repeats": args.repeats,
              "command": "python benchmarks/foundation.py " + " ".join(argv or sys.argv[1:])}
    write_json(out.with_suffix(".json"), {"config": config, "environment": env, "rows": rows})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out.with_suffix(".csv"), buf.getvalue())
    print()
    print(summary(rows))
    return 0


def summary(rows: list[dict]) -> str:
    by = {(r["method"], r["n"]): r for r in rows}
    ns = sorted({r["n"] for r in rows})
    lines = ["| N | SDPA softmax ms | kernelized ms (x SDPA) | Skyformer ms (SDPA / Skyformer) | Skyformer N->2N | kernelized MiB | materialised MiB |",
             "|---|---|---|---|---|---|---|"]
    for i, n in enumerate(ns):
        sdpa = by[("softmax", n)]["fwd_bwd_ms"]
        ker = by[("kernelized", n)]
        sky = by[("skyformer", n)]["fwd_bwd_ms"]
        mat = by[("kernelized (materialised)", n)]
        growth = "" if i == 0 else f"{sky / by[('skyformer', ns[i - 1])]['fwd_bwd_ms']:.2f}"
        lines.append(
            f"| {n} | {sdpa:.1f} | {ker['fwd_bwd_ms']:.1f} ({ker['fwd_bwd_ms'] / sdpa:.2f}x) | "
            f"{sky:.1f} ({sdpa / sky:.1f}x faster) | {growth} | {ker['peak_mib']:.1f} | {mat['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
