from __future__ import annotations

import time

import pytest

from skyformer.eval.measure.timing import (
    blocked_median_seconds,
    interleaved_median_seconds,
    median_seconds,
)


def test_cpu_clock_leaves_out_waiting():
    """Sleeping costs wall time but no CPU time of the process."""
    wall = median_seconds(lambda: time.sleep(0.02), repeats=3)
    cpu = median_seconds(lambda: time.sleep(0.02), repeats=3, clock="cpu")
    assert wall >= 0.02 and cpu < 0.01


def _recording(order):
    return {name: (lambda name=name, seconds=seconds: (order.append(name),
                                                       time.sleep(seconds)))
            for name, seconds in (("slow", 0.02), ("fast", 0.002))}


def test_blocked_timing_runs_each_function_alone_after_its_pause():
    """Every run of one function (warm-up first) before the next one's; each median is
    its own function's time; the pause comes before each block and is not timed."""
    order = []
    start = time.perf_counter()
    times = blocked_median_seconds(_recording(order), warmup=1, repeats=3, pause=0.05)
    assert order == ["slow"] * 4 + ["fast"] * 4
    assert time.perf_counter() - start >= 2 * 0.05 + 4 * (0.02 + 0.002)
    assert times["slow"] >= 0.02 and 0.002 <= times["fast"] < times["slow"]
    assert times["slow"] < 0.05 and times["fast"] < 0.05  # the pause is not in them


def test_interleaved_timing_alternates_the_functions():
    order = []
    interleaved_median_seconds(_recording(order), warmup=1, repeats=2)
    assert order == ["slow", "fast"] * 3


def test_blocked_timing_refuses_a_pause_it_cannot_take():
    for pause in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="pause must be a finite number of seconds"):
            blocked_median_seconds({"f": lambda: None}, pause=pause)
