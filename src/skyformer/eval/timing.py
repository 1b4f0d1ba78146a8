"""Wall-clock timing with warm-up, medians and CUDA synchronisation."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object], *, device: torch.device | str = "cpu", warmup: int = 1,
    repeats: int = 5,
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    return interleaved_median_seconds({"fn": fn}, device=device, warmup=warmup, repeats=repeats)["fn"]


def interleaved_median_seconds(
    fns: Mapping[str, Callable[[], object]], *, device: torch.device | str = "cpu",
    warmup: int = 1, repeats: int = 5,
) -> dict[str, float]:
    """Median wall time of each function, the repeats interleaved.

    Round r runs every function once, so a change in machine load (shared machines)
    hits all of them alike and their ratios stay meaningful.
    """
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
