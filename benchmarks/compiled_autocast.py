"""Gradients under bf16 autocast: eager, and compiled with each of torch's settings for
the backward pass's autocast state (docs/pytorch2.md, "Autocast and torch.compile
together").

For every method, the relative distance of the q, k, v gradients (the largest of the
three) from the float32 call, with the forward under ``torch.autocast("cpu",
bfloat16)`` and ``backward()`` after the block:

- ``eager``: the plain call;
- ``same_as_forward``: ``torch.compile(fullgraph=True, backend="aot_eager")`` with
  ``torch._functorch.config.backward_pass_autocast = "same_as_forward"`` (torch's
  default up to at least 2.13: the backward traced under the forward's autocast);
- ``off``: the same with ``"off"`` (eager's semantics).

``aot_eager`` traces the same backward graph that inductor would compile.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compiled_autocast.py --n 512
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch._functorch.config as functorch_config

import skyformer
from skyformer.checks import method_argument, positive_int_argument

MODES = ("same_as_forward", "off")


def distances(method: str, n: int, d: int, seed: int) -> dict[str, float]:
    """``{"eager": ..., "same_as_forward": ..., "off": ...}`` for ``method``."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=generator).requires_grad_(True)
               for _ in range(3))
    key = skyformer.random_key(seed)

    def call(q, k, v):
        return skyformer.attention(q, k, v, method, generator=key)

    reference = torch.autograd.grad(call(q, k, v).square().sum(), (q, k, v))

    def distance(fn) -> float:
        with torch.autocast("cpu", torch.bfloat16):
            out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        return max(((g.float() - r).norm() / r.norm()).item()
                   for g, r in zip(grads, reference, strict=True))

    result = {"eager": distance(call)}
    for mode in MODES:
        torch._dynamo.reset()
        with functorch_config.patch(backward_pass_autocast=mode), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the library's warning about this very setting
            result[mode] = distance(torch.compile(call, fullgraph=True, backend="aot_eager"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=positive_int_argument,
                        default=512, help="sequence length (default 512)")
    parser.add_argument("--head-dim", type=positive_int_argument,
                        default=32, help="head dim (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="data and key seed (default 0)")
    parser.add_argument("--methods", nargs="+", default=skyformer.list_methods(),
                        type=method_argument,
                        help="methods (default: every registered one)")
    args = parser.parse_args()
    print(f"B = 1, H = 2, N = {args.n}, D = {args.head_dim}, bf16 autocast, default options; "
          f"gradient distance from float32")
    print("| method | eager | compiled, same_as_forward | compiled, off |")
    print("| --- | --- | --- | --- |")
    for method in args.methods:
        row = distances(method, args.n, args.head_dim, args.seed)
        print(f"| {method} | {row['eager']:.4f} | {row['same_as_forward']:.4f} | "
              f"{row['off']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
