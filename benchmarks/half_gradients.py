"""Accuracy of bfloat16 outputs and gradients on clustered inputs, against float64.

Queries and keys around a few centres (``--centres``, spread ``--noise``; 0: repeated
tokens) are where a query's gradient cancels between its two routes, the rows of
C(Q, X_S) and the landmark rows drawn from q (docs/gpu-record.md, "Half-precision inputs read
as they are"). For each method, noise, path (``kernel="torch"``: q, k, v converted to
float32 inside; ``"triton"``: half rows read as they are) and dtype: the relative
Frobenius error of the output and of dq, dk, dv against the same call in float64 on the
PyTorch path, with the same landmarks, on the same bfloat16-rounded q, k, v and output
weights (the upstream gradient). ``--methods kernelized``: exact kernelized attention,
which draws no landmarks (its Triton path is the flash kernels).

    TRITON_INTERPRET=1 python benchmarks/half_gradients.py --out benchmarks/results/half_gradients

On the CPU the Triton kernels run under the interpreter: their products are exact, as
the tensor cores' are at PyTorch's default precision ("highest"), and their conversions
to bfloat16 round to nearest as a GPU's do (``linalg/triton_rounding.py``; the
interpreter's own conversion truncates); ``--device cuda`` runs them on a GPU. Writes
OUT.json and OUT.md atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from kernel_flags import rows_one_bf16_pass
from run_metadata import run_metadata

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.eval.measure.metrics import relative_error
from skyformer.io import atomic_write_text, write_json
from skyformer.registry import get_method


def clustered(n: int, d: int, centres: int, noise: float, seed: int,
              independent_keys: bool = False) -> tuple:
    """(q, k, v, weights) ``[1, 2, n, d]`` in float64: q and k around ``centres`` shared
    points (key j around query j's centre, or, ``independent_keys``, a centre of its
    own), v and the output weights standard normal."""
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(1, 2, centres, d, generator=g, dtype=torch.float64)
    base = points[:, :, torch.randint(0, centres, (n,), generator=g)]
    key_base = points[:, :, torch.randint(0, centres, (n,), generator=g)] \
        if independent_keys else base
    q, k = (b + noise * torch.randn(1, 2, n, d, generator=g, dtype=torch.float64)
            for b in (base, key_base))
    v, weights = (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, weights


def call(method: str, inputs: tuple, dtype: torch.dtype, device: str, kernel: str,
         features: int, landmark_seed: int = 3) -> list[torch.Tensor]:
    """[output, dq, dk, dv] of one call in ``dtype``: q, k, v and the output's weights
    (the upstream gradient) rounded to bfloat16 first, so that every call, the float64
    reference too, differentiates the same numbers and only its own rounding differs."""
    q, k, v, weights = (t.to(torch.bfloat16).to(device, dtype) for t in inputs)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    drawn = get_method(method).capabilities.randomized  # exact kernelized draws nothing
    options = {"num_features": features, "generator": skyformer.random_key(landmark_seed)} \
        if drawn else {}
    out = skyformer.attention(*leaves, method, kernel=kernel, **options)
    return [out, *torch.autograd.grad((out * weights).sum(), leaves)]


def measure(method: str, noise: float, seed: int, args: argparse.Namespace) -> list[dict]:
    """One table row per path and dtype for one method, noise and landmark draw."""
    inputs = clustered(args.n, args.head_dim, args.centres, noise, seed=0,
                       independent_keys=args.independent_keys)
    if args.one_upstream_row:
        weights = inputs[3]
        inputs = (*inputs[:3], weights[..., :1, :].expand_as(weights))
    exact = call(method, inputs, torch.float64, "cpu", "torch", args.features, seed)
    variants = [(kernel, dtype) for kernel in ("torch", "triton")
                for dtype in (torch.float32, torch.bfloat16)]
    if args.rows_one_bf16_pass:  # it changes half-type rows only
        variants.append(("triton+rows-bf16", torch.bfloat16))
    rows = []
    for kernel, dtype in variants:
        with rows_one_bf16_pass(kernel.endswith("+rows-bf16")):
            got = call(method, inputs, dtype, args.device, kernel.removesuffix("+rows-bf16"),
                       args.features, seed)
        errors = [relative_error(a.cpu().reshape(-1, a.shape[-1]),
                                 e.reshape(-1, e.shape[-1]), ord="fro").item()
                  for a, e in zip(got, exact, strict=True)]
        rows.append({"method": method, "noise": noise, "seed": seed, "kernel": kernel,
                     "dtype": str(dtype).removeprefix("torch.")}
                    | dict(zip(("out", "dq", "dk", "dv"), errors, strict=True)))
        print(" ".join(f"{rows[-1][key]}" for key in ("method", "noise", "seed", "kernel",
                                                      "dtype")),
              " ".join(f"{name} {error:.2e}" for name, error
                       in zip(("out", "dq", "dk", "dv"), errors, strict=True)), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["skyformer", "nystrom_softmax"])
    parser.add_argument("--noise", nargs="+", type=float, default=[1.0, 0.1, 0.03, 0.0])
    parser.add_argument("--n", type=positive_int_argument, default=128)
    parser.add_argument("--head-dim", type=positive_int_argument, default=64)
    parser.add_argument("--features", type=positive_int_argument, default=32)
    parser.add_argument("--centres", type=positive_int_argument, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--independent-keys", action="store_true",
                        help="each key around a centre of its own (default: key j around "
                             "query j's centre)")
    parser.add_argument("--rows-one-bf16-pass", action="store_true",
                        help="also bfloat16 on the Triton path with the rows kernel's value "
                             "products in one bfloat16 pass (kernel triton+rows-bf16)")
    parser.add_argument("--one-upstream-row", action="store_true",
                        help="the same upstream gradient row for every output row (default: "
                             "a standard normal row each)")
    parser.add_argument("--landmark-seeds", type=int, nargs="+", default=[3],
                        help="seeds of the landmark draws (each the same for every path)")
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json, OUT.md")
    args = parser.parse_args(argv)
    problem = device_problem("half_gradients.py", args.device)  # every call runs Triton too
    if problem:
        print(problem, file=sys.stderr)
        return 1
    rows = [row for method in args.methods for noise in args.noise
            for seed in args.landmark_seeds for row in measure(method, noise, seed, args)]
    if args.out is not None:
        write_json(args.out.with_suffix(".json"),
                   {**run_metadata(__file__, argv, vars(args), args.device), "rows": rows},
                   indent=1)
        lines = [f"Relative error against float64 (PyTorch path), N = {args.n}, D = "
                 f"{args.head_dim}, m = {args.features}, q and k around {args.centres} "
                 f"centres{' (each key its own)' if args.independent_keys else ''}"
                 f"{', one upstream gradient row' if args.one_upstream_row else ''}, "
                 f"device {args.device}, torch {torch.__version__}", "",
                 "| method | noise | landmark seed | kernel | dtype | out | dq | dk | dv |",
                 "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['noise']} | {r['seed']} | {r['kernel']} | {r['dtype']} | "
                  f"{r['out']:.2e} | {r['dq']:.2e} | {r['dk']:.2e} | {r['dv']:.2e} |"
                  for r in rows]
        atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
