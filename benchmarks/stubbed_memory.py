"""Peak memory of an eager forward + backward on the Triton path, counted on the CPU.

Every Triton launch is stubbed (``host_time.stubbed_launches``: the outputs are
allocated and left unwritten), so a CPU call allocates the tensors a CUDA call
allocates, in the same order, at any shape; PyTorch's profiler records each allocation
and free, and the peak is taken over the call (above what was allocated before it:
the inputs and the output's gradient). CUDA's caching allocator rounds sizes up and
keeps freed blocks, so ``torch.cuda.max_memory_allocated`` on a GPU can differ by a few
MiB; what this shows is where the peak falls and what moves it. Beside the peak, the
memory the forward pass leaves allocated for the backward pass (its output included:
what a model holds per layer until its backward pass), and the peak of the forward
pass alone under ``torch.no_grad()`` (inference). ``--rows-copied`` adds each
method with the landmark rows' gradient added out of place
(``gather_rows_through(in_place=False)``), as before it was added in place;
``--kept-products`` each method with the Lemma 3 step products kept from the forward to
the backward kernel (``triton_lemma3.keeps_products``); ``--composable`` Skyformer
composed of its Functions instead of run as two hand-chained nodes (``ops/skyformer/two_nodes.py``).

    python benchmarks/stubbed_memory.py [--shape 4,16,16384,64] [--dtype bfloat16]
                                        [--rows-copied] [--kept-products] [--composable]
                                        [--out FILE.md]

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
import functools
import sys
from collections.abc import Iterator
from unittest import mock

import torch
from host_time import stubbed_launches  # benchmarks/, beside this script
from kernel_flags import composed
from launch_counts import as_on_cuda, emit
from run_metadata import run_metadata
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.linalg import triton_lemma3, triton_lemma3_backward
from skyformer.ops.shared import modified_nystrom

METHODS = ("skyformer", "nystrom_softmax")
FORWARD = "stubbed_memory: forward"  # the profiler's name for the forward pass


@contextlib.contextmanager
def rows_copied() -> Iterator[None]:
    """The landmark rows' gradient added out of place (a copy of q's and k's size), in
    the composed call (Skyformer's two nodes add it in place)."""
    through = functools.partial(modified_nystrom.gather_rows_through, in_place=False)
    with mock.patch.object(modified_nystrom, "gather_rows_through",
                           lambda xs, indices, **_: through(xs, indices)), composed(True):
        yield


@contextlib.contextmanager
def kept_products() -> Iterator[None]:
    """The Lemma 3 step products kept from the forward to the backward kernel."""
    default = triton_lemma3.launch_options

    def keeping(m: int, backward: bool = False, graphed: bool = False,
                family: str = "default") -> dict:
        options = default(m, backward, graphed, family)
        return {**options, "KEEP_PRODUCTS": True} if backward else options

    with mock.patch.object(triton_lemma3, "launch_options", keeping), \
            mock.patch.object(triton_lemma3_backward, "launch_options", keeping):
        yield


def _allocations(node, stack: tuple[str, ...], out: list) -> None:
    if node.tag == _EventType.Allocation:
        fields = node.extra_fields
        out.append((node.start_time_ns, fields.alloc_size, fields.total_allocated, stack))
        return
    for child in node.children:
        _allocations(child, (*stack, node.name), out)


# Reductions that the CPU runs on a converted copy of a half-type input when asked for a
# float32 result (``sum(dtype=float32)``, ``mean``, ``linalg.vector_norm``: 256 MiB for
# each of q, k, v at B=4, H=16, N=16384, D=64); CUDA reads the input as it is.
CONVERTING_REDUCTIONS = {"aten::sum", "aten::mean", "aten::linalg_vector_norm", "aten::norm"}


def _events(prof) -> list:
    """(time, size, allocated after, op stack) of every allocation and free, in order,
    without the CPU-only copies of ``CONVERTING_REDUCTIONS`` (allocated by a conversion
    inside one, freed by it), "allocated after" counted again without them."""
    events: list = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, (), events)
    events.sort(key=lambda e: e[0])
    kept, skipped, total = [], [], events[0][2] - events[0][1] if events else 0
    for time, size, _, stack in events:
        reduction = next((n for n in reversed(stack) if n in CONVERTING_REDUCTIONS), None)
        if reduction and size > 0 and stack and stack[-1] in ("aten::_to_copy",
                                                               "aten::empty_strided"):
            skipped.append(size)
            continue
        if reduction and size < 0 and -size in skipped:
            skipped.remove(-size)
            continue
        total += size
        kept.append((time, size, total, stack))
    return kept


def no_grad_peak_mib(method: str, shape: tuple[int, int, int, int], dtype: torch.dtype,
                     features: int) -> float:
    """MiB above the memory held before a forward call under ``torch.no_grad()``."""
    q, k, v = (torch.randn(*shape, dtype=dtype) for _ in range(3))
    key = skyformer.random_key(0)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU],
                                  profile_memory=True) as prof:
        skyformer.attention(q, k, v, method, num_features=features, kernel="triton",
                            generator=key)
    events = _events(prof)
    return (max(e[2] for e in events) - (events[0][2] - events[0][1])) / 2**20


def peak_mib(method: str, shape: tuple[int, int, int, int], dtype: torch.dtype,
             features: int) -> tuple[float, str, float]:
    """(MiB above the memory held before the call, the operation at the peak, MiB the
    forward pass leaves allocated)."""
    b, h, n, d = shape
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    key = skyformer.random_key(0)

    def call() -> torch.Tensor:
        return skyformer.attention(q, k, v, method, num_features=features, kernel="triton",
                                   generator=key)

    grad = torch.ones_like(call())  # the warm-up call also compiles nothing: all stubbed
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.profiler.record_function(FORWARD):
            out = call()
        out.backward(grad)
        del out
    events = _events(prof)
    before = events[0][2] - events[0][1]
    top = max(events, key=lambda e: e[2])
    where = next((name for name in reversed(top[3]) if not name.startswith("aten::")),
                 top[3][-1] if top[3] else "")
    held = max((e for e in events if FORWARD in e[3]), key=lambda e: e[0])[2] - before
    return ((top[2] - before) / 2**20,
            where.replace("autograd::engine::evaluate_function: ", ""), held / 2**20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--shape", type=shape_argument("B,H,N,D"), default="4,16,16384,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--rows-copied", action="store_true")
    parser.add_argument("--kept-products", action="store_true")
    parser.add_argument("--composable", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shape = args.shape
    shape_text = ",".join(map(str, shape))
    dtype = getattr(torch, args.dtype)
    variants = [("", contextlib.nullcontext)]
    if args.rows_copied:
        variants.append((", rows' gradient copied", rows_copied))
    if args.kept_products:
        variants.append((", step products kept", kept_products))
    if args.composable:
        variants.append((", composable", lambda: composed(True)))
    lines = [f"B,H,N,D = {shape_text}, {args.dtype}, m = {args.features}: eager forward + "
             f"backward on the Triton path, launches stubbed, torch {torch.__version__}", "",
             "| method | peak MiB above the call's start | at | MiB held after the forward "
             "| peak MiB, no_grad forward |", "|---|---|---|---|---|"]
    rows = []
    with as_on_cuda(), stubbed_launches():
        for method in args.methods:
            for label, context in variants:
                if label == ", composable" and method != "skyformer":
                    continue  # the other methods have no one-node path
                with context():
                    mib, where, held = peak_mib(method, shape, dtype, args.features)
                    inference = no_grad_peak_mib(method, shape, dtype, args.features)
                lines.append(f"| `{method}`{label} | {mib:.1f} | {where} | {held:.1f} "
                             f"| {inference:.1f} |")
                rows.append({"method": method, "variant": label.lstrip(", "),
                             "peak_mib": mib, "at": where, "held_mib": held,
                             "no_grad_peak_mib": inference})
    emit(lines, args.out, run_metadata(__file__, argv, vars(args)), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
