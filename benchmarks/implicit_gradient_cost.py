"""Time of ``pinv_gradient="implicit"`` against the default unrolled gradient, in one run.

Interleaved rounds (each round runs every call once, so load hits all alike), medians:

- the m x m core alone (``landmark_inverse``: C(X, X) and its Lemma 3 inverse) for
  float32 landmark rows ``[1, heads, m, 64]``, forward alone (under ``no_grad``) and
  forward + backward, unrolled (the authors' 6 steps and their adjoint) and implicit
  (the ridge inverse and two products backward), the inverse formed as the library
  forms it (``implicit``: a Cholesky factorisation on CPU tensors) and by the bound's
  steps (``implicit-steps``: 9 at m = 128 in float32; what GPU tensors take);
- a whole Skyformer forward + backward at each N of ``--seq-lens`` for one shape.

``--kernel`` picks the path (``torch`` by default; ``triton`` on CUDA, or on the CPU
under ``TRITON_INTERPRET=1``, where the interpreter's times mean nothing). The GPU's
numbers come from ``gpu_kernels.py``, which has these rows too.

    python benchmarks/implicit_gradient_cost.py [--out benchmarks/results/implicit_cost]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from run_metadata import run_metadata

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.io import atomic_write_text, write_json
from skyformer.linalg import GRADIENTS, half_sq_norm, implicit_inverse, landmark_inverse

STEPS = "implicit-steps"  # the implicit gradient with the inverse formed by the steps
VARIANTS = (*GRADIENTS, STEPS)


def _as_variant(variant: str) -> tuple[str, contextlib.AbstractContextManager]:
    """(the ``gradient`` option, a context forcing the steps for ``STEPS``)."""
    if variant != STEPS:
        return variant, contextlib.nullcontext()
    return "implicit", mock.patch.object(implicit_inverse, "_resolve_solver",
                                         lambda solver, a: "steps")


def core_calls(heads: int, m: int, kernel: str, device: str) -> dict[str, Callable[[], None]]:
    """The core alone for each gradient, forward and forward + backward."""
    g = torch.Generator().manual_seed(0)
    x = (0.15 * torch.randn(1, heads, m, 64, generator=g)).to(device).requires_grad_(True)
    grad = torch.randn(1, heads, m, m, generator=g).to(device)

    def call(variant: str, backward: bool) -> Callable[[], None]:
        def run() -> None:
            x.grad = None
            gradient, solver = _as_variant(variant)
            with torch.enable_grad() if backward else torch.no_grad(), solver:
                w = landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel,
                                     gradient=gradient)
                if backward:
                    w.backward(grad)
        return run

    return {f"core {mode} {variant}": call(variant, mode == "fwd+bwd")
            for mode in ("fwd", "fwd+bwd") for variant in VARIANTS}


def attention_calls(shape: tuple[int, int, int], n: int, m: int, kernel: str, device: str
                    ) -> dict[str, Callable[[], None]]:
    """A Skyformer forward + backward at length ``n`` for each gradient."""
    b, h, d = shape
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device).requires_grad_(True)
               for _ in range(3))
    key = skyformer.random_key(0, device=device)

    def call(variant: str) -> Callable[[], None]:
        def run() -> None:
            gradient, solver = _as_variant(variant)
            with solver:
                out = skyformer.attention(q, k, v, "skyformer", num_features=m,
                                          kernel=kernel, pinv_gradient=gradient,
                                          generator=key)
                out.sum().backward()
            for t in (q, k, v):  # each call makes its own gradients, not adds to the last
                t.grad = None
        return run

    return {f"N={n} {variant}": call(variant) for variant in VARIANTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernel", default="torch", choices=["torch", "triton"])
    parser.add_argument("--heads", type=positive_int_argument,
                        default=16, help="matrices of the core alone")
    parser.add_argument("--features", type=positive_int_argument, default=128, help="landmarks m")
    parser.add_argument("--shape", type=shape_argument("B,H,D"), default="1,2,32",
                        help="of the whole calls")
    parser.add_argument("--seq-lens", type=positive_int_argument, nargs="*", default=[1024, 4096])
    parser.add_argument("--repeats", type=positive_int_argument, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    if args.device != "cpu" or args.kernel == "triton":  # the torch path needs no interpreter
        problem = device_problem("implicit_gradient_cost.py", args.device)
        if problem:
            print(problem, file=sys.stderr)
            return 1
    shape = args.shape
    shape_text = ",".join(map(str, shape))
    calls = core_calls(args.heads, args.features, args.kernel, args.device)
    for n in args.seq_lens:
        calls |= attention_calls(shape, n, args.features, args.kernel, args.device)
    times = interleaved_median_seconds(calls, device=args.device, warmup=3,
                                       repeats=args.repeats)
    lines = [f"m = {args.features}, kernel={args.kernel!r}, {args.device}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}; core: "
             f"[1, {args.heads}, m, 64] float32 rows; calls: B,H,D = {shape_text} float32, "
             f"forward + backward; medians of {args.repeats} interleaved rounds", "",
             "| call | unrolled ms | implicit ms | implicit by the steps ms "
             "| unrolled / implicit | steps / implicit |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(c.rsplit(" ", 1)[0] for c in calls):
        unrolled, implicit, steps = (times[f"{name} {variant}"] for variant in VARIANTS)
        lines.append(f"| {name} | {unrolled * 1e3:.2f} | {implicit * 1e3:.2f} | "
                     f"{steps * 1e3:.2f} | {unrolled / implicit:.2f}x | "
                     f"{steps / implicit:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out.with_suffix(".json"),
                   {**run_metadata(__file__, argv, vars(args), args.device),
                    "ms": {name: t * 1e3 for name, t in times.items()}}, indent=1)
        atomic_write_text(args.out.with_suffix(".md"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
