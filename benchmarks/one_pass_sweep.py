"""Where the products' one-pass backward pass pays on a GPU, and where it does not.

For each B x H, N, head dim and dtype: the GPU time of one Skyformer forward + backward
(``kernel="triton"``, ``pinv_gradient="implicit"``, m = ``--features``), the sum of its
kernels' durations under ``torch.profiler`` (free of the host's issuing; a CUDA graph's
replay adds the gaps between kernels: 1.58 ms in a graph against 0.99 summed at the LRA
shape on an H100), with the Gaussian block products' backward pass by
the rows and cols kernels (the default) and in one pass over the rows
(``linalg/triton_one_pass.py``, ``kernel_matmul_triton.ONE_PASS_BACKWARD``); beside it
the time of the product kernels alone (``_rows_kernel``, ``_cols_kernel``,
``_one_pass_kernel``). The ratio is the two kernels' time over the one pass's: above 1
the one pass is faster.

    python benchmarks/one_pass_sweep.py --out benchmarks/results/one_pass_sweep

Writes OUT.json and OUT.md atomically. ``--device cpu`` (with ``TRITON_INTERPRET=1``)
checks the script at one tiny size; its times are of CPU operators and mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from gpu_profile import kernel_times
from kernel_flags import one_pass_backward
from run_metadata import run_metadata

import skyformer
from skyformer.checks import FLOAT_DTYPES, positive_int_argument, shape_argument
from skyformer.io import atomic_write_text, write_json

PRODUCT_KERNELS = ("_rows_kernel", "_cols_kernel", "_one_pass_kernel")


def measure(batch: int, heads: int, n: int, d: int, dtype: torch.dtype, features: int,
            device: torch.device, iterations: int) -> dict:
    """The GPU time per call (ms) of the whole call and of the product kernels, with
    the two-kernel and the one-pass backward pass."""
    g = torch.Generator(device=device).manual_seed(n + d)
    q, k, v, grad = (torch.randn(batch, heads, n, d, device=device, generator=g).to(dtype)
                     for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    key = skyformer.random_key(0, device=device)

    def step():
        for t in leaves:
            t.grad = None
        skyformer.attention(*leaves, "skyformer", num_features=features, kernel="triton",
                            pinv_gradient="implicit", generator=key).backward(grad)

    row = {}
    for label, on in (("two", False), ("one", True)):
        with one_pass_backward(on, force=True):
            for _ in range(2):  # warm-up: compilation, allocator
                step()
            kernels, _ = kernel_times(step, device, iterations)
        row[f"{label}_ms"] = sum(map(sum, kernels.values())) / iterations / 1e3
        row[f"{label}_products_ms"] = sum(
            sum(times) for name, times in kernels.items()
            if any(kernel in name for kernel in PRODUCT_KERNELS)) / iterations / 1e3
        row[f"{label}_launched"] = sorted(
            {kernel for name in kernels for kernel in PRODUCT_KERNELS if kernel in name})
    # where the one pass does not apply (one_pass_applies) both runs are the two kernels;
    # on the CPU the profiler sees operators, not kernels: the ratio is kept there
    row["ratio"] = (row["two_ms"] / max(row["one_ms"], 1e-12)
                    if "_one_pass_kernel" in row["one_launched"] or device.type != "cuda"
                    else None)
    return row


def _ratio(row: dict) -> str:
    return "n/a (no one pass)" if row["ratio"] is None else f"{row['ratio']:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch-heads", nargs="+", default=None, type=shape_argument("B,H"),
                        help="B,H pairs (default 1,2 1,16 4,16; CPU 1,1)")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument, default=None,
                        help="default 1024 4096 16384 32768 (CPU 64)")
    parser.add_argument("--head-dims", nargs="+", type=positive_int_argument, default=None,
                        help="default 32 64 (CPU 16)")
    parser.add_argument("--dtypes", nargs="+", choices=FLOAT_DTYPES,
                        default=["float32", "bfloat16"])
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--iterations", type=positive_int_argument, default=3)
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json, OUT.md")
    args = parser.parse_args(argv)
    problem = device_problem("one_pass_sweep.py", args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    on_gpu = args.device == "cuda"
    batch_heads = args.batch_heads or ([(1, 2), (1, 16), (4, 16)] if on_gpu else [(1, 1)])
    seq_lens = args.seq_lens or ([1024, 4096, 16384, 32768] if on_gpu else [64])
    head_dims = args.head_dims or ([32, 64] if on_gpu else [16])
    device = torch.device(args.device)
    rows = []
    for dtype_name in args.dtypes:
        for d in head_dims:
            for batch, heads in batch_heads:
                for n in seq_lens:
                    row = {"b": batch, "h": heads, "n": n, "d": d, "dtype": dtype_name} | \
                        measure(batch, heads, n, d, getattr(torch, dtype_name),
                                args.features, device, args.iterations)
                    rows.append(row)
                    print(f"{dtype_name:9s} D={d:3d} B,H={f'{batch},{heads}':5s} N={n:6d}  call "
                          f"{row['two_ms']:8.3f} / {row['one_ms']:8.3f} ms  products "
                          f"{row['two_products_ms']:8.3f} / {row['one_products_ms']:8.3f} ms"
                          f"  {_ratio(row)}", flush=True)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (script check)"
    config = vars(args) | {"batch_heads": [f"{b},{h}" for b, h in batch_heads],
                           "seq_lens": seq_lens,
                           "head_dims": head_dims}
    if args.out is not None:
        write_json(args.out.with_suffix(".json"),
                   {"device": name, **run_metadata(__file__, argv, config, device),
                    "torch": torch.__version__, "features": args.features, "rows": rows},
                   indent=1)
        lines = [f"{name}, torch {torch.__version__}, m = {args.features}, Skyformer "
                 "forward + backward (implicit core), GPU time per call in ms: two kernels "
                 "/ one pass (ratio > 1: the one pass is faster)", "",
                 "| dtype | D | B,H | N | call | products | ratio |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['d']} | {r['b']},{r['h']} | {r['n']} | "
                  f"{r['two_ms']:.3f} / {r['one_ms']:.3f} | {r['two_products_ms']:.3f} / "
                  f"{r['one_products_ms']:.3f} | {_ratio(r)} |" for r in rows]
        atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
