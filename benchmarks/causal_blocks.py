"""Causal inference by blocks of rows against all rows at once (Skyformer,
nystrom_softmax, Performer, linear attention):
time and peak memory of one call that records no gradient (a prompt's prefill).

    python benchmarks/causal_blocks.py [--methods skyformer nystrom_softmax performer linear]
        [--seq-lens 16384 65536 262144] [--threads 2]

For each method and N, each form runs in a fresh process (B=1, H=2, D=32, m=128,
float32, ``causal=True``): "blocks" is the library's path (``ops/shared/causal_prefix.py``,
``STREAM_ROWS`` rows a block), "whole" the same call with one block of every row (the
path a call recording gradients takes). Per form: the median wall time of
``--repeats`` calls after one warm-up, and the peak resident memory above the inputs
(``getrusage`` max RSS of the fresh process). Writes
``benchmarks/results/causal_blocks.{json,md}``; the table's last column is the time
ratio whole / blocks, the two measured one after the other on the same machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from run_metadata import RESULTS, run_metadata, write_report  # benchmarks/, beside this script

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.ops.shared import causal_prefix

FORMS = {"blocks": None, "whole": 1 << 62}  # STREAM_ROWS: the library's, or no blocks
METHODS = ("skyformer", "nystrom_softmax", "performer", "linear")


def measure_here(method: str, form: str, n: int, repeats: int, threads: int) -> dict:
    """One method's form at one N in this process: ``{"seconds", "peak_mib"}``."""
    torch.set_num_threads(threads)
    if FORMS[form] is not None:
        causal_prefix.STREAM_ROWS = FORMS[form]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g) for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def call() -> torch.Tensor:
        return skyformer.attention(q, k, v, method, causal=True, num_features=128,
                                   generator=torch.Generator().manual_seed(1))  # linear:
        # num_features has no effect

    times = []
    with torch.no_grad():
        call()
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"seconds": statistics.median(times), "peak_mib": (peak - before) / 1024}


def measure(method: str, n: int, repeats: int, threads: int) -> dict:
    """Both forms of one method at one N, each in a fresh process."""
    row: dict = {"method": method, "n": n}
    for form in FORMS:
        done = subprocess.run(
            [sys.executable, __file__, "--child", method, form, str(n), str(repeats),
             str(threads)], capture_output=True, text=True, check=True)
        row[form] = json.loads(done.stdout.strip().splitlines()[-1])
    row["whole_over_blocks"] = row["whole"]["seconds"] / row["blocks"]["seconds"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| method | N | blocks ms | blocks peak MiB | whole ms | whole peak MiB | "
             "whole / blocks |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, w = r["blocks"], r["whole"]
        lines.append(f"| {r['method']} | {r['n']} | {1000 * b['seconds']:.0f} | "
                     f"{b['peak_mib']:.0f} | "
                     f"{1000 * w['seconds']:.0f} | {w['peak_mib']:.0f} | "
                     f"{r['whole_over_blocks']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seq-lens", type=positive_int_argument, nargs="+",
                        default=[16384, 65536, 262144])
    parser.add_argument("--repeats", type=positive_int_argument, default=3)
    parser.add_argument("--threads", type=positive_int_argument, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "causal_blocks")
    args = parser.parse_args(argv)
    rows = []
    for method in args.methods:
        for n in args.seq_lens:
            rows.append(measure(method, n, args.repeats, args.threads))
            print(rows[-1], flush=True)
    config = {**vars(args), "out": str(args.out), "batch": 1, "heads": 2, "head_dim": 32,
              "num_features": 128, "dtype": "float32", "stream_rows": causal_prefix.STREAM_ROWS}
    text = table(rows)
    write_report(args.out, text, run_metadata(__file__, argv, config, "cpu"), rows=rows)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        method, form = sys.argv[2:4]
        n, repeats, threads = map(int, sys.argv[4:7])
        print(json.dumps(measure_here(method, form, n, repeats, threads)))
    else:
        main()
