"""Peak memory of a training process and running sums for logged metrics."""

from __future__ import annotations

import sys

import torch

try:
    import resource
except ImportError:  # Windows: the peak working set is read instead
    resource = None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: ``torch.cuda.max_memory_allocated`` since the last reset. CPU: the process's
    maximum resident set size (``getrusage``; on Windows the peak working set), which
    includes the interpreter and the pages of the data files it touched."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if resource is None:
        return _peak_working_set()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


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
