"""Tiles of exact kernelized attention's flash kernels, timed on the GPU: which are fastest.

``ops/kernelized/triton_flash.flash_tiles`` picks the blocks, warps and pipeline stages
of the forward kernel (queries a program, keys a step), the key-gradient kernel (keys a
program, queries a step) and the query-gradient kernel (queries a program, keys a
step) from their compiled resources, not from timings. This script times an exact
kernelized forward + backward (``kernel="triton"``, eager) at one shape and length,
interleaved: each kernel under each candidate, the other two at their defaults. Every
candidate must give the default's output and gradients (to the rounding of the inputs'
dtype). The fastest of each kernel goes to the JSON's ``best``, which ``applied``
(``gpu_kernels.py --tiles``, ``gpu_profile.py --tiles``) launches in place of the
defaults for that dtype and head dim.

    python benchmarks/flash_tiles.py --out benchmarks/results/flash_tiles.json

Candidates are ``OWN,STEP,WARPS,STAGES``: the block of the program's own rows and the
block of its loop. ``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same script
to check it without a GPU, at one tiny size: its times mean nothing.
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
from skyformer.ops.kernelized import triton_flash

# compiled for sm_90 at D = 64, bfloat16, by Triton 3.6.0 (triton_resources.py's
# compile step): none spills
CANDIDATES = {
    "forward": ("128,64,4,3", "128,32,4,2", "64,64,4,2", "128,64,8,2", "128,128,8,2",
                "64,32,4,2", "128,64,8,3"),
    "keys": ("128,32,8,2", "64,32,4,2", "64,64,4,3", "128,64,8,2", "32,64,4,2"),
    "queries": ("128,32,8,2", "64,32,4,2", "64,64,4,3", "128,64,8,2", "128,32,4,2"),
}


def _tiles(spec: str) -> tuple[int, int, int, int]:
    own, step, warps, stages = map(int, spec.split(","))
    return own, step, warps, stages


def _as_tiles(options: dict, kind: str) -> tuple[int, int, int, int]:
    own, step = ("BLOCK_N", "BLOCK_M") if kind == "keys" else ("BLOCK_M", "BLOCK_N")
    return options[own], options[step], options["num_warps"], options["num_stages"]


def _as_options(tiles, kind: str) -> dict:
    own, step, warps, stages = tiles
    blocks = {"BLOCK_N": own, "BLOCK_M": step} if kind == "keys" else \
        {"BLOCK_M": own, "BLOCK_N": step}
    return blocks | {"num_warps": warps, "num_stages": stages}


def _label(tiles) -> str:
    return "own {} step {} warps {} stages {}".format(*tiles)


@contextlib.contextmanager
def _patched(table: dict, dtype: torch.dtype, head_dim: int):
    """The kernels of ``table`` (``{kind: tiles}``) launched with those tiles for inputs
    of ``dtype`` and ``head_dim``; everything else as the library chooses."""
    default = triton_flash.flash_tiles

    def chosen(of_dtype, of_head_dim, kind, *rest):
        if kind in table and of_dtype == dtype and of_head_dim == head_dim:
            return _as_options(table[kind], kind)
        return default(of_dtype, of_head_dim, kind, *rest)

    with mock.patch.object(triton_flash, "flash_tiles", chosen):
        yield


def measure(shape: str, n: int, specs: dict[str, list[str]], device: str, repeats: int
            ) -> tuple[list[dict], dict]:
    """(one row per kernel and candidate: fwd+bwd ms; the fastest tiles of each kernel)."""
    b, h, d, dtype_name = shape.split(",")
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(n)
    q, k, v, grad = (torch.randn(int(b), int(h), n, int(d), device=device, generator=g)
                     .to(dtype) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def call(kind: str | None, tiles: tuple | None):
        def run():
            with _patched({kind: tiles} if kind else {}, dtype, int(d)):
                for t in leaves:
                    t.grad = None
                out = skyformer.attention(q, k, v, "kernelized", kernel="triton")
                out.backward(grad)
                return [out.detach()] + [t.grad.clone() for t in leaves]
        return run

    reference = call(None, None)()
    capability = triton_kernels.device_capability(torch.device(device))
    defaults = {kind: _as_tiles(triton_flash.flash_tiles(dtype, int(d), kind, capability),
                                kind)
                for kind in CANDIDATES}
    options = {kind: [defaults[kind]] + [t for t in map(_tiles, specs[kind])
                                         if t != defaults[kind]] for kind in CANDIDATES}
    rows, best = tile_sweep.sweep(call, reference, options, defaults, _label, shape=shape,
                                  n=n, device=device, repeats=repeats)
    return rows, {"dtype": dtype_name, "head_dim": int(d)} | best


@contextlib.contextmanager
def applied(best: dict):
    """The fastest tiles a run of this script recorded (its JSON's ``best``) in place of
    the defaults, for the dtype and head dim it measured."""
    for kind in CANDIDATES:
        print(f"flash {kind} kernel tiles ({best['dtype']}, head dim {best['head_dim']}): "
              f"{_label(best[kind])}", flush=True)
    with _patched({kind: tuple(best[kind]) for kind in CANDIDATES},
                  getattr(torch, best["dtype"]), best["head_dim"]):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default=None,
                        type=shape_dtype_argument("B,H,D"),
                        help="B,H,D,dtype (default 4,16,64,bfloat16; on the CPU 1,1,16,float32)")
    parser.add_argument("--seq-len", type=positive_int_argument,
                        default=None, help="default 8192 (CPU: 64)")
    for kind in CANDIDATES:
        parser.add_argument(f"--{kind}", nargs="+", default=list(CANDIDATES[kind]),
                            help=f"{kind} kernel candidates OWN,STEP,WARPS,STAGES")
    parser.add_argument("--repeats", type=positive_int_argument, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    problem = device_problem("flash_tiles.py", args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    shape = args.shape or ("4,16,64,bfloat16" if on_gpu else "1,1,16,float32")
    n = args.seq_len or (8192 if on_gpu else 64)
    repeats = args.repeats or (7 if on_gpu else 1)
    rows, best = measure(shape, n, {kind: getattr(args, kind) for kind in CANDIDATES},
                         args.device, repeats)
    config = vars(args) | {"shape": shape, "seq_len": n, "repeats": repeats}
    tile_sweep.record("flash", rows, best, CANDIDATES, _label, args.out, on_gpu,
                      run_metadata(__file__, argv, config, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
