"""The causal Nystrom features phi = L^-1 C(X_S, y): one product against the block, timed.

Causal Skyformer (``ops/skyformer/causal.py``) and ``nystrom_softmax``
(``ops/nystrom_softmax/causal.py``, its keys' rows shifted by constants) compute phi for
the queries and the keys as one Gaussian product C(y, X_S) (L^-1)^T each
(``causal_nystrom.gaussian_features``, ``linalg.gaussian_kernel_matmul``: the ``[N, m]``
block C is not held for the backward pass past one chunk of rows, which rebuilds it; on
CUDA the fused Triton kernels). Before, they formed C as a block and multiplied it by
(L^-1)^T (``nystrom_features``), and autograd kept the block's exponent and exponential.
This times a causal forward + backward of each method with each (the block path patched
in), interleaved, and sums the bytes of the tensors each keeps for its backward pass
(``torch.autograd.graph.saved_tensors_hooks``, each storage once).

    python benchmarks/causal_features.py [--methods skyformer nystrom_softmax]
                                         [--seq-lens 4096 16384] [--out FILE.md]

``--out FILE.md`` writes the table there and FILE.json beside.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from unittest import mock

import torch
from run_metadata import run_metadata, write_report  # benchmarks/, beside this script

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.io import check_output_path
from skyformer.linalg import half_sq_norm
from skyformer.linalg.flush import flush_exponent_on_cpu_
from skyformer.ops.nystrom_softmax import causal as causal_nystrom_softmax
from skyformer.ops.shared.causal_nystrom import nystrom_features
from skyformer.ops.skyformer import causal as causal_skyformer

PATHS = ("product", "block")
METHODS = {"skyformer": causal_skyformer, "nystrom_softmax": causal_nystrom_softmax}


def block_features(y, core, *, row_valid=None, row_offset=None, row_norm=True,
                   kernel="auto"):
    """phi as the Gaussian block, formed whole, times (L^-1)^T (the earlier path)."""
    e = y @ core.x.transpose(-1, -2) - core.x_norm[..., None, :]
    if row_norm:
        e = e - half_sq_norm(y)[..., None]
    if row_offset is not None:
        e = e - row_offset[..., None]
    if row_valid is not None:
        e = torch.where(row_valid[:, None, :, None], e, float("-inf"))
    return nystrom_features(flush_exponent_on_cpu_(e).exp(), core)


@contextlib.contextmanager
def features(path: str) -> Iterator[None]:
    """Inside: the causal Nystrom methods compute their features by ``path``
    (``PATHS``)."""
    if path == "product":
        yield
        return
    with contextlib.ExitStack() as stack:
        for module in METHODS.values():
            stack.enter_context(mock.patch.object(module, "gaussian_features",
                                                  block_features))
        yield


def saved_bytes(fn) -> int:
    """Bytes of the tensors that ``fn()``'s autograd graph keeps, each storage once."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def measure(method: str, b: int, h: int, n: int, d: int, m: int, repeats: int
            ) -> list[dict]:
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    key = skyformer.random_key(0)

    def forward():
        return skyformer.attention(q, k, v, method, causal=True, num_features=m,
                                   generator=key)

    def call(path):
        def run():
            with features(path):
                forward().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return run

    times = interleaved_median_seconds({path: call(path) for path in PATHS}, warmup=2,
                                       repeats=repeats)
    rows = []
    for path in PATHS:
        with features(path):
            kept = saved_bytes(forward)
        rows.append({"method": method, "n": n, "features": path, "ms": times[path] * 1e3,
                     "saved_mib": kept / 2**20})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--shape", default="1,2,64", help="B,H,D")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument,
                        default=[4096, 16384])
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--repeats", type=positive_int_argument, default=9)
    parser.add_argument("--threads", type=positive_int_argument, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        b, h, d = map(positive_int_argument, args.shape.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"argument --shape: B,H,D, three positive integers (e.g. 1,2,64), got "
                     f"{args.shape!r}")
    check_output_path(args.out)  # before the measurements, not after them
    rows = []
    for method in args.methods:
        for n in args.seq_lens:
            rows += measure(method, b, h, n, d, args.features, args.repeats)
    lines = [f"Causal attention, B,H,D = {args.shape}, m = {args.features}, forward + "
             f"backward on the CPU ({torch.get_num_threads()} threads), medians of "
             f"{args.repeats} interleaved calls, torch {torch.__version__}", "",
             "| method | N | features | ms | saved for the backward pass, MiB |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['n']} | {r['features']} | {r['ms']:.1f} | "
              f"{r['saved_mib']:.1f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, text, run_metadata(__file__, argv, vars(args), "cpu"),
                     rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
