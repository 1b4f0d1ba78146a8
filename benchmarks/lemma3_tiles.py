"""Tiles of the fused Lemma 3 kernels, timed on the GPU: which launch options are fastest.

``triton_lemma3.launch_options`` picks the row block (``ROWS``), the inner chunk
(``KC``), the warps and the pipeline stages of both Lemma 3 kernels from their compiled
resources (no spills), not from timings. This script times ``landmark_inverse`` (the
landmark block and its Lemma 3 inverse, forward + backward, and forward alone) for B x H
matrices of m landmark rows under each combination of options, interleaved, against the
PyTorch core, and checks that every combination gives the default's W and gradient.
The fastest combination per m is what ``launch_options`` should return on that GPU.

    python benchmarks/lemma3_tiles.py --out benchmarks/results/lemma3_tiles.json

``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same script to check it without a
GPU, at one tiny size: its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from unittest import mock

import torch

from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.io import atomic_write_text
from skyformer.linalg import (  # the triton_* modules import Triton
    half_sq_norm,
    landmark_inverse,
    triton_lemma3,
    triton_lemma3_backward,
)
from skyformer.linalg.kernel_backend import interpreter_on


def candidates(m: int, rows: list[int], stages: list[int], warps: list[int]) -> list[dict]:
    """The launch options to try at m landmarks (tiles within the padded matrix)."""
    default = triton_lemma3.launch_options(m)
    block = default["BLOCK"]
    found = [default]
    for r, s, w in itertools.product(rows, stages, warps):
        if r > block:
            continue
        option = {"BLOCK": block, "ROWS": r, "KC": r, "num_warps": w, "num_stages": s}
        if option not in found:
            found.append(option)
    return found


def _label(option: dict) -> str:
    return f"rows {option['ROWS']} kc {option['KC']} warps {option['num_warps']} " \
           f"stages {option['num_stages']}"


def measure(batch: int, heads: int, m: int, head_dim: int, options: list[dict], device: str,
            repeats: int) -> list[dict]:
    """One row per launch option (and the PyTorch core): fwd and fwd+bwd ms."""
    g = torch.Generator(device=device).manual_seed(m)
    x = (0.15 * torch.randn(batch, heads, m, head_dim, device=device, generator=g)
         ).requires_grad_(True)
    grad = torch.randn(batch, heads, m, m, device=device, generator=g)

    def call(kernel: str, option: dict | None, backward: bool):
        def run():
            with _options(option):
                if backward:
                    x.grad = None
                    w = landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel)
                    w.backward(grad)
                    return w.detach(), x.grad.clone()
                with torch.no_grad():
                    return landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel), None
        return run

    reference_w, reference_grad = call("triton", options[0], True)()
    calls = {"torch/fwd": call("torch", None, False), "torch/fwd+bwd": call("torch", None, True)}
    for option in options:
        w, dx = call("triton", option, True)()
        error = max(_relative(w, reference_w), _relative(dx, reference_grad))
        if error > 1e-4:  # a broken option: report it, do not time it
            print(f"m={m} {_label(option)}: differs from the default by {error:.2e}",
                  flush=True)
            continue
        calls[f"{_label(option)}/fwd"] = call("triton", option, False)
        calls[f"{_label(option)}/fwd+bwd"] = call("triton", option, True)
    times = interleaved_median_seconds(calls, device=device, warmup=2, repeats=repeats)
    rows = []
    for name, seconds in times.items():
        label, what = name.rsplit("/", 1)
        rows.append({"shape": f"{batch},{heads},m={m},D={head_dim}", "options": label,
                     "pass": what, "ms": seconds * 1e3,
                     "vs_torch": times[f"torch/{what}"] / seconds,
                     "default": label == _label(options[0])})
    for row in sorted(rows, key=lambda r: (r["pass"], r["ms"])):
        print(f"{row['shape']:22s} {row['pass']:8s} {row['options']:36s} {row['ms']:9.3f} ms "
              f"{row['vs_torch']:6.2f}x torch{'  (default)' if row['default'] else ''}",
              flush=True)
    return rows


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@contextlib.contextmanager
def _options(option: dict | None):
    """Both kernels launched with ``option`` (None: as the library chooses)."""
    if option is None:
        yield
        return

    def chosen(m: int) -> dict:
        return dict(option)

    with mock.patch.object(triton_lemma3, "launch_options", chosen), \
            mock.patch.object(triton_lemma3_backward, "launch_options", chosen):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default=None, help="B,H (default 4,16 on CUDA, 1,1 on CPU)")
    parser.add_argument("--features", type=int, nargs="+", default=None,
                        help="numbers of landmarks m (default 128 on CUDA, 16 on CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--warps", type=int, nargs="+", default=[8],
                        help="(each combination compiles both kernels: a few seconds)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("lemma3_tiles.py needs a CUDA device (--device cpu with TRITON_INTERPRET=1 "
              "checks the script without one).", file=sys.stderr)
        return 1
    if not on_gpu and not interpreter_on():
        print("--device cpu runs the Triton kernels under Triton's interpreter: set "
              "TRITON_INTERPRET=1 before Python starts.", file=sys.stderr)
        return 1
    batch, heads = map(int, (args.shape or ("4,16" if on_gpu else "1,1")).split(","))
    features = args.features or ([128] if on_gpu else [16])
    repeats = args.repeats or (10 if on_gpu else 1)
    rows = []
    for m in features:
        options = candidates(m, args.rows, args.stages, args.warps)
        rows += measure(batch, heads, m, args.head_dim, options, args.device, repeats)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)"
    if args.out:
        atomic_write_text(args.out, json.dumps(
            {"device": device_name, "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
