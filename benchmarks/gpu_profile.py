"""Where the time of one attention call goes on a GPU: kernels, launches, idle time.

For each method and N, one forward + backward is timed (median wall time, synchronised,
without the profiler) and profiled (``torch.profiler``, after a warm-up) and
summarised: the wall time of the call, the host's time to issue it (host: until the call
returns, the GPU still working), the host's waits for the GPU inside it (syncs), the time
the GPU spent in kernels (busy), their
number (launches), the idle share (1 - busy / wall: the part that launch overhead and
host-side work cost), the kernels that took the most time, and the host's Python
functions with the most own time (``cProfile``).
This is what decides the next optimisation: a launch-bound call needs fewer or
captured launches (CUDA graphs), a busy one faster kernels.

    python benchmarks/gpu_profile.py --out benchmarks/results/gpu/profile

On a machine without CUDA, ``--device cpu`` with ``TRITON_INTERPRET=1`` profiles the
CPU operators instead (the Triton rows run under the interpreter; for a quick check of
the script: the numbers say nothing about a GPU). Writes OUT.json and
OUT.md atomically.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import tuned  # benchmarks/, beside this script
from gpu_device import device_problem
from run_metadata import run_metadata
from torch.profiler import ProfilerActivity, profile

import skyformer
from skyformer.checks import positive_int_argument, shape_dtype_argument
from skyformer.io import atomic_write_text, write_json

METHODS = {
    "sdpa": lambda q, k, v, key, m: F.scaled_dot_product_attention(q, k, v),
    "skyformer": lambda q, k, v, key, m: skyformer.attention(
        q, k, v, "skyformer", num_features=m, generator=key),
    "skyformer/implicit": lambda q, k, v, key, m: skyformer.attention(
        q, k, v, "skyformer", num_features=m, generator=key, pinv_gradient="implicit"),
    "skyformer/torch": lambda q, k, v, key, m: skyformer.attention(
        q, k, v, "skyformer", num_features=m, generator=key, kernel="torch"),
    "kernelized": lambda q, k, v, key, m: skyformer.attention(q, k, v, "kernelized"),
    "kernelized/triton": lambda q, k, v, key, m: skyformer.attention(
        q, k, v, "kernelized", kernel="triton"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_seconds(fn, device: torch.device, iterations: int) -> tuple[float, float]:
    """Median wall time of one call of ``fn``, synchronised, and median host time: from
    the synchronised start until ``fn`` returns, before the GPU has finished (without the
    profiler, whose per-operation overhead would inflate exactly the host-bound time
    measured here). A host time close to the wall time: the host is the bottleneck (or
    waits inside the call, see ``syncs``); far below it: the GPU is."""
    walls, hosts = [], []
    for _ in range(iterations):
        _sync(device)
        start = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - start)
        _sync(device)
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2], sorted(hosts)[len(hosts) // 2]


# CUDA runtime calls by which the host waits for the GPU inside a call (a value read, a
# blocking copy: PyTorch synchronises the stream after it); torch.cuda.synchronize's
# cudaDeviceSynchronize, which closes the profile, is not counted.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D")


def host_functions(fn, device: torch.device, iterations: int, top: int) -> list[dict]:
    """The Python functions that take the host's time in ``iterations`` calls of ``fn``
    (``cProfile``, own time, per call): where a host-bound call spends it."""
    _sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iterations):
        fn()
    profiler.disable()
    _sync(device)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}({name})"[:100],
             "calls": calls / iterations, "own_ms": own / iterations * 1e3,
             "cumulative_ms": cumulative / iterations * 1e3}
            for (file, line, name), (_, calls, own, cumulative, _) in ranked]


def kernel_times(fn, device: torch.device, iterations: int
                 ) -> tuple[dict[str, list[float]], int]:
    """``iterations`` calls of ``fn`` (already warm) under ``torch.profiler``: the
    durations in microseconds of each kernel by name (on the CPU: of each top-level
    operator), and the number of host waits for the GPU (``SYNC_CALLS``)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            fn()
        _sync(device)
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    syncs = 0
    for event in prof.events():
        syncs += event.name in SYNC_CALLS
        on_device = device.type == "cuda" and str(event.device_type).endswith("CUDA")
        on_cpu_op = device.type != "cuda" and event.cpu_parent is None
        if on_device or on_cpu_op:  # kernels on a GPU, top-level operators on the CPU
            kernels[event.name].append(event.time_range.elapsed_us())
    return kernels, syncs


def profile_call(fn, device: torch.device, iterations: int, top: int) -> dict:
    """Profile ``iterations`` calls of ``fn`` (already warm); per-call figures, the wall
    time measured apart from the profile."""
    wall, host = wall_seconds(fn, device, max(3, iterations))
    kernels, syncs = kernel_times(fn, device, iterations)
    busy_us = sum(sum(times) for times in kernels.values()) / iterations
    launches = sum(len(times) for times in kernels.values()) / iterations
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "wall_ms": wall * 1e3,
        "host_ms": host * 1e3,
        "syncs": syncs / iterations,
        "busy_ms": busy_us / 1e3,
        "idle_share": max(0.0, 1.0 - busy_us / 1e3 / (wall * 1e3)),
        "launches": launches,
        "host_top": host_functions(fn, device, iterations, top),
        "top": [{"kernel": name[:120], "calls": len(times) / iterations,
                 "ms": sum(times) / iterations / 1e3,
                 "share": sum(times) / iterations / max(busy_us, 1e-9)}
                for name, times in ranked],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default=None,
                        type=shape_dtype_argument("B,H,D"),
                        help="B,H,D,dtype (default 4,16,64,bfloat16; CPU: 1,1,16,float32)")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument, default=None,
                        help="default 4096 16384 (CPU: 64)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--features", type=positive_int_argument,
                        default=None, help="default 128 (CPU: 16)")
    parser.add_argument("--iterations", type=positive_int_argument, default=3)
    parser.add_argument("--top", type=positive_int_argument, default=12)
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="JSON of lemma3_tiles.py / product_tiles.py: launch the kernels "
                        "with the fastest options they recorded")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tuned.applied(args.tiles):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    device = torch.device(args.device)
    problem = device_problem("gpu_profile.py", args.device)
    if problem is not None:  # the Triton rows need the interpreter on the CPU
        print(f"gpu_profile.py: {problem}", file=sys.stderr)
        return 2
    on_gpu = device.type == "cuda"  # the CPU checks the script at tiny sizes
    args.shape = args.shape or ("4,16,64,bfloat16" if on_gpu else "1,1,16,float32")
    args.seq_lens = args.seq_lens or ([4096, 16384] if on_gpu else [64])
    args.features = args.features or (128 if on_gpu else 16)
    b, h, d, dtype_name = args.shape.split(",")
    dtype = getattr(torch, dtype_name)
    key = skyformer.random_key(0, device=device)
    rows = []
    for n in args.seq_lens:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v, grad = (torch.randn(int(b), int(h), n, int(d), device=device, generator=g)
                         .to(dtype) for _ in range(4))
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        for method in args.methods:
            def step(method=method, leaves=leaves, grad=grad):
                for t in leaves:
                    t.grad = None
                METHODS[method](*leaves, key, args.features).backward(grad)
            for _ in range(2):  # warm-up: compilation, autotuning, allocator
                step()
            summary = profile_call(step, device, args.iterations, args.top)
            rows.append({"n": n, "method": method} | summary)
            print(f"N={n:6d} {method:16s} wall {summary['wall_ms']:9.3f} ms  host "
                  f"{summary['host_ms']:9.3f} ms  syncs {summary['syncs']:4.1f}  busy "
                  f"{summary['busy_ms']:9.3f} ms  idle {100 * summary['idle_share']:5.1f} %  "
                  f"{summary['launches']:6.0f} launches", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{name}, torch {torch.__version__}, B,H,D,dtype = {args.shape}, m = "
             f"{args.features}, forward + backward, per call", "",
             "| N | method | wall ms | host ms | syncs | busy ms | idle | launches |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['method']} | {r['wall_ms']:.3f} | {r['host_ms']:.3f} | "
              f"{r['syncs']:.0f} | {r['busy_ms']:.3f} | {100 * r['idle_share']:.0f} % | "
              f"{r['launches']:.0f} |" for r in rows]
    for r in rows:
        lines += ["", f"N = {r['n']}, {r['method']}: the host's Python functions with the "
                  "most own time (cProfile, which slows them; per call)", "",
                  "| function | calls | own ms | cumulative ms |", "|---|---|---|---|"]
        lines += [f"| `{t['function']}` | {t['calls']:.0f} | {t['own_ms']:.3f} | "
                  f"{t['cumulative_ms']:.3f} |" for t in r["host_top"]]
        lines += ["", f"N = {r['n']}, {r['method']}: the kernels that took the most time", "",
                  "| kernel | calls | ms | share |", "|---|---|---|---|"]
        lines += [f"| `{t['kernel']}` | {t['calls']:.0f} | {t['ms']:.3f} | "
                  f"{100 * t['share']:.0f} % |" for t in r["top"]]
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out.with_suffix(".json"),
                   {"device": name, **run_metadata(__file__, argv, vars(args), device),
                    "torch": torch.__version__, "shape": args.shape,
                    "features": args.features, "rows": rows}, indent=1)
        atomic_write_text(args.out.with_suffix(".md"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
