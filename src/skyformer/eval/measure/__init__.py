"""Measurement tools: timing, peak memory (in a fresh process on CPU), FLOP counts and
the throughput they are compared with, error metrics."""

from .memory import CallJob, MemoryJob, peak_memory_bytes
from .metrics import relative_error
from .timing import interleaved_median_seconds, median_seconds

__all__ = [
    "CallJob",
    "MemoryJob",
    "interleaved_median_seconds",
    "median_seconds",
    "peak_memory_bytes",
    "relative_error",
]
