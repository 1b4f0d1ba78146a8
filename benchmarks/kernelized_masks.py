"""Exact kernelized attention on the CPU with an ``attn_mask``: at head dim D or augmented.

``kernelized`` on the CPU runs SDPA at head dim D with the key norms as a bias of the
scores (``ops/kernelized/sdpa_fold.py``) and adds a padding-like ``attn_mask`` (one row
over the keys, expanded over the queries, as ``skyformer.hf`` builds it) to that bias;
a mask with a row per query stays with the augmentation at D + 8
(``kernelized._one_row_per_key``), whose bias the heads share. This times forward +
backward of both forms (``fold_key_norms=True`` / ``False``) for no mask, a padding mask
and a mask with a row per query (random, 90 % of the pairs open), interleaved, at each N.

    python benchmarks/kernelized_masks.py [--shape 2,2,64] [--seq-lens 4096]
                                          [--threads 2] [--out FILE.md]

``--out FILE.md`` writes the table there and FILE.json beside.
"""

from __future__ import annotations

import argparse
import sys

import torch
from run_metadata import run_metadata, write_report  # benchmarks/, beside this script

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.eval.measure.timing import interleaved_median_seconds

MASKS = ("none", "padding", "per query")
FORMS = {"head dim D": True, "augmented": False}


def masks(b: int, n: int) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(attn_mask, query_padding_mask) of each kind of ``MASKS``."""
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[-1, -n // 8:] = False  # the last element's last eighth padded
    pairs = torch.rand(n, n, generator=torch.Generator().manual_seed(0)) > 0.1
    return {"none": (None, None), "padding": (valid[:, None, None, :].expand(b, 1, n, n),
                                              valid),
            "per query": (pairs, None)}


def measure(b: int, h: int, n: int, d: int, repeats: int) -> list[dict]:
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))

    def call(mask, rows, fold):
        def run():
            skyformer.kernelized_attention(q, k, v, attn_mask=mask, query_padding_mask=rows,
                                           fold_key_norms=fold).sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    calls = {(kind, form): call(*masks(b, n)[kind], fold)
             for kind in MASKS for form, fold in FORMS.items()}
    times = interleaved_median_seconds(calls, warmup=1, repeats=repeats)
    return [{"n": n, "mask": kind, "form": form, "ms": times[kind, form] * 1e3}
            for kind, form in calls]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=shape_argument("B,H,D"), default="2,2,64")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument, default=[4096])
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    parser.add_argument("--threads", type=positive_int_argument, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    b, h, d = args.shape
    rows = [row for n in args.seq_lens for row in measure(b, h, n, d, args.repeats)]
    lines = [f"Exact kernelized attention, B,H,D = {b},{h},{d}, float32, forward + "
             f"backward on the CPU ({torch.get_num_threads()} threads), medians of "
             f"{args.repeats} interleaved calls, torch {torch.__version__}", "",
             "| N | attn_mask | head dim D ms | augmented ms | augmented / head dim D |",
             "|---|---|---|---|---|"]
    for n in args.seq_lens:
        for kind in MASKS:
            ms = {row["form"]: row["ms"] for row in rows if row["n"] == n
                  and row["mask"] == kind}
            lines.append(f"| {n} | {kind} | {ms['head dim D']:.1f} | {ms['augmented']:.1f} "
                         f"| {ms['augmented'] / ms['head dim D']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        write_report(args.out, text, run_metadata(__file__, argv, vars(args)), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
