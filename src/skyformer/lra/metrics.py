"""Peak memory of a training process and running sums for logged metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

try:
    import resource
except ImportError:  # Windows: the peak working set is read instead
    resource = None


# Linux: writing "5" here resets the kernel's peak resident size (VmHWM of
# /proc/self/status) to the current resident size
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


_cpu_reset = {"done": False}  # whether the last CPU reset_peak_memory took effect


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's counter, or on Linux the process's peak resident size
    (elsewhere a CPU's peak stays the process's since it started)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    if not sys.platform.startswith("linux"):  # macOS and Windows keep no such counter
        _cpu_reset["done"] = False
        return
    try:
        _CLEAR_REFS.write_text("5")
        _cpu_reset["done"] = _resident_peak() is not None
    except OSError:
        _cpu_reset["done"] = False


def cpu_peak_resets() -> bool:
    """Whether the last CPU ``reset_peak_memory`` started a new peak (Linux
    ``clear_refs`` written, ``VmHWM`` read): where not, a CPU peak is the whole
    process's, earlier runs of the same process included (``lra train --seeds``)."""
    return _cpu_reset["done"]


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: ``torch.cuda.max_memory_allocated`` since the last reset. CPU: the process's
    peak resident size since the last reset on Linux (``VmHWM``), its maximum resident
    set size elsewhere (``getrusage``; on Windows the peak working set); both include the
    interpreter and the pages of the data files it touched."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _resident_peak() if sys.platform.startswith("linux") else None
    if peak is not None:
        return peak
    if resource is None:
        return _peak_working_set()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def _resident_peak() -> int | None:
    """Linux's peak resident size in bytes (``VmHWM``), or None where it cannot be read."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _peak_working_set() -> int:
    """Windows' maximum resident set size: the process's peak working set in bytes
    (psutil, installed with skyformer on Windows)."""
    import psutil

    return int(psutil.Process().memory_info().peak_wset)


class Running:
    """Sums of loss, correct predictions and examples, kept on the device (no sync per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        self.sums[0] += loss_sum.detach().double()
        self.sums[1] += correct.double()
        self.sums[2] += count

    def reset(self) -> None:
        self.sums.zero_()
