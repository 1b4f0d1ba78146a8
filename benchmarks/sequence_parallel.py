"""Sequence-parallel Skyformer on CPU processes: bytes sent, time and peak memory per rank.

    python benchmarks/sequence_parallel.py                       # P = 1, 2, 4; N = 2^16 ... 2^20
    python benchmarks/sequence_parallel.py --procs 4 --seq-lens 4194304 --repeats 1 \\
        --out benchmarks/results/sequence_parallel_4m            # one 2^22-token sequence
    python benchmarks/sequence_parallel.py --causal \\
        --out benchmarks/results/sequence_parallel_causal        # a decoder's layer
    python benchmarks/sequence_parallel.py --causal --inference --procs 2 \\
        --seq-lens 262144 --out benchmarks/results/sequence_parallel_causal_inference
                                                                 # its prefill, no gradient

For each (P, N) a fresh group of P processes (gloo, started here with
torch.multiprocessing) runs one ``MultiHeadAttention`` layer (Skyformer or ``--method``,
B=1, H=2, D=32, m=128, float32; ``--causal``: causal=True) forward and backward on its
contiguous shard of one N-token sequence (gradients flow to the input too, as inside a
stack of layers; ``--inference``: the forward pass alone, recording no gradient).
P = 1 is one process without a group: the single-process run. Per configuration it
records

- bytes: the payload of every collective of the layer's forward and backward passes,
  counted as it is sent (``skyformer.distributed.count_communication``: per rank, the
  tensor each all-reduce reduces and each all-gather contributes);
- ring bytes: what ring attention (exact attention with K, V blocks passed around the
  P ranks) would send per rank for the same layer, computed: forward (P-1)/P N B H (D+Dv)
  elements, forward+backward three times that (the backward pass circulates K, V and their
  gradients dK, dV);
- time: wall clock of forward+backward, median of ``--repeats`` after one warm-up, between
  barriers (the slowest rank's); meaningful only with at least P free cores;
- peak memory: each rank's peak resident set (``getrusage`` max RSS of its fresh process),
  above its resident set before the inputs and the layer were made (torch's own footprint).

Writes results.json (rows, config, environment, command), results.csv (the same
metadata in ``# key: <json>`` lines first) and sequence_parallel.png under ``--out`` and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script

from skyformer import MultiHeadAttention
from skyformer.checks import positive_int_argument
from skyformer.distributed import count_communication, destroy_process_group, shard_bounds
from skyformer.io import save_figure, write_csv, write_json

BATCH, HEADS, HEAD_DIM, FEATURES = 1, 2, 32, 128


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _worker(rank: int, world: int, store: str, n: int, args: argparse.Namespace,
            out: str) -> None:
    torch.set_num_threads(args.threads)
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    barrier = dist.barrier if group is not None else (lambda: None)
    before = _rss_mib()
    torch.manual_seed(0)
    layer = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, args.method, num_features=FEATURES,
                               causal=args.causal, process_group=group)
    start, stop = shard_bounds(n, world, rank)
    x = torch.randn(BATCH, stop - start, HEADS * HEAD_DIM,
                    generator=torch.Generator().manual_seed(rank),
                    requires_grad=not args.inference)

    def step() -> None:
        if args.inference:
            with torch.no_grad():
                layer(x, generator=torch.Generator().manual_seed(0))
            return
        out = layer(x, generator=torch.Generator().manual_seed(0))
        out.sum().backward()
        x.grad = None  # each step makes its own gradients, not adds to the last
        layer.zero_grad(set_to_none=True)

    with count_communication() as traffic, torch.no_grad():
        layer(x, generator=torch.Generator().manual_seed(0))
    forward_bytes = traffic.bytes
    with count_communication() as traffic:
        step()  # the warm-up
    times = []
    for _ in range(args.repeats):
        barrier()
        t0 = time.perf_counter()
        step()
        barrier()
        times.append(time.perf_counter() - t0)
    row = {"procs": world, "rank": rank, "n": n, "shard": stop - start,
           "forward_bytes": forward_bytes, "bytes": traffic.bytes,
           "collectives": len(traffic.calls), "seconds": statistics.median(times),
           "rss_before_mib": before, "peak_rss_mib": _rss_mib(),
           "peak_above_start_mib": _rss_mib() - before}
    Path(out, f"{rank}.json").write_text(json.dumps(row))
    if group is not None:
        dist.barrier()  # gloo: no rank closes its connections while another still reads
        destroy_process_group()


def ring_bytes(n: int, procs: int, element: int = 4) -> tuple[int, int]:
    """Ring attention's bytes per rank per layer, (forward, forward+backward)."""
    forward = (procs - 1) * (n // procs) * BATCH * HEADS * (2 * HEAD_DIM) * element
    return forward, 3 * forward


def measure(procs: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(procs, os.path.join(tmp, "store"), n, args, tmp), nprocs=procs,
                 join=True)
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(procs)]
    ring_fwd, ring_all = ring_bytes(n, procs)
    if args.inference:  # the forward pass alone
        ring_all = ring_fwd
    return {"procs": procs, "n": n, "bytes": max(r["bytes"] for r in ranks),
            "forward_bytes": max(r["forward_bytes"] for r in ranks),
            "collectives": ranks[0]["collectives"], "ring_forward_bytes": ring_fwd,
            "ring_bytes": ring_all, "ring_over_ours": ring_all / max(1, ranks[0]["bytes"]),
            "seconds": max(r["seconds"] for r in ranks),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "peak_above_start_mib": max(r["peak_above_start_mib"] for r in ranks),
            "ranks": ranks}


def plot(rows: list[dict[str, Any]], path: Path, method: str = "skyformer",
         passes: str = "fwd+bwd") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for p in sorted({r["procs"] for r in rows}):
        mine = sorted((r for r in rows if r["procs"] == p), key=lambda r: r["n"])
        ns = [r["n"] for r in mine]
        if p > 1:
            axes[0].plot(ns, [r["bytes"] for r in mine], "o-", label=f"{method} P={p}")
            axes[0].plot(ns, [r["ring_bytes"] for r in mine], "x--", label=f"ring P={p}")
        axes[1].plot(ns, [r["seconds"] for r in mine], "o-", label=f"P={p}")
        axes[2].plot(ns, [r["peak_above_start_mib"] for r in mine], "o-", label=f"P={p}")
    for ax, title in zip(axes, (f"bytes sent per rank per layer ({passes})",
                                f"{passes} seconds", "peak RSS per rank above start, MiB"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=positive_int_argument, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-lens", type=positive_int_argument, nargs="+",
                        default=[2**e for e in range(16, 21)])
    parser.add_argument("--repeats", type=positive_int_argument, default=3)
    parser.add_argument("--threads", type=positive_int_argument, default=1,
                        help="torch threads per process")
    parser.add_argument("--causal", action="store_true",
                        help="a causal layer (a decoder's self-attention)")
    parser.add_argument("--method", default="skyformer",
                        choices=["skyformer", "nystrom_softmax", "linear", "performer"])
    parser.add_argument("--inference", action="store_true",
                        help="the forward pass alone, recording no gradient (a prefill)")
    parser.add_argument("--out", default=str(RESULTS / "sequence_parallel"))
    args = parser.parse_args(argv)
    rows = []
    print(f"{'P':>2} {'N':>8} {'bytes':>10} {'ring bytes':>12} {'ring/ours':>10} "
          f"{'seconds':>8} {'peak MiB':>9}")
    for n in args.seq_lens:
        for p in args.procs:
            row = measure(p, n, args)
            rows.append(row)
            print(f"{p:>2} {n:>8} {row['bytes']:>10} {row['ring_bytes']:>12} "
                  f"{row['ring_over_ours']:>10.0f} {row['seconds']:>8.3f} "
                  f"{row['peak_above_start_mib']:>9.1f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM,
              "num_features": FEATURES, "dtype": "float32"}
    metadata = run_metadata(__file__, argv, config, "cpu")
    write_json(out / "results.json", {**metadata, "rows": rows})
    write_csv(out / "results.csv", [{k: v for k, v in r.items() if k != "ranks"} for r in rows],
              metadata=metadata)
    plot(rows, out / "sequence_parallel.png", args.method, "fwd" if args.inference else "fwd+bwd")
    print(f"wrote {out}/results.json, results.csv, sequence_parallel.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
