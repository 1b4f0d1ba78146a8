"""Tiles of the Gaussian block product kernels, timed on the GPU: which are fastest.

``triton_kernels._row_tiles`` and ``_col_tiles`` pick the tiles, warps and pipeline
stages of the rows kernel (C Z and the row-side gradients) and the cols kernel (C^T V
and the column-side gradients) from their compiled resources, not from timings. This
script times a Skyformer forward + backward (``kernel="triton"``, eager) at one shape
and length, interleaved: the rows kernel under each candidate (the cols kernel at its
default), and the cols kernel under each candidate (the rows kernel at its default).
Every candidate must give the default's output and gradients (to the rounding of the
inputs' dtype). The fastest of each kernel goes to the JSON's ``best``, which
``applied`` (``gpu_kernels.py --tiles``, ``gpu_profile.py --tiles``) launches in place
of the defaults for that head dim: what the library would do with them as its defaults.

    python benchmarks/product_tiles.py --out benchmarks/results/product_tiles.json

Candidates are ``BLOCK_N,BLOCK_M,WARPS,STAGES`` (rows kernel: BLOCK_N rows a program,
BLOCK_M columns a step; cols kernel: BLOCK_M columns a program, BLOCK_N rows a step).
``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same script to check it without a
GPU, at one tiny size: its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import tile_sweep
import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from run_metadata import run_metadata

import skyformer
from skyformer.checks import positive_int_argument, shape_dtype_argument
from skyformer.linalg import triton_kernels

# compiled for sm_90 at D = 64, bfloat16 inputs: at most 32 bytes of spills a thread in
# any of Skyformer's three launches of each kernel (triton_resources.py)
ROWS = ("128,32,8,1", "128,64,8,1", "64,32,8,1", "32,32,4,1", "64,32,4,2", "64,64,4,1")
COLS = ("128,32,4,1", "128,32,8,1", "64,64,4,1", "64,32,4,2", "64,32,8,1", "64,64,8,1",
        "32,32,4,1")
KERNELS = {"rows": "_row_tiles", "cols": "_col_tiles"}


def _tiles(spec: str) -> tuple[int, int, int, int]:
    block_n, block_m, warps, stages = map(int, spec.split(","))
    return block_n, block_m, warps, stages


def _label(tiles) -> str:
    return "n {} m {} warps {} stages {}".format(*tiles)


def measure(shape: str, n: int, features: int, specs: dict[str, list[str]], device: str,
            repeats: int) -> tuple[list[dict], dict]:
    """(one row per kernel and candidate: fwd+bwd ms; the fastest tiles of each kernel)."""
    b, h, d, dtype_name = shape.split(",")
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(n)
    q, k, v, grad = (torch.randn(int(b), int(h), n, int(d), device=device, generator=g)
                     .to(dtype) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    key = skyformer.random_key(0, device=device)
    width = max(16, 1 << (int(d) - 1).bit_length())  # the kernels' padded head dim

    def call(kernel: str | None, tiles: tuple | None):
        def run():
            with _patched({kernel: tiles} if kernel else {}, width):
                for t in leaves:
                    t.grad = None
                out = skyformer.attention(q, k, v, "skyformer", num_features=features,
                                          kernel="triton", generator=key)
                out.backward(grad)
                return [out.detach()] + [t.grad.clone() for t in leaves]
        return run

    reference = call(None, None)()
    half = dtype in (torch.bfloat16, torch.float16)
    capability = triton_kernels.device_capability(torch.device(device))
    defaults = {"rows": triton_kernels._row_tiles(width, width, torch.float32, half,
                                                  capability),
                "cols": triton_kernels._col_tiles(width, width, torch.float32, half,
                                                  capability)}
    options = {kernel: [defaults[kernel]] + [t for t in map(_tiles, specs[kernel])
                                             if t != defaults[kernel]]
               for kernel in KERNELS}
    rows, best = tile_sweep.sweep(call, reference, options, defaults, _label, shape=shape,
                                  n=n, device=device, repeats=repeats)
    return rows, {"width": width} | best


@contextlib.contextmanager
def _patched(table: dict, width: int):
    """The kernels of ``table`` (``{"rows" | "cols": tiles}``) launched with those tiles
    where the wider of the padded head dim and value width is ``width`` (float32 compute);
    elsewhere as the library chooses."""
    with contextlib.ExitStack() as stack:
        for kernel, tiles in table.items():
            default = getattr(triton_kernels, KERNELS[kernel])

            def chosen(bd, br, dtype, *rest, tiles=tuple(tiles), default=default):
                if dtype == torch.float32 and max(bd, br) == width:
                    return tiles
                return default(bd, br, dtype, *rest)

            stack.enter_context(mock.patch.object(triton_kernels, KERNELS[kernel], chosen))
        yield


@contextlib.contextmanager
def applied(best: dict):
    """The fastest tiles a run of this script recorded (its JSON's ``best``) in place of
    the defaults."""
    for kernel in KERNELS:
        print(f"{kernel} kernel tiles at head dim {best['width']}: {_label(best[kernel])}",
              flush=True)
    with _patched({kernel: best[kernel] for kernel in KERNELS}, best["width"]):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default=None,
                        type=shape_dtype_argument("B,H,D"),
                        help="B,H,D,dtype (default 4,16,64,bfloat16; on the CPU 1,1,16,float32)")
    parser.add_argument("--seq-len", type=positive_int_argument,
                        default=None, help="default 16384 (CPU: 64)")
    parser.add_argument("--features", type=positive_int_argument,
                        default=None, help="default 128 (CPU: 16)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS),
                        help="rows kernel candidates BLOCK_N,BLOCK_M,WARPS,STAGES")
    parser.add_argument("--cols", nargs="+", default=list(COLS),
                        help="cols kernel candidates BLOCK_N,BLOCK_M,WARPS,STAGES")
    parser.add_argument("--repeats", type=positive_int_argument, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    problem = device_problem("product_tiles.py", args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    shape = args.shape or ("4,16,64,bfloat16" if on_gpu else "1,1,16,float32")
    n = args.seq_len or (16384 if on_gpu else 64)
    repeats = args.repeats or (7 if on_gpu else 1)
    features = args.features or (128 if on_gpu else 16)
    rows, best = measure(shape, n, features, {"rows": args.rows, "cols": args.cols},
                         args.device, repeats)
    config = vars(args) | {"shape": shape, "seq_len": n, "features": features,
                           "repeats": repeats}
    tile_sweep.record("products", rows, best, KERNELS, _label, args.out, on_gpu,
                      run_metadata(__file__, argv, config, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
