"""The implicit core's scaled Newton chain against Razavi's steps, on CUDA, in one run.

``pinv_gradient="implicit"`` runs the Lemma 3 forward kernel as scaled Newton steps,
paired (``linalg.triton_lemma3.chains``, ``linalg/newton_inverse.py``: one dependent
pass a step, 16 products of two m x m matrices at m = 128, against Razavi's ordinary
chain, four passes and four products a step). This times C(X, X) and its inverse,
forward + backward, for float32 landmark rows ``[1, B x H, m, 64]``, with the chain on
and off (the choice patched; at m = 128 in float32 Lemma 3's bound asks 9 steps of
either), eagerly and replayed from a CUDA graph (``torch.cuda.make_graphed_callables``
inside ``skyformer.cuda_graph_launches()``: a launch per pass), interleaved, medians.

    python benchmarks/paired_steps.py [--out FILE.txt]

``--out FILE.txt`` writes the times there and FILE.json beside (the times, every
setting, the environment and the command).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from run_metadata import run_metadata, write_report  # benchmarks/, beside this script

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.linalg import half_sq_norm, landmark_inverse


@contextlib.contextmanager
def paired(on: bool) -> Iterator[None]:
    """Inside: the implicit forward kernel runs the Newton chain (``on``) or Razavi's
    steps."""
    from skyformer.linalg import triton_lemma3

    with mock.patch.object(triton_lemma3, "chains", lambda k, implicit: on and implicit):
        yield


def calls(matrices: int, m: int) -> dict[str, Callable[[], None]]:
    """Forward + backward of the implicit core, by either chain, eager and graphed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (0.15 * torch.randn(1, matrices, m, 64, device="cuda", generator=g)).requires_grad_()
    grad = torch.randn(1, matrices, m, m, device="cuda", generator=g)

    def core(t: torch.Tensor) -> torch.Tensor:
        return landmark_inverse(t, half_sq_norm(t), gamma=0.1, kernel="triton",
                                gradient="implicit")

    out: dict[str, Callable[[], None]] = {}
    for on in (True, False):
        with paired(on), skyformer.cuda_graph_launches():
            graphed = torch.cuda.make_graphed_callables(core, (x,))

        def replay(graphed: Callable = graphed) -> None:
            x.grad = None
            graphed(x).backward(grad)

        def eager(on: bool = on) -> None:
            with paired(on):
                x.grad = None
                core(x).backward(grad)

        name = "newton" if on else "razavi"
        out[f"B x H = {matrices}, graphed, {name}"] = replay
        out[f"B x H = {matrices}, eager, {name}"] = eager
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", type=positive_int_argument, nargs="+", default=[64, 2],
                        help="B x H (default: the model shape's and the LRA shape's)")
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--repeats", type=positive_int_argument, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("paired_steps.py times CUDA graphs: run it on a machine with a GPU.",
              file=sys.stderr)
        return 2
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, m = "
             f"{args.features}: implicit core forward + backward, medians of "
             f"{args.repeats} interleaved rounds"]
    rows = []
    for matrices in args.matrices:
        times = interleaved_median_seconds(calls(matrices, args.features), device="cuda",
                                           warmup=3, repeats=args.repeats)
        lines += [f"{name:36s} {t * 1e3:8.3f} ms" for name, t in times.items()]
        rows += [{"matrices": matrices, "call": name, "ms": t * 1e3}
                 for name, t in times.items()]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        write_report(args.out, text, run_metadata(__file__, argv, vars(args), "cuda"),
                     rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
