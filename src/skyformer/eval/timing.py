"""Timing with warm-up, medians and CUDA synchronisation (wall clock by default)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object], *, device: torch.device | str = "cpu", warmup: int = 1,
    repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median time of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    ``clock``: ``time.perf_counter`` (wall time) or e.g. ``time.process_time`` (CPU time
    of this process: on a shared CPU it leaves out the time spent waiting for a core).
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        _sync(device)
        times.append(clock() - start)
    return statistics.median(times)
