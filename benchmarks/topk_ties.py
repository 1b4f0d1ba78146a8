"""The cost of ``linalg.top_k`` (ties by position) beside ``torch.topk`` and a full
stable sort, on the multipole methods' near-key logits ``[B, H, c, N]``.

The three calls are interleaved, so their ratios hold on a loaded machine; the median
of ``--repeats`` runs each, one thread unless ``--threads`` says otherwise.

    python benchmarks/topk_ties.py [--seq-lens 4096 16384] [--clusters 64] [--k 65]
                               [--threads 1] [--repeats 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys

import torch
from run_metadata import run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.io import check_output_path, write_json
from skyformer.linalg.top_k import top_k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=positive_int_argument, nargs="+", default=[4096, 16384])
    parser.add_argument("--clusters", type=positive_int_argument,
                        default=64, help="c, rows per head")
    parser.add_argument("--k", type=positive_int_argument, default=65, help="entries kept per row")
    parser.add_argument("--threads", type=positive_int_argument, default=1)
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    parser.add_argument("--out", default=None, help="writes the rows as JSON")
    args = parser.parse_args(argv)
    try:
        check_output_path(args.out)  # a folder or an unwritable place: now, not after timing
    except (OSError, ValueError) as err:
        parser.error(f"argument --out: {err}")
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.seq_lens:
        x = torch.randn(1, 2, args.clusters, n, generator=torch.Generator().manual_seed(n))
        k = min(args.k, n)
        times = interleaved_median_seconds({
            "torch.topk": lambda x=x, k=k: x.topk(k, dim=-1),
            "linalg.top_k": lambda x=x, k=k: top_k(x, k),
            "stable sort": lambda x=x: torch.sort(x, dim=-1, descending=True, stable=True),
        }, repeats=args.repeats)
        for name, seconds in times.items():
            rows.append({"n": n, "call": name, "ms": seconds * 1e3,
                         "vs_topk": seconds / times["torch.topk"]})
            print(f"N={n:6d} {name:13s} {seconds * 1e3:8.2f} ms "
                  f"{seconds / times['torch.topk']:6.1f}x torch.topk", flush=True)
    if args.out:
        write_json(args.out, {**run_metadata(__file__, argv, vars(args)), "rows": rows},
                   indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
