from __future__ import annotations

import time

from skyformer.eval.measure.timing import median_seconds


def test_cpu_clock_leaves_out_waiting():
    """Sleeping costs wall time but no CPU time of the process."""
    wall = median_seconds(lambda: time.sleep(0.02), repeats=3)
    cpu = median_seconds(lambda: time.sleep(0.02), repeats=3, clock="cpu")
    assert wall >= 0.02 and cpu < 0.01
