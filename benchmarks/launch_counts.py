"""Operations an eager call dispatches (each a kernel launch on a GPU), counted on the CPU.

Forward + backward of Skyformer, ``nystrom_softmax`` and ``skyformer_adaptive`` with the
products and landmark draws on Triton (run through Triton's interpreter here), once
with the m x m core on the PyTorch path and once as the library chooses it: the
one-launch Triton kernels (``linalg/lemma3_triton.py``), forward and backward, up to
``MAX_M`` landmarks.
Counted with a dispatch mode: views, allocations and copies are left out, and so is
the CPU-only subnormal flush; the check for non-finite inputs (``registry/guard.py``)
is counted as a CUDA call runs it (on the CPU an eager call first asks whether the
inputs are finite at all and skips it).
Raw Triton launches are not dispatched operations: the draws add one launch per side
(one for both sides of an unpadded call whose queries and keys have one length, as
here), the core one per pass, and Skyformer's eager backward pass one for its landmark
rows' gradient (``linalg/landmark_rows.py``).

    python benchmarks/launch_counts.py [--out FILE.md]

``--out FILE.md`` writes the table there and FILE.json beside (the counts, every
setting, the environment and the command).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a script, before Triton is imported; an import
    # (gpu_kernels.py on a GPU) must not turn the interpreter on for its importer
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path

import argparse
import collections
import contextlib
import importlib
import sys
from unittest import mock

import torch
from kernel_flags import composed  # benchmarks/, beside this script
from run_metadata import run_metadata, write_report
from torch.utils._python_dispatch import TorchDispatchMode

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.linalg import kernels, nystrom
from skyformer.linalg import pinv as pinv_module
from skyformer.registry import guard

NOT_LAUNCHES = {"set_", "empty", "new_empty", "empty_like", "empty_strided", "copy_", "view",
                "slice", "unsqueeze", "transpose", "select", "expand", "detach", "unbind",
                "t", "permute", "_unsafe_view", "alias", "as_strided", "squeeze", "reshape",
                "lift_fresh", "promote_types", "split", "split_with_sizes"}
CPU_ONLY = {"hardshrink", "hardshrink_backward", "threshold", "threshold_", "threshold_backward"}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_LAUNCHES | CPU_ONLY:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_on_cuda():
    """A context in which a CPU call makes the operations a CUDA call makes: the
    non-finite check runs as on CUDA (an eager CPU call first asks whether the inputs
    are finite at all and skips it), and the CPU-only safeguards are off
    (``nystrom_softmax``'s float64 check, the Lemma 3 backward's power-of-two scaling;
    the flushes are ``CPU_ONLY`` operators)."""
    nystrom_softmax = importlib.import_module("skyformer.ops.nystrom_softmax.nystrom_softmax")
    with mock.patch.object(guard, "may_read_values", lambda *_: False), \
            mock.patch.object(nystrom_softmax, "may_read_values", lambda *_: False), \
            mock.patch.object(pinv_module, "scales_gradient", lambda *_: False):
        yield


class guard_passes:
    """Inside (``on``): Skyformer's calls leave the non-finite marks to the guard's own
    passes over q, k, v and the output (``registry/guard.py``), as before the product
    kernels made them (``marks_in_products``); for an A/B in one run."""

    def __init__(self, on: bool):
        from skyformer.registry import autocast

        module = importlib.import_module("skyformer.ops.skyformer.skyformer")
        self.on, self.patches = on, ((autocast, "marked_by_core"),
                                     (module, "marks_in_products"))

    def __enter__(self):
        self.before = [getattr(owner, name) for owner, name in self.patches]
        if self.on:
            for owner, name in self.patches:
                setattr(owner, name, lambda *_: False)

    def __exit__(self, *exc):
        for (owner, name), value in zip(self.patches, self.before, strict=True):
            setattr(owner, name, value)


def count(method: str, b: int, h: int, n: int, d: int, m: int) -> int:
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    key = skyformer.random_key(0)  # made once by the caller, outside the count
    # the in-place writes an eager call makes (under a dispatch mode, such as this
    # count's, the Gaussian blocks are formed out of place: kernels.overwrite_allowed)
    with as_on_cuda(), mock.patch.object(kernels, "overwrite_allowed", lambda: True), \
            _Count() as counter:
        out = skyformer.attention(q, k, v, method, num_features=m, kernel="triton",
                                  generator=key)
        out.sum().backward()
    return sum(counter.ops.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=shape_argument("B,H,N,D"), default="1,2,256,64",
                        help="the counts do not depend on B and H")
    parser.add_argument("--features", type=positive_int_argument, nargs="+", default=[64, 128])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    b, h, n, d = args.shape
    lines = [f"B={b}, H={h}, N={n}, D={d}, forward + backward", "",
             "| | m | PyTorch core | as chosen |", "|---|---|---|---|"]
    rows = []
    for method in ("skyformer", "nystrom_softmax", "skyformer_adaptive"):
        for m in args.features:
            # the PyTorch core: Skyformer composed of its Functions (its two nodes take
            # the core's kernels)
            with mock.patch.object(nystrom, "fused_lemma3_applies", lambda *_: False), \
                    composed(True):
                pytorch_core = count(method, b, h, n, d, m)
            chosen = count(method, b, h, n, d, m)
            lines.append(f"| `{method}` | {m} | {pytorch_core} | {chosen} |")
            rows.append({"method": method, "m": m, "pytorch_core": pytorch_core,
                         "as_chosen": chosen})
    emit(lines, args.out, run_metadata(__file__, argv, vars(args)), rows)
    return 0


def emit(lines: list[str], out: str | None, metadata: dict, rows: list[dict]) -> None:
    """Prints a report's lines and, if ``out`` is given, writes them there with a JSON of
    ``metadata`` (``run_metadata``) and ``rows`` beside (``write_report``)."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out:
        write_report(out, text, metadata, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
