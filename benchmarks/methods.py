"""Forward+backward time and peak memory of every approximate method against exact SDPA.

    python benchmarks/methods.py [--out benchmarks/results/methods] [--max-n 16384]
                                 [--methods nystromformer bigbird ...]

Every registered approximate method (``list_methods()`` minus the exact ones, so
methods registered later appear by themselves) at its default options, plus exact
softmax attention through PyTorch's scaled_dot_product_attention, at N = 1024 ... 16384,
B=1, H=2, D=32 (the Long Range Arena setting of the Skyformer paper), float32.

Methods are called as inside ``MultiHeadAttention`` (``eval.layer_call``): Linformer
with its learned projections (max_seq_len = N), not the Gaussian ones a bare call draws.
Times: for each N every method is warmed up once, then the methods are timed in
interleaved rounds (so that a change of machine load hits all of them alike) and the
median per method is kept. ``--clock wall`` (default) measures elapsed time;
``--clock cpu`` measures the CPU time of this process (``time.process_time``), which
does not count time spent waiting for a core: on a machine shared with other jobs it
is the stable measure (use it with ``--threads 1``, where CPU time is compute time).
Peak memory: a fresh process per (method, N) (``eval.memory``). The machine's load
average is recorded with every N: read the ratios to SDPA, not absolute times.
Writes JSON and CSV (with the environment), a PNG plot, and prints markdown tables.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from skyformer.eval.layer_call import call_as_layer
from skyformer.eval.memory import MemoryJob, peak_memory_bytes
from skyformer.io import atomic_write_text, environment, write_json
from skyformer.registry import get_method, list_methods

EXACT = "softmax"
LAYER_CALL = "skyformer.eval.layer_call:call_as_layer"
B, H, D = 1, 2, 32


def default_methods() -> list[str]:
    return [EXACT] + [m for m in list_methods() if not get_method(m).capabilities.exact]


def method_options(method: str, n: int) -> dict:
    options: dict = {"method": method}
    if get_method(method).capabilities.fixed_length:
        options["max_seq_len"] = n
    return options


def make_step(method: str, n: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, requires_grad=True) for _ in range(3))
    options = method_options(method, n)

    def step() -> None:
        out = call_as_layer(q, k, v, generator=torch.Generator().manual_seed(0), **options)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None

    return step


def interleaved_medians(steps: dict[str, callable], repeats: int, clock=time.perf_counter
                        ) -> dict[str, float]:
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(repeats):
        for method, step in steps.items():
            start = clock()
            step()
            times[method].append(clock() - start)
    return {m: statistics.median(t) for m, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/methods")
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods to compare with SDPA (default: every approximate method)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="elapsed time, or this process's CPU time (robust to other jobs)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    methods = [EXACT] + [m for m in (args.methods or default_methods()) if m != EXACT]
    for m in methods:
        get_method(m)
    rows = []
    n = args.min_n
    while n <= args.max_n:
        load_before = os.getloadavg()[0]
        seconds = interleaved_medians({m: make_step(m, n) for m in methods}, args.repeats, clock)
        load_after = os.getloadavg()[0]
        for m in methods:
            peak = None
            if not args.no_memory:
                job = MemoryJob(LAYER_CALL, (B, H, n, D), options=method_options(m, n), backward=True)
                peak = peak_memory_bytes(job) / 2**20
            rows.append({"method": m, "n": n, "fwd_bwd_ms": seconds[m] * 1e3,
                         "x_sdpa_time": seconds[m] / seconds[EXACT], "peak_mib": peak,
                         "load_avg_1min": round((load_before + load_after) / 2, 2),
                         "clock": args.clock})
            print(f"N={n:>6} {m:<16} {seconds[m] * 1e3:>10.1f} ms ({seconds[EXACT] / seconds[m]:5.1f}x "
                  f"faster than SDPA) {'-' if peak is None else f'{peak:.1f}':>9} MiB "
                  f"load {load_before:.1f}-{load_after:.1f}", flush=True)
        n *= 2
    out = Path(args.out)
    config = {"B": B, "H": H, "D": D, "dtype": "float32", "repeats": args.repeats,
              "clock": args.clock, "threads": torch.get_num_threads(),
              "methods": {m: {k: v for k, v in get_method(m).defaults().items()} for m in methods},
              "call": "eval.layer_call.call_as_layer (max_seq_len = N for fixed-length methods)",
              "command": "python benchmarks/methods.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_json(out.with_suffix(".json"), {"config": config, "environment": environment("cpu"), "rows": rows})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out.with_suffix(".csv"), buf.getvalue())
    plot(rows, out.with_suffix(".png"), f"{args.clock} clock, {torch.get_num_threads()} thread(s)")
    print()
    print(summary(rows))
    return 0


def summary(rows: list[dict]) -> str:
    """Two markdown tables: time (ms and speed-up over SDPA) and peak memory (MiB)."""
    by = {(r["method"], r["n"]): r for r in rows}
    ns = sorted({r["n"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = "| method | " + " | ".join(f"N={n}" for n in ns) + " |"
    rule = "|---" * (len(ns) + 1) + "|"
    time_lines = ["Forward+backward ms (SDPA time / method time):", "", head, rule]
    if "clock" in rows[0]:
        time_lines[0] = f"Forward+backward ms, {rows[0]['clock']} clock (SDPA time / method time):"
    mem_lines = ["Peak memory MiB (fresh process; x SDPA's):", "", head, rule]
    for m in methods:
        cells, mems = [], []
        for n in ns:
            r, sdpa = by[(m, n)], by[(EXACT, n)]
            cells.append(f"{r['fwd_bwd_ms']:.1f}" + ("" if m == EXACT else
                                                     f" ({sdpa['fwd_bwd_ms'] / r['fwd_bwd_ms']:.1f}x)"))
            if r["peak_mib"] is None:
                mems.append("-")
            else:
                mems.append(f"{r['peak_mib']:.1f}" + ("" if m == EXACT or not sdpa["peak_mib"] else
                                                      f" ({r['peak_mib'] / sdpa['peak_mib']:.2f}x)"))
        time_lines.append(f"| {m} | " + " | ".join(cells) + " |")
        mem_lines.append(f"| {m} | " + " | ".join(mems) + " |")
    loads = ", ".join(f"N={n}: {by[(EXACT, n)]['load_avg_1min']}" for n in ns)
    return "\n".join(time_lines + ["", f"1-minute load average during timing: {loads}", ""] + mem_lines)


def plot(rows: list[dict], path: Path, timing: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install skyformer[plot])")
        return
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        style = {"color": "black", "linewidth": 2.5} if m == EXACT else {}
        label = "softmax (SDPA, exact)" if m == EXACT else m
        axes[0].plot([r["n"] for r in mine], [r["fwd_bwd_ms"] for r in mine], "o-", label=label, **style)
        if mine[0]["peak_mib"] is not None:
            axes[1].plot([r["n"] for r in mine], [r["peak_mib"] for r in mine], "o-", label=label, **style)
    for ax, ylabel in zip(axes, ("forward+backward ms", "peak memory MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"B={B}, H={H}, D={D}, float32, CPU; time: {timing}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
