"""Tiles of the fused Lemma 3 kernels, timed on the GPU: which launch options are fastest.

``triton_lemma3.launch_options(m, backward, graphed)`` picks the row block
(``ROWS``), the inner chunk (``KC``), the warps, the pipeline stages of each Lemma 3
kernel and whether the chain runs in one program per matrix or as a launch per pass
(``PER_PASS``: a program per block of rows, more programs for more launches). This
script times ``landmark_inverse`` (the landmark block and its Lemma 3 inverse) for
B x H matrices of m landmark rows, interleaved, against the PyTorch core: the forward
kernel under each candidate (forward alone), and the backward kernel under each
candidate (forward + backward, the forward kernel at its default), each called eagerly
and, on CUDA, replayed from a CUDA graph (where launches cost the host nothing). Every
candidate must give the default's W and gradient. The fastest forward and backward
options per m and mode go to the JSON's ``best`` (``forward``, ``backward``,
``forward_graphed``, ``backward_graphed``), which ``applied`` (``gpu_kernels.py
--tiles``, ``gpu_profile.py --tiles``) launches in place of ``launch_options``, the
graphed ones inside ``skyformer.cuda_graph_launches()`` (``graphed_options``, which
those scripts enter around their CUDA-graph calls): what the library would do with them
as its defaults.

    python benchmarks/lemma3_tiles.py --out benchmarks/results/lemma3_tiles.json

A backward candidate with ``,keep`` has the forward kernel keep the step products for
the backward kernel (``KEEP_PRODUCTS``, ``triton_lemma3.keeps_products``): fewer
products in the backward pass for more memory held between the passes, which each
row reports (``stored MiB``: iterates and kept products, ``store_slots``).

The default candidates (``ROWS,KC,WARPS,STAGES``, ``,pass`` for a launch per pass) are
those that compile for sm_90 at m = 128 with few or no spills in both kernels
(``triton_resources.py``; the pass kernels at 16 rows with 2 or 4 warps and at 32 rows
with 8 warps spill nothing) and were not clearly slower on the H200
(``results/gpu_h200/lemma3_tiles_h200.txt``: the 64-row blocks, where Hopper's warpgroup
MMA applies, and 16 warps took 1.05-1.45x the default's time; ``SWEPT`` holds them all,
for ``--options``), so that the stage costs a lent device little time.
``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same script to check it without
a GPU, at one tiny size, eager only: its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import torch
from gpu_device import device_problem  # benchmarks/, beside this script
from run_metadata import run_metadata
from tile_sweep import none_left, relative, write

import skyformer
from skyformer.checks import positive_int_argument, shape_argument
from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.linalg import (  # the triton_* modules import Triton
    half_sq_norm,
    landmark_inverse,
    triton_lemma3,
    triton_lemma3_backward,
)

SWEPT = ("32,16,8,1", "32,16,16,1", "64,16,8,1", "64,16,4,1", "64,32,8,1", "64,16,8,2",
         "128,16,8,1")  # the one-program options timed on the H200
CANDIDATES = ("32,16,8,1", "128,16,8,1", "16,16,4,1,pass", "32,32,8,1,pass",
              "32,32,8,1,pass,keep")
# An option whose inverse or gradient differs from the default's by more than this
# (relative) is broken: reported, not timed. The kernels compute in float32.
TOLERANCE = 1e-4


def candidates(m: int, specs: list[str], backward: bool, family: str = "default"
               ) -> list[dict]:
    """The launch options to try at m landmarks (``ROWS,KC,WARPS,STAGES`` specs, ``,pass``
    for a launch per pass and, backward, ``,keep`` for kept step products; tiles within
    the padded matrix), the default first (the library's for a GPU of ``family``), then
    (backward) the default keeping them."""
    default = triton_lemma3.launch_options(m, backward=backward, family=family)
    block = default["BLOCK"]
    found = [default, {**default, "KEEP_PRODUCTS": True}] if backward else [default]
    for spec in specs:
        fields = spec.split(",")
        rows, kc, warps, stages = map(int, fields[:4])
        option = {"BLOCK": block, "ROWS": rows, "KC": kc, "num_warps": warps,
                  "num_stages": stages, "PER_PASS": "pass" in fields[4:]}
        if backward:
            option["KEEP_PRODUCTS"] = "keep" in fields[4:]
        elif "keep" in fields[4:]:
            continue  # the backward options decide what the forward keeps
        if max(rows, kc) <= block and option not in found:
            found.append(option)
    return found


def _label(option: dict) -> str:
    return f"rows {option['ROWS']} kc {option['KC']} warps {option['num_warps']} " \
           f"stages {option['num_stages']}{' per pass' if option.get('PER_PASS') else ''}" \
           f"{' keep' if option.get('KEEP_PRODUCTS') else ''}"


def stored_mib(batch: int, heads: int, m: int, option: dict, iterations: int = 6) -> float:
    """MiB the forward kernel stores for the backward pass under ``option`` (float32)."""
    slots = triton_lemma3.store_slots(iterations, bool(option.get("KEEP_PRODUCTS")))
    return batch * heads * slots * m * m * 4 / 2**20


def graphed_options():
    """Launches inside take the graphed options (``best``'s ``*_graphed``, else the
    library's, ``skyformer.cuda_graph_launches``), the warm-up before a capture too: a
    kernel launched first during a capture would be compiled and loaded there, which
    CUDA refuses."""
    return skyformer.cuda_graph_launches()


def graphed(step):
    """``step`` captured once in a CUDA graph (after a warm-up on a side stream, as
    capture requires, both under ``graphed_options``): (a function that replays it,
    the graph's outputs). The launch options in force at capture are the ones
    replayed."""
    with graphed_options():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
    return graph.replay, outputs


def measure(batch: int, heads: int, m: int, head_dim: int, specs: list[str], device: str,
            repeats: int) -> tuple[list[dict], dict]:
    """(one row per kernel, launch option, pass and mode (eager, and on CUDA replayed
    from a CUDA graph), and the PyTorch core: ms; the fastest option of each kernel and
    mode ``{"forward": ..., "backward": ..., "forward_graphed": ...,
    "backward_graphed": ...}``)."""
    g = torch.Generator(device=device).manual_seed(m)
    x = (0.15 * torch.randn(batch, heads, m, head_dim, device=device, generator=g)
         ).requires_grad_(True)
    grad = torch.randn(batch, heads, m, m, device=device, generator=g)

    def call(kernel: str, forward: dict | None, backward: dict | None, with_grad: bool):
        def step():
            if with_grad:
                w = landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel)
                (dx,) = torch.autograd.grad(w, x, grad)
                return w.detach(), dx
            with torch.no_grad():
                return landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel), None

        def run():
            with _options({m: {"forward": forward, "backward": backward}}):
                return step()

        def run_graphed():  # captured under the options, replayed without them
            with _options({m: {"forward": forward, "backward": backward}}):
                return graphed(step)
        return run, run_graphed

    family = triton_lemma3.device_family(torch.device(device))
    fwd_options = candidates(m, specs, backward=False, family=family)
    bwd_options = candidates(m, specs, backward=True, family=family)
    reference_w, reference_grad = call("triton", None, None, True)[0]()
    modes = ("eager", "graph") if device == "cuda" else ("eager",)
    calls = {}
    for what, with_grad in (("fwd", False), ("fwd+bwd", True)):
        run, run_graphed = call("torch", None, None, with_grad)
        calls[f"torch/-/{what}/eager"] = run
        if "graph" in modes:
            calls[f"torch/-/{what}/graph"] = run_graphed()[0]
    for kernel, options in (("forward", fwd_options), ("backward", bwd_options)):
        differ: dict[str, dict[str, float]] = {mode: {} for mode in modes}
        for option in options:
            forward, backward = (option, None) if kernel == "forward" else (None, option)
            run, run_graphed = call("triton", forward, backward, kernel == "backward")
            w, dx = call("triton", forward, backward, True)[0]()
            error = max(relative(w, reference_w), relative(dx, reference_grad))
            if not error <= TOLERANCE:  # a broken option (NaN too): report it, do not time it
                print(f"m={m} {kernel} {_label(option)}: differs from the default by "
                      f"{error:.2e}", flush=True)
                for mode in modes:
                    differ[mode][_label(option)] = error
                continue
            what = "fwd" if kernel == "forward" else "fwd+bwd"
            calls[f"{_label(option)}/{kernel}/{what}/eager"] = run
            if "graph" in modes:
                replay, (w, dx) = run_graphed()
                replay()
                error = relative(w, reference_w) if dx is None else max(
                    relative(w, reference_w), relative(dx, reference_grad))
                if not error <= TOLERANCE:
                    print(f"m={m} {kernel} {_label(option)}: replayed from a CUDA graph, "
                          f"differs from the default by {error:.2e}", flush=True)
                    differ["graph"][_label(option)] = error
                    continue
                calls[f"{_label(option)}/{kernel}/{what}/graph"] = replay
        for mode, off in differ.items():
            if options and len(off) == len(options):
                none_left(kernel, off, f"m={m} ({mode})", TOLERANCE)
    times = interleaved_median_seconds(calls, device=device, warmup=2, repeats=repeats)
    rows = []
    for name, seconds in times.items():
        label, kernel, what, mode = name.split("/")
        options = fwd_options if kernel == "forward" else bwd_options
        option = next((o for o in options if _label(o) == label), {})
        rows.append({"shape": f"{batch},{heads},m={m},D={head_dim}", "options": label,
                     "kernel": kernel, "pass": what, "mode": mode, "ms": seconds * 1e3,
                     "vs_torch": times[f"torch/-/{what}/{mode}"] / seconds,
                     "stored_mib": stored_mib(batch, heads, m, option) if option else None,
                     "default": label == _label(options[0])})
    for row in sorted(rows, key=lambda r: (r["mode"], r["pass"], r["ms"])):
        stored = "" if row["stored_mib"] is None else f"  stored {row['stored_mib']:.1f} MiB"
        print(f"{row['shape']:22s} {row['mode']:5s} {row['kernel']:8s} {row['pass']:8s} "
              f"{row['options']:50s} {row['ms']:9.3f} ms {row['vs_torch']:6.2f}x torch"
              f"{stored}{'  (default)' if row['default'] else ''}", flush=True)
    best = {}
    for kernel, options in (("forward", fwd_options), ("backward", bwd_options)):
        for mode in modes:
            timed = [r for r in rows if r["kernel"] == kernel and r["mode"] == mode]
            fastest = min(timed, key=lambda r: r["ms"])["options"]
            key = kernel if mode == "eager" else f"{kernel}_graphed"
            best[key] = next(o for o in options if _label(o) == fastest)
    return rows, best



@contextlib.contextmanager
def _options(table: dict):
    """Both kernels launched with the options of ``table`` ``{m: {"forward": option,
    "backward": option}}`` (an absent m or a None option: as the library chooses), and
    inside ``graphed_options`` with its ``"forward_graphed"`` and ``"backward_graphed"``
    options if it has them."""
    default = triton_lemma3.launch_options

    def chosen(m: int, backward: bool = False, graphed: bool = False,
               family: str = "default") -> dict:
        kernel = "backward" if backward else "forward"
        entry = table.get(m, {})
        option = (entry.get(f"{kernel}_graphed") if graphed else None) or entry.get(kernel)
        return dict(option) if option else default(m, backward, graphed, family)

    with mock.patch.object(triton_lemma3, "launch_options", chosen), \
            mock.patch.object(triton_lemma3_backward, "launch_options", chosen):
        yield


@contextlib.contextmanager
def applied(best: dict):
    """The fastest options a run of this script recorded (its JSON's ``best``, ``{m:
    {"forward": option, "backward": option}}``) in place of ``launch_options``, for the
    landmark counts it measured."""
    table = {int(m): options for m, options in best.items()}
    for m, options in sorted(table.items()):
        print(f"Lemma 3 launch options at m = {m}: "
              + ", ".join(f"{key} {_label(option)}" for key, option in options.items()),
              flush=True)
    with _options(table):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", default=None, type=shape_argument("B,H"),
                        help="B,H (default 4,16 on CUDA, 1,1 on CPU)")
    parser.add_argument("--features", type=positive_int_argument, nargs="+", default=None,
                        help="numbers of landmarks m (default 128 on CUDA, 16 on CPU)")
    parser.add_argument("--head-dim", type=positive_int_argument, default=64)
    parser.add_argument("--options", nargs="+", default=list(CANDIDATES),
                        help="candidates ROWS,KC,WARPS,STAGES besides the default (each "
                             "compiles a kernel: a few seconds)")
    parser.add_argument("--repeats", type=positive_int_argument, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    problem = device_problem("lemma3_tiles.py", args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    batch, heads = args.shape or ((4, 16) if on_gpu else (1, 1))
    features = args.features or ([128] if on_gpu else [16])
    repeats = args.repeats or (10 if on_gpu else 1)
    rows, best = [], {}
    for m in features:
        found, best[m] = measure(batch, heads, m, args.head_dim, args.options, args.device,
                                 repeats)
        rows += found
        for kernel, option in best[m].items():
            print(f"m={m} fastest {kernel}: {_label(option)}", flush=True)
    config = vars(args) | {"shape": f"{batch},{heads}", "features": features,
                           "repeats": repeats}
    write(args.out, "lemma3", rows, best, on_gpu,
          run_metadata(__file__, argv, config, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
