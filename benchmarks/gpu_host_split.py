"""Where an eager call's wall time goes on a CUDA machine: Triton's launcher, the rest of
the host, the GPU.

An eager Skyformer forward + backward below N = 8192 is host-bound on a GPU (docs/gpu-record.md).
This splits its host time on the machine itself, in one interleaved run:

- the call as it is (wall time, synchronised after each call);
- the same call with every Triton kernel of the library stubbed (``host_time.py``): the
  host's work without Triton's launcher, plus the GPU work of the PyTorch operations
  (the kernels are switched off and on around each stubbed call, so both rows take one
  more Python call a launch, next to the launcher's tens of microseconds);
- SDPA (flash, on CUDA in half precision), forward + backward, for scale;

and two per-launch costs on the same host: an empty PyTorch operation on a small CUDA
tensor, and an empty Triton kernel launched through ``kernel[grid](...)`` (the JIT's
launcher, which the library uses) and through the compiled kernel's own handle (the
lowest-overhead launch Triton offers). The difference of the first two rows, and the
launch costs times the launch counts (``launch_counts.py``), say what a cheaper launcher
or fewer PyTorch operations could save.

    python benchmarks/gpu_host_split.py [--shape 4,16,4096,64] [--dtype bfloat16]
                                        [--calls 30] [--out FILE.md]

``--out FILE.md`` writes the tables there and FILE.json beside (the numbers, every
setting, the environment and the command).

``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same script on CPU tensors to
check it without a GPU; its times mean nothing there (``host_time.py`` is the CPU's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_device import device_problem  # benchmarks/, beside this script
from host_time import call_of, stubbed_launches
from launch_counts import as_on_cuda
from run_metadata import run_metadata, write_report

from skyformer.checks import positive_int_argument, shape_argument
from skyformer.eval.measure.timing import interleaved_seconds

LAUNCHES = 200  # per timed loop of the per-launch costs


@triton.jit
def _empty_kernel(X):
    """Loads and stores one value: a launch that does next to nothing."""
    tl.store(X, tl.load(X))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_call(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
              ) -> Callable[[], None]:
    """One eager forward + backward of SDPA (the skyformer call: ``host_time.call_of``)."""
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
        for t in (q, k, v):  # each call makes its own gradients, as the skyformer call's
            t.grad = None
    return call


def _no_launch(*args: object, **kwargs: object) -> None:
    """A stubbed launch (``host_time._NoLaunch``'s): the outputs are left unwritten."""


class _Switchable:
    """Stands for a ``triton.jit`` kernel: ``kernel[grid](...)`` launches it, or does
    nothing while ``_Switchable.off`` is set (``without_launches``)."""

    off = False

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: object) -> Callable[..., object]:
        return _no_launch if _Switchable.off else self.kernel[grid]

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


def without_launches(call: Callable[[], None]) -> Callable[[], None]:
    """``call`` with every library kernel stubbed, for a run inside
    ``stubbed_launches(_Switchable)``, interleaved with the call as it is."""
    def stubbed() -> None:
        _Switchable.off = True
        try:
            call()
        finally:
            _Switchable.off = False
    return stubbed


def per_launch_seconds(launch: Callable[[], object], device: torch.device) -> float:
    """Host seconds per launch: ``LAUNCHES`` launches issued back to back, the median
    of five loops (each synchronised before and after)."""
    loops = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(LAUNCHES):
            launch()
        loops.append(time.perf_counter() - start)
        _sync(device)
    return statistics.median(loops) / LAUNCHES


def launch_costs(device: torch.device) -> dict[str, float]:
    """Seconds per launch of an empty PyTorch operation and of an empty Triton kernel
    through the JIT and through its compiled handle (none under the interpreter)."""
    x = torch.zeros(64, device=device)
    compiled = _empty_kernel[(1,)](x)  # compiles; the JIT returns the compiled kernel
    costs = {"PyTorch operation (x.add_(0))": per_launch_seconds(lambda: x.add_(0), device),
             "Triton, kernel[grid](...)": per_launch_seconds(
                 lambda: _empty_kernel[(1,)](x), device)}
    try:
        runner = compiled[(1, 1, 1)]
        costs["Triton, compiled handle"] = per_launch_seconds(lambda: runner(x), device)
    except (AttributeError, TypeError) as error:  # the handle's API differs by version
        print(f"compiled handle not timed: {error}", file=sys.stderr)
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=shape_argument("B,H,N,D"), default=None,
                        help="default 4,16,4096,64 (CPU: 1,1,64,16)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 (CPU: float32)")
    parser.add_argument("--features", type=positive_int_argument,
                        default=None, help="default 128 (CPU: 16)")
    parser.add_argument("--calls", type=positive_int_argument,
                        default=None, help="default 30 (CPU: 3)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: check the script (TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    problem = device_problem("gpu_host_split.py", args.device)
    if problem is not None:
        parser.error(f"{problem} (host_time.py splits a CPU call)")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"  # the CPU checks the script at tiny sizes
    args.shape = args.shape or ((4, 16, 4096, 64) if on_gpu else (1, 1, 64, 16))
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.features = args.features or (128 if on_gpu else 16)
    args.calls = args.calls or (30 if on_gpu else 3)
    shape, dtype = args.shape, getattr(torch, args.dtype)
    skyformer = call_of("skyformer", *shape, args.features, device=device, dtype=dtype)
    calls = {"skyformer, as it is": skyformer,
             "skyformer, Triton kernels stubbed": without_launches(skyformer),
             "SDPA": sdpa_call(shape, dtype, device)}
    with as_on_cuda(), stubbed_launches(_Switchable):
        times = interleaved_seconds(calls, device=device, warmup=args.warmup, repeats=args.calls)
    rows = [(name, statistics.median(seconds)) for name, seconds in times.items()]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (script check)"
    lines = [f"{name}, torch {torch.__version__}, Triton "
             f"{triton.__version__}, B,H,N,D = {','.join(map(str, shape))}, {args.dtype}, m = "
             f"{args.features}, forward + backward, median of {args.calls}", "",
             "| call | wall ms |", "|---|---|"]
    lines += [f"| {name} | {seconds * 1e3:.3f} |" for name, seconds in rows]
    lines += ["", f"Host cost per launch (median of 5 loops of {LAUNCHES})", "",
              "| launch | us |", "|---|---|"]
    costs = launch_costs(device)
    lines += [f"| {name} | {seconds * 1e6:.1f} |" for name, seconds in costs.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, text, run_metadata(__file__, argv, vars(args), device),
                     rows=[{"call": name, "wall_ms": seconds * 1e3} for name, seconds in rows],
                     launch_us=[{"launch": name, "us": seconds * 1e6}
                                for name, seconds in costs.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
