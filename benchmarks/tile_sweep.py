"""The timing loop the launch-option sweeps share (``product_tiles.py``,
``flash_tiles.py``): each kernel's candidates checked against the default's results,
timed interleaved, printed, and the fastest of each kernel picked."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from skyformer.eval.measure.timing import interleaved_median_seconds
from skyformer.io import write_json

# A candidate whose output or gradients differ from the default's by more than this
# (relative) is broken: reported, not timed. Above the half types' rounding.
TOLERANCE = 2e-2


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sweep(call: Callable[[str, tuple], Callable[[], list]], reference: list,
          options: dict[str, list[tuple]], defaults: dict[str, tuple],
          label: Callable[[tuple], str], *, shape: str, n: int, device: str, repeats: int
          ) -> tuple[list[dict], dict[str, list]]:
    """(one row per kernel and candidate: the call's ms; the fastest candidate of each
    kernel). ``call(kernel, tiles)`` makes the measured call with that kernel launched
    under ``tiles`` (returning its output and gradients, compared with ``reference``);
    ``options[kernel]`` lists the candidates, its default first."""
    calls = {}
    for kernel, candidates in options.items():
        differ = {}
        for tiles in candidates:
            got = call(kernel, tiles)()
            error = max(relative(a, r) for a, r in zip(got, reference, strict=True))
            if not error <= TOLERANCE:  # NaN too: a tile left unwritten
                print(f"{shape} N={n} {kernel} {label(tiles)}: differs from the default by "
                      f"{error:.2e}", flush=True)
                differ[label(tiles)] = error
                continue
            calls[f"{kernel}/{label(tiles)}"] = call(kernel, tiles)
        if candidates and len(differ) == len(candidates):
            none_left(kernel, differ, f"{shape} N={n}", TOLERANCE)
    times = interleaved_median_seconds(calls, device=device, warmup=2, repeats=repeats)
    rows = []
    for name, seconds in times.items():
        kernel, tiles_label = name.split("/")
        rows.append({"shape": shape, "n": n, "kernel": kernel, "tiles": tiles_label,
                     "ms": seconds * 1e3, "default": tiles_label == label(defaults[kernel])})
    for row in sorted(rows, key=lambda r: (r["kernel"], r["ms"])):
        print(f"{shape:18s} N={n:6d} {row['kernel']:7s} {row['tiles']:34s} {row['ms']:9.3f} ms"
              f"{'  (default)' if row['default'] else ''}", flush=True)
    best = {}
    for kernel, candidates in options.items():
        fastest = min((r for r in rows if r["kernel"] == kernel), key=lambda r: r["ms"])
        best[kernel] = next(list(t) for t in candidates if label(t) == fastest["tiles"])
    return rows, best


def none_left(kernel: str, differ: dict[str, float], where: str, tolerance: float) -> None:
    """Raises the sentence for a kernel whose every candidate (``differ``: label ->
    relative difference), its default among them, is off the default call's results by
    more than ``tolerance`` at ``where`` (the shape swept)."""
    listed = ", ".join(f"{name} by {error:.2e}" for name, error in differ.items())
    raise ValueError(
        f"every launch option of the {kernel} kernel differs from the default call's "
        f"results at {where} by more than {tolerance:g} (relative): {listed}. The "
        "default's own options among them mean the call does not repeat its results on "
        "this device: run the Triton kernels' tests here (SKYFORMER_TEST_CUDA=1 pytest "
        "tests/linalg tests/ops) before a sweep.")


def record(kind: str, rows: list[dict], best: dict, kernels: Iterable[str],
           label: Callable[[tuple], str], out: str | None, on_gpu: bool,
           metadata: dict) -> None:
    """Prints the fastest options of each kernel and writes the sweep's JSON (``kind``
    tells ``tuned.applied`` which sweep wrote it; ``metadata``: the run's settings,
    environment and command, ``run_metadata``) atomically to ``out``."""
    for kernel in kernels:
        print(f"fastest {kernel}: {label(best[kernel])}", flush=True)
    write(out, kind, rows, best, on_gpu, metadata)


def write(out: str | None, kind: str, rows: list[dict], best: dict, on_gpu: bool,
          metadata: dict) -> None:
    """The JSON of a sweep (``record``; ``lemma3_tiles.py`` too) written atomically to
    ``out``, where one is given."""
    if out:
        device_name = torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)"
        write_json(out, {"kind": kind, "device": device_name, **metadata, "rows": rows,
                         "best": best}, indent=1)
        print(f"wrote {out}")
