"""Host time of an eager forward + backward with every Triton launch stubbed, on the CPU.

On a GPU an eager call is host-bound while its kernels take less time to run than to
issue: Skyformer below N = 8192 on the H200 spent 5-7 ms of wall time on 3.0 ms of GPU
work (docs/gpu-record.md). This measures what the host does besides Triton's own launcher:
the library's Python, autograd, the custom operators and the PyTorch operations (on
the CPU at these sizes they cost about what issuing them costs on a GPU). Every
``triton.jit`` kernel of the library is replaced by a launch that does nothing (the
outputs are allocated and left unwritten: the values are garbage), and the
non-finite check runs as on CUDA (``launch_counts.py``). The methods' calls are
interleaved, so their ratios hold on a loaded machine. ``--profile N`` lists the N
functions with the most cumulative time (cProfile, which slows Python-heavy paths).
``--through-pytorch`` adds each method with its autograd Functions and custom
operators called through PyTorch's Python layers (``linalg.eager_calls``), in the same
interleaved run; ``--guard-passes`` adds Skyformer with the non-finite marks made by
the guard's own passes instead of in its product kernels (``launch_counts.guard_passes``);
``--composable`` adds Skyformer composed of its Functions instead of run as two
hand-chained nodes (``ops/skyformer/two_nodes.py``).

    python benchmarks/host_time.py [--methods skyformer kernelized] [--calls 300]
                                   [--profile 30] [--through-pytorch] [--guard-passes]
                                   [--composable] [--out FILE.md]

``--out FILE.md`` writes the table there and FILE.json beside (the numbers, every
setting, the environment and the command).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a script, before Triton is imported; an import
    # (gpu_kernels.py on a GPU) must not turn the interpreter on for its importer
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path

import argparse
import contextlib
import cProfile
import importlib
import io
import pstats
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from kernel_flags import composed  # benchmarks/, beside this script
from launch_counts import as_on_cuda, guard_passes
from run_metadata import run_metadata, write_report

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.eval.measure.timing import interleaved_seconds
from skyformer.linalg.eager_calls import through_pytorch

TRITON_MODULES = ("skyformer.linalg.triton_kernels", "skyformer.linalg.triton_lemma3",
                  "skyformer.linalg.triton_lemma3_backward", "skyformer.sketch.triton_draws",
                  "skyformer.linalg.triton_landmark_rows",
                  "skyformer.ops.kernelized.triton_flash")
METHODS = ("skyformer", "nystrom_softmax", "kernelized")


class _NoLaunch:
    """Stands for a ``triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches(stub: Callable[[Any], Any] = lambda kernel: _NoLaunch()
                     ) -> Iterator[int]:
    """Every kernel of ``TRITON_MODULES`` (the ``*_kernel`` names; the other jit
    functions are called from inside kernels) replaced by ``stub(kernel)`` (default: a
    ``_NoLaunch``); yields how many."""
    with contextlib.ExitStack() as stack:
        count = 0
        for name in TRITON_MODULES:
            module = importlib.import_module(name)
            for attr in list(vars(module)):
                kernel = getattr(module, attr)
                if attr.endswith("_kernel") and hasattr(kernel, "__getitem__"):
                    stack.enter_context(mock.patch.object(module, attr, stub(kernel)))
                    count += 1
        yield count


def call_of(method: str, b: int, h: int, n: int, d: int, m: int, through: bool = False, *,
            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            guard: bool = False, composable: bool = False) -> Callable[[], None]:
    """One eager forward + backward of ``method`` on the Triton path (``through``:
    ``eager_calls.through_pytorch``; ``guard``: ``guard_passes``; ``composable``:
    Skyformer not as its two nodes), on inputs of ``device`` and ``dtype``."""
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    key = skyformer.random_key(0)  # made once by the caller, as a training loop would
    options = {} if method == "kernelized" else {"num_features": m, "generator": key}

    def call() -> None:
        with through_pytorch() if through else contextlib.nullcontext(), guard_passes(guard), \
                composed(composable):
            out = skyformer.attention(q, k, v, method, kernel="triton", **options)
            out.sum().backward()
        for t in (q, k, v):  # each call makes its own gradients, not adds to the last
            t.grad = None

    return call


def profile(call: Callable[[], None], top: int, calls: int = 50) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--shape", type=shape_argument("B,H,N,D"), default="1,1,256,64")
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--calls", type=positive_int_argument, default=300)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--through-pytorch", action="store_true")
    parser.add_argument("--guard-passes", action="store_true")
    parser.add_argument("--composable", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    b, h, n, d = args.shape
    torch.set_num_threads(1)  # the host issues from one thread
    # the stubbed kernels leave their outputs unwritten: subnormal garbage would slow
    # the CPU's arithmetic on them (the m x m products), by up to 30x in one run
    torch.set_flush_denormal(True)
    with as_on_cuda(), stubbed_launches() as stubbed:
        calls = {method: call_of(method, b, h, n, d, args.features)
                 for method in args.methods}
        if args.through_pytorch:
            calls.update({f"{method}, through PyTorch": call_of(method, b, h, n, d,
                                                                args.features, through=True)
                          for method in args.methods})
        if args.guard_passes and "skyformer" in args.methods:
            calls["skyformer, guard's passes"] = call_of("skyformer", b, h, n, d,
                                                         args.features, guard=True)
        if args.composable and "skyformer" in args.methods:
            calls["skyformer, composable"] = call_of("skyformer", b, h, n, d, args.features,
                                                     composable=True)
        times = interleaved_seconds(calls, warmup=10, repeats=args.calls)
        profiles = {method: profile(call, args.profile)
                     for method, call in calls.items()} if args.profile else {}
    lines = [f"B={b}, H={h}, N={n}, D={d}, m={args.features}: eager forward + backward, "
             f"{stubbed} Triton kernels stubbed, {args.calls} interleaved calls, "
             f"torch {torch.__version__}", "",
             "| method | median ms | min ms |", "|---|---|---|"]
    lines += [f"| `{method}` | {statistics.median(ts) * 1e3:.3f} | {min(ts) * 1e3:.3f} |"
              for method, ts in times.items()]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    for method, report in profiles.items():
        print(f"\n{method}:\n{report}")
    if args.out:
        rows = [{"method": method, "median_ms": statistics.median(ts) * 1e3,
                 "min_ms": min(ts) * 1e3} for method, ts in times.items()]
        write_report(args.out, text, run_metadata(__file__, argv, vars(args)),
                     stubbed_kernels=stubbed, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
