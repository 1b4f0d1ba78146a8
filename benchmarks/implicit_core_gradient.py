"""The implicit gradient of Skyformer's Lemma 3 core against the unrolled one, on MiniLM-L6.

    python benchmarks/implicit_core_gradient.py [--layers 0 1 2 3 4 5]
        [--features 32 64 128 256] [--iterations 6 8 10] [--seq-lens 512 2048]
        [--seeds 0 1] [--clustered-heads 4] [--no-float32]
        [--out benchmarks/results/implicit_core_gradient.md]

The core W = D^-1/2 V_K D^-1/2 holds V_K, K Razavi steps from V_0 = I towards A^-1,
A = D^-1/2 (M + gamma I) D^-1/2 (``linalg/nystrom.py``, ``linalg/pinv.py``). The library
backpropagates through all K steps (the unrolled gradient). The implicit gradient of an
inverse, dA = -V^T G V^T for an incoming gradient G of V, needs two m x m products
instead of about eight a step, but it is the gradient of A^-1, not of the K-step
polynomial the forward pass computes: the two agree only where the iteration has
converged, ||I - A V_K|| small.

This study measures, on Q/K/V of pretrained MiniLM-L6 over the shipped text
(``skyformer.eval.data.qkv``), float64, the PyTorch path (``kernel="torch"``):

- per layer, m and K: the residual ||I - A V_K||_2 over heads and landmark draws
  (median, max) and the range of lambda_min(A), from the very matrices of the calls below;
- the relative Frobenius difference, per head, of dQ, dK and dV of the whole Skyformer
  output under a fixed random output cotangent, between the unrolled gradient and the
  implicit one (``iterative_pinv`` as the core calls it is patched, for this script
  only, with the library's ``implicit_pinv(..., "razavi")``: the same steps, differentiated as
  -V^T G V^T, at the number of steps asked); for scale, the difference between two landmark draws
  (seed s against the next seed in ``--seeds``) and between the unrolled gradient and
  that of the exact inverse (``pinv="exact"``);
- the same calls in float32 (the GPU kernels' precision), unrolled and implicit, against
  the float64 unrolled gradient: where float32 rounding already puts the unrolled one;
- the float64 comparisons again on synthetic clustered inputs (every row of Q and K near
  one point, ``--clustered-heads`` heads at each N), whose lambda_min(A) is close to the
  lower bound gamma / (m + gamma) that any input obeys: how far from the MiniLM figures
  another input can take the residual and the gradients (``residual_bound``).

dV does not depend on the core's backward pass (out = C_qx W C_xk V is linear in V
with W the same forward value), so implicit and unrolled dV are equal bit for bit; the
script checks that, and that the patch changed dQ and dK. Accuracy, not time: runs
anywhere. Writes the markdown tables to ``--out`` and the rows as JSON beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from run_metadata import run_metadata  # benchmarks/, beside this script
from torch import Tensor

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.io import atomic_write_text, write_json
from skyformer.linalg.implicit_inverse import implicit_pinv, residual_bound
from skyformer.linalg.pinv import inverse_residual

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NYSTROM = importlib.import_module("skyformer.linalg.nystrom")  # the module, not a name in it
GRADS = ("dq", "dk", "dv")
CLUSTERED = "clustered"
CLUSTER_SPREAD = 0.1


@contextlib.contextmanager
def implicit_core(record: list[dict] | None = None) -> Iterator[None]:
    """Inside: the Lemma 3 core's iterative inverse differentiated implicitly
    (``linalg.implicit_inverse.implicit_pinv``). Each call appends to ``record`` the
    residual ||I - A V||_2 and lambda_min(A) per matrix (lists over the batch and heads)
    and the iteration count.
    Unlike the option ``pinv_gradient="implicit"``, which raises the steps to the bound's,
    the patch keeps the steps it is given: the study compares the two gradients of one
    forward pass."""

    def pinv(a: Tensor, iterations: int = 6, *, init: str = "scaled_transpose") -> Tensor:
        if init != "identity":
            raise ValueError(f"the study patches the core's inverse from the identity, "
                             f"got init={init!r}")
        v = implicit_pinv(a, iterations, "razavi")  # the steps asked, on any device
        if record is not None:
            with torch.no_grad():
                call = {
                    "iterations": iterations,
                    "residual": inverse_residual(a, v).flatten().tolist(),
                    "lambda_min": torch.linalg.eigvalsh(a)[..., 0].flatten().tolist(),
                    "backward": False,
                }
            record.append(call)
            if v.requires_grad:  # the gradient reached the patched inverse
                v.register_hook(lambda grad: call.__setitem__("backward", True))
        return v

    with mock.patch.object(NYSTROM, "iterative_pinv", pinv):
        yield


def gradients(q: Tensor, k: Tensor, v: Tensor, cotangent: Tensor, *, features: int, seed: int,
              iterations: int = 6, gamma: float = 0.1, pinv: str = "iterative",
              implicit: bool = False, record: list[dict] | None = None) -> tuple[Tensor, ...]:
    """(dQ, dK, dV) of Skyformer's output (PyTorch path) against ``cotangent``, with the
    unrolled gradient of the core, or the implicit one (``implicit``)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    patch = implicit_core(record) if implicit else contextlib.nullcontext()
    with patch:
        out = skyformer.attention(*leaves, "skyformer", num_features=features, gamma=gamma,
                                  pinv=pinv, pinv_iterations=iterations, kernel="torch",
                                  generator=skyformer.random_key(seed))
        return torch.autograd.grad(out, leaves, cotangent)


def per_head_difference(x: Tensor, reference: Tensor) -> list[float]:
    """||x - reference||_F / ||reference||_F for each [N, D] slice of ``[B, H, N, D]``."""
    diff = torch.linalg.vector_norm(x - reference, dim=(-2, -1))
    return (diff / torch.linalg.vector_norm(reference, dim=(-2, -1))).flatten().tolist()


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values)}


def study(q: Tensor, k: Tensor, v: Tensor, cotangent: Tensor, *, features: list[int],
          iterations: list[int], seeds: list[int], gamma: float = 0.1,
          float32: bool = True) -> list[dict]:
    """One row per (m, K) for these float64 inputs ``[B, H, N, D]``: residuals,
    lambda_min(A) and the relative per-head differences of (dQ, dK, dV), implicit vs
    unrolled, unrolled vs exact inverse, implicit vs exact inverse, with two seeds or
    more one draw of landmarks vs the next (unrolled), and with ``float32`` the float32
    unrolled and implicit gradients vs the float64 unrolled one. Raises if the implicit
    patch left dQ or dK unchanged or changed dV."""
    if q.dtype != torch.float64:
        raise ValueError(f"the study compares float64 gradients, got {q.dtype}")
    single = [t.float() for t in (q, k, v, cotangent)]
    rows = []
    for m in features:
        exact = {s: gradients(q, k, v, cotangent, features=m, seed=s, gamma=gamma,
                              pinv="exact") for s in seeds}
        for iters in iterations:
            record: list[dict] = []
            unrolled, implicit, unrolled32, implicit32 = {}, {}, {}, {}
            for s in seeds:
                common = {"features": m, "seed": s, "iterations": iters, "gamma": gamma}
                unrolled[s] = gradients(q, k, v, cotangent, **common)
                before = len(record)
                implicit[s] = gradients(q, k, v, cotangent, implicit=True, record=record,
                                        **common)
                check_patch(unrolled[s], implicit[s], record[before:], iters)
                if float32:
                    unrolled32[s] = gradients(*single, **common)
                    implicit32[s] = gradients(*single, implicit=True, **common)
            row: dict = {"m": m, "iterations": iters, "gamma": gamma, "seeds": list(seeds),
                         "residual": spread([r for c in record for r in c["residual"]]),
                         "lambda_min": {"min": min(x for c in record for x in c["lambda_min"]),
                                        "max": max(x for c in record for x in c["lambda_min"])}}
            pairs = {"implicit_vs_unrolled": [(implicit[s], unrolled[s]) for s in seeds],
                     "unrolled_vs_exact": [(unrolled[s], exact[s]) for s in seeds],
                     "implicit_vs_exact": [(implicit[s], exact[s]) for s in seeds],
                     "draws": [(unrolled[s], unrolled[t]) for s, t in itertools.pairwise(seeds)],
                     "float32_unrolled": [(unrolled32[s], unrolled[s]) for s in unrolled32],
                     "float32_implicit": [(implicit32[s], unrolled[s]) for s in implicit32]}
            for name, compared in pairs.items():
                if compared:
                    row[name] = {g: spread([d for x, ref in compared
                                            for d in per_head_difference(x[i].double(),
                                                                         ref[i])])
                                 for i, g in enumerate(GRADS)}
            rows.append(row)
    return rows


def check_patch(unrolled: tuple[Tensor, ...], implicit: tuple[Tensor, ...], calls: list[dict],
                iterations: int) -> None:
    """The implicit run went through the patched inverse once (``calls``: what it recorded),
    at ``iterations``, and through its backward; dV is the same. (dQ and dK may equal the
    unrolled ones bitwise where the inverse has converged: a draw decides.)"""
    if [c["iterations"] for c in calls] != [iterations]:
        raise RuntimeError("the core did not call the patched iterative_pinv")
    if not all(c.get("backward") for c in calls):
        raise RuntimeError("the implicit patch left dQ and dK unchanged: the gradient never "
                           "reached the patched inverse")
    if not torch.equal(unrolled[2], implicit[2]):
        raise RuntimeError("dV changed: the patch changed the forward pass")


def fmt(x: float) -> str:
    return f"{x:.1e}"


def cell(stats: dict | None, key: str) -> str:
    return "-" if stats is None else f"{fmt(stats[key]['median'])} / {fmt(stats[key]['max'])}"


COMPARISONS = {"implicit_vs_unrolled": "implicit vs unrolled",
               "unrolled_vs_exact": "unrolled vs exact", "implicit_vs_exact": "implicit vs exact",
               "draws": "draw vs draw", "float32_unrolled": "float32 unrolled vs float64",
               "float32_implicit": "float32 implicit vs float64"}


def table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(line) + " |" for line in lines)]


def summary(rows: list[dict], names: list[str], *, residuals: bool = True) -> list[str]:
    """Per (m, K), over every N, layer, head and draw: the largest residual and its bound
    for any input (``residuals``), the largest of each comparison in ``names`` for dQ
    and dK, and the median of draw against draw."""
    lines = []
    for key in sorted({(r["m"], r["iterations"]) for r in rows}):
        group = [r for r in rows if (r["m"], r["iterations"]) == key]
        line = [str(key[0]), str(key[1])]
        if residuals:
            line += [fmt(max(r["residual"]["max"] for r in group)),
                     fmt(residual_bound(key[0], group[0]["gamma"], key[1]))]
        for name in names:
            line += [fmt(max(r[name][g]["max"] for r in group)) for g in ("dq", "dk")]
        if residuals and "draws" in group[0]:
            line += [fmt(statistics.median(r["draws"][g]["median"] for r in group))
                     for g in ("dq", "dk")]
        lines.append(line)
    header = ["m", "K"]
    if residuals:
        header += ["max residual", "bound, any input"]
    for name in names:
        header += [f"{COMPARISONS[name]} {g}, max" for g in ("dQ", "dK")]
    if residuals and "draws" in rows[0]:
        header += [f"draw vs draw {g}, median" for g in ("dQ", "dK")]
    return table(header, lines)


def layer_name(row: dict) -> str:
    return CLUSTERED if row["layer"] is None else str(row["layer"])


def markdown(rows: list[dict]) -> str:
    """Summaries over N and layers (the model's rows, then the clustered ones), then the
    residuals and the gradient differences per (N, layer, m, K)."""
    lines = []
    comparisons = ["implicit_vs_unrolled", "unrolled_vs_exact", "implicit_vs_exact"]
    model = [r for r in rows if r["layer"] is not None]
    clustered = [r for r in rows if r["layer"] is None]
    if model:
        lines += ["Per (m, K) over every N, layer, head and draw: the largest residual "
                  "||I - A V_K||_2, its bound for any input (all landmarks equal), the "
                  "largest relative Frobenius difference of the per-head gradients, and the "
                  "median one between two landmark draws.", "", *summary(model, comparisons)]
        if "float32_unrolled" in model[0]:
            lines += ["", "The same calls in float32, against the float64 unrolled gradient "
                      "(largest over N, layers, heads and draws):", "",
                      *summary(model, ["float32_unrolled", "float32_implicit"],
                               residuals=False)]
    if clustered:
        lines += ["", f"The same for the {CLUSTERED} inputs (every row of Q and K within "
                  f"{CLUSTER_SPREAD} a coordinate of one point: lambda_min(A) near its lower "
                  "bound):", "", *summary(clustered, comparisons)]
    gradient_columns = [("implicit_vs_unrolled", "dq"), ("implicit_vs_unrolled", "dk"),
                        *((c, g) for c in ("unrolled_vs_exact", "draws") for g in GRADS)]
    lines += [
        "", "Residual ||I - A V_K||_2 (median / max over heads and draws) and lambda_min(A):",
        "", *table(["N", "layer", "m", "K", "residual", "lambda_min(A) min .. max"], [
            [str(r["N"]), layer_name(r), str(r["m"]), str(r["iterations"]),
             f"{fmt(r['residual']['median'])} / {fmt(r['residual']['max'])}",
             f"{fmt(r['lambda_min']['min'])} .. {fmt(r['lambda_min']['max'])}"]
            for r in rows]), "",
        "Relative Frobenius difference of the gradients per head, median / max over heads "
        "and draws (implicit vs unrolled dV is 0: checked; the other comparisons are in "
        "the JSON file):", "",
        *table(["N", "layer", "m", "K", *(f"{COMPARISONS[c]} {g[1].upper()}"
                                          for c, g in gradient_columns)], [
            [str(r["N"]), layer_name(r), str(r["m"]), str(r["iterations"]),
             *(cell(r.get(c), g) for c, g in gradient_columns)] for r in rows]),
    ]
    return "\n".join(lines[1:] if lines[0] == "" else lines) + "\n"


def clustered_inputs(n: int, heads: int, head_dim: int, seed: int) -> tuple[Tensor, ...]:
    """Q, K (rows within ``CLUSTER_SPREAD`` a coordinate of one standard normal point per
    head), V and a cotangent, float64 ``[1, heads, n, head_dim]``: near-coinciding
    landmarks, the inputs whose lambda_min(A) is close to gamma / (m + gamma)."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, n, head_dim)
    centre = torch.randn(1, heads, 1, head_dim, dtype=torch.float64, generator=g)
    q, k = (centre + CLUSTER_SPREAD * torch.randn(shape, dtype=torch.float64, generator=g)
            for _ in range(2))
    v, cotangent = (torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v, cotangent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--features", type=positive_int_argument,
                        nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--iterations", type=positive_int_argument, nargs="+", default=[6, 8, 10])
    parser.add_argument("--seq-lens", type=positive_int_argument, nargs="+", default=[512, 2048])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--gamma", type=float, default=0.1)
    parser.add_argument("--clustered-heads", type=int, default=4,
                        help="heads of the clustered inputs at each N (0: none)")
    parser.add_argument("--no-float32", dest="float32", action="store_false",
                        help="skip the float32 calls")
    parser.add_argument("--threads", type=positive_int_argument, default=1,
                        help="torch threads (default 1: on a loaded 2-core machine two "
                             "made LAPACK's eigvalsh and matrix_norm many times slower)")
    parser.add_argument("--out", type=Path, default=RESULTS / "implicit_core_gradient.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from skyformer.eval.data.qkv import extract_qkv, load_model
    from skyformer.eval.data.text import default_text

    model, tokenizer, name = load_model(None, pretrained=True, seed=0)

    def inputs() -> Iterator[tuple[int, int | None, tuple[Tensor, ...]]]:
        for n in args.seq_lens:
            for layer in args.layers:
                qkv = extract_qkv(model, tokenizer, default_text(), seq_len=n, layer=layer,
                                  name=name)
                q, k, v = (t.double() for t in (qkv.q, qkv.k, qkv.v))
                cotangent = torch.randn(v.shape, dtype=v.dtype,
                                        generator=torch.Generator().manual_seed(n + layer))
                yield n, layer, (q, k, v, cotangent)
            if args.clustered_heads:
                yield n, None, clustered_inputs(n, args.clustered_heads, 32, seed=n)

    rows = []
    for n, layer, tensors in inputs():
        for row in study(*tensors, features=args.features, iterations=args.iterations,
                         seeds=args.seeds, gamma=args.gamma,
                         float32=args.float32 and layer is not None):
            rows.append({"N": n, "layer": layer, **row})
            print(f"N={n} layer={layer_name(rows[-1])} m={row['m']} K={row['iterations']}: "
                  f"residual max {row['residual']['max']:.1e}, implicit vs unrolled dQ max "
                  f"{row['implicit_vs_unrolled']['dq']['max']:.1e}", flush=True)
    text = (f"# Implicit vs unrolled gradient of the Lemma 3 core\n\n"
            f"`python benchmarks/implicit_core_gradient.py` (pretrained {name}, the shipped "
            f"text, N = {args.seq_lens}, layers {args.layers}, and {args.clustered_heads} "
            f"heads of clustered inputs, seeds {args.seeds}, "
            f"gamma = {args.gamma}; float64, float32 where marked, PyTorch path, "
            f"torch {torch.__version__}).\n\n"
            + markdown(rows))
    print(text)
    out = args.out.resolve()
    config = vars(args) | {"out": str(out.relative_to(REPO) if out.is_relative_to(REPO) else out)}
    write_json(args.out.with_suffix(".json"),
               {**run_metadata(__file__, argv, config), "rows": rows})
    atomic_write_text(args.out.with_suffix(".md"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
