"""Row slices of the cols kernel, timed on the GPU: how many programs per SM to aim at.

The cols kernel (``linalg/triton_kernels.py``: C^T V and the column-side gradients) has
few column blocks (m / 64 at m = 128), so it also splits the N rows into slices, adding
their partial sums afterwards; ``triton_kernels.COLS_PROGRAMS_PER_SM`` sets how many
programs per multiprocessor the slices aim at. Too few leave a part-filled last wave
(the kernel keeps only two or three programs resident per SM); too many add partial
sums. This times a Skyformer forward + backward (``kernel="triton"``,
``pinv_gradient="implicit"``, eager) under each target, interleaved, and sums the GPU
time of each kernel over three profiled calls (``torch.profiler``), so that the cols
kernel's own time shows beside the call's.

    python benchmarks/col_slices.py [--seq-lens 32768 4096] [--out FILE.txt]

``--out FILE.txt`` writes the table there and FILE.json beside. ``--device cpu`` (with
``TRITON_INTERPRET=1``) checks the script at one tiny size, as if the CPU were a GPU of
one SM: its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from unittest import mock

import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from gpu_profile import kernel_times
from run_metadata import run_metadata, write_report

import skyformer
from skyformer.checks import positive_int_argument, shape_dtype_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.linalg import triton_kernels

TARGETS = (4, 6, 8, 12, 16, 32)


@contextlib.contextmanager
def programs_per_sm(target: int) -> Iterator[None]:
    """Inside: the cols kernel's slices aim at ``target`` programs per SM (on the CPU,
    as if it were a GPU of one SM)."""
    def splits(n, blocks, block_n, device, per_sm=None):
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
        return triton_kernels.slices_for(n, blocks, block_n, sms, target)

    with mock.patch.object(triton_kernels, "_splits", splits):
        yield


def kernel_ms(fn, device: str, calls: int = 3) -> dict[str, float]:
    """GPU time of each kernel per call of ``fn`` (already warm), over ``calls`` calls
    (``gpu_profile.kernel_times``); empty on the CPU."""
    if device != "cuda":
        return {}
    durations, _ = kernel_times(fn, torch.device(device), calls)
    return {name: sum(us) / 1e3 / calls for name, us in durations.items()}


def measure(shape: str, n: int, features: int, targets: list[int], device: str,
            repeats: int) -> list[dict]:
    """One row per target: the call's wall ms, its GPU busy ms and the cols kernel's."""
    b, h, d, dtype_name = shape.split(",")
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(int(b), int(h), n, int(d), device=device, generator=g)
                     .to(getattr(torch, dtype_name)) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    key = skyformer.random_key(0, device=device)

    def call(target):
        def run():
            with programs_per_sm(target):
                for t in leaves:
                    t.grad = None
                skyformer.attention(q, k, v, "skyformer", num_features=features,
                                    kernel="triton", pinv_gradient="implicit",
                                    generator=key).backward(grad)
        return run

    calls = {target: call(target) for target in targets}
    times = interleaved_median_seconds(calls, device=device, warmup=2, repeats=repeats)
    rows = []
    for target, fn in calls.items():
        kernels = kernel_ms(fn, device)
        rows.append({"shape": shape, "n": n, "programs_per_sm": target,
                     "ms": times[target] * 1e3,
                     "busy_ms": sum(kernels.values()) if kernels else None,
                     "cols_kernel_ms": kernels.get("_cols_kernel")})
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[dict], title: str) -> str:
    lines = [title, "", "| N | programs per SM | wall ms | GPU busy ms | cols kernel ms |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['programs_per_sm']} | {r['ms']:.3f} | {_ms(r['busy_ms'])} | "
              f"{_ms(r['cols_kernel_ms'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default=None,
                        type=shape_dtype_argument("B,H,D"),
                        help="B,H,D,dtype (default 4,16,64,bfloat16; on the CPU 1,1,16,float32)")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument, default=None,
                        help="default 32768 4096 (CPU: 64)")
    parser.add_argument("--features", type=positive_int_argument,
                        default=None, help="default 128 (CPU: 16)")
    parser.add_argument("--targets", nargs="+", type=int, default=list(TARGETS),
                        help="programs per SM to time")
    parser.add_argument("--repeats", type=positive_int_argument,
                        default=None, help="default 15 (CPU: 1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    problem = device_problem("col_slices.py", args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    on_gpu = args.device == "cuda"
    shape = args.shape or ("4,16,64,bfloat16" if on_gpu else "1,1,16,float32")
    seq_lens = args.seq_lens or ([32768, 4096] if on_gpu else [64])
    features = args.features or (128 if on_gpu else 16)
    repeats = args.repeats or (15 if on_gpu else 1)
    if min(args.targets) < 1:
        parser.error(f"--targets are programs per SM, at least 1: got {args.targets}")
    rows = []
    for n in seq_lens:
        rows += measure(shape, n, features, args.targets, args.device, repeats)
        for row in rows[-len(args.targets):]:
            print(f"N={n:6d} {row['programs_per_sm']:3d}/SM wall {row['ms']:8.3f} ms  busy "
                  f"{_ms(row['busy_ms'])} ms  cols kernel {_ms(row['cols_kernel_ms'])} ms",
                  flush=True)
    name = torch.cuda.get_device_name() if on_gpu else "CPU (script check)"
    title = (f"{name}, torch {torch.__version__}, B,H,D,dtype = {shape}, m = {features}, "
             f"Skyformer forward + backward (implicit gradient), medians of {repeats}")
    text = table(rows, title)
    print(text)
    if args.out:
        config = vars(args) | {"shape": shape, "seq_lens": seq_lens, "features": features,
                               "repeats": repeats}
        write_report(args.out, text, run_metadata(__file__, argv, config, args.device),
                     rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
