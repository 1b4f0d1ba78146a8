"""Timing with warm-up, medians and CUDA synchronisation.

The clock is wall time by default; ``clock="cpu"`` takes the process's CPU time
instead (all threads), which a loaded shared machine disturbs far less (time slices
given to other processes are not counted): meaningful with one thread, on CPU.

Two orders of the runs: interleaved (round r runs every function once: a drift in the
machine's load hits all alike) and blocked (each function's runs one after another,
after an idle pause: no function's runs change the machine for another's, as a long,
heavy GPU call can for the light call after it, e.g. through the clocks its power
draw lowers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
TIMINGS = ("interleaved", "blocked")  # the orders of the runs (module docstring)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object], *, device: torch.device | str = "cpu", warmup: int = 1,
    repeats: int = 5, clock: str = "wall",
) -> float:
    """Median time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (``clock``: "wall"
    or "cpu", see the module docstring)."""
    return interleaved_median_seconds(
        {"fn": fn}, device=device, warmup=warmup, repeats=repeats, clock=clock
    )["fn"]


def interleaved_median_seconds(
    fns: Mapping[str, Callable[[], object]], *, device: torch.device | str = "cpu",
    warmup: int = 1, repeats: int = 5, clock: str = "wall",
) -> dict[str, float]:
    """Median wall time of each function, the repeats interleaved.

    Round r runs every function once, so a change in machine load (shared machines)
    hits all of them alike and their ratios stay meaningful.
    """
    times = interleaved_seconds(fns, device=device, warmup=warmup, repeats=repeats,
                                clock=clock)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_seconds(
    fns: Mapping[str, Callable[[], object]], *, device: torch.device | str = "cpu",
    warmup: int = 1, repeats: int = 5, clock: str = "wall",
) -> dict[str, list[float]]:
    """Every timed run of each function, as ``interleaved_median_seconds`` takes them."""
    device = torch.device(device)
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}.")
    if clock == "cpu" and device.type == "cuda":
        raise ValueError("clock='cpu' measures host CPU time; time CUDA work with clock='wall'.")
    now = CLOCKS[clock]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            _sync(device)
            times[name].append(now() - start)
    return times


def blocked_median_seconds(
    fns: Mapping[str, Callable[[], object]], *, device: torch.device | str = "cpu",
    warmup: int = 1, repeats: int = 5, pause: float = 0.0, clock: str = "wall",
) -> dict[str, float]:
    """Median time of each function timed in a block of its own: ``pause`` seconds idle
    (the device synchronised), its ``warmup`` runs, then its ``repeats`` runs one after
    another, as a loop of its own calls (a training loop) runs it. The functions' blocks
    follow each other in order (module docstring: when to prefer this to
    ``interleaved_median_seconds``)."""
    device = torch.device(device)
    if not 0 <= pause < float("inf"):
        raise ValueError(f"pause must be a finite number of seconds, at least 0, got {pause}.")
    medians = {}
    for name, fn in fns.items():
        _sync(device)
        time.sleep(pause)
        medians[name] = median_seconds(fn, device=device, warmup=warmup, repeats=repeats,
                                       clock=clock)
    return medians
