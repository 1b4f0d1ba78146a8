"""What a result depends on besides its config: the versions, threads and device."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from ..versions import triton_version


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a result depends on besides its config: versions (Triton's where it can be
    imported), threads, device name."""
    device = torch.device(device or "cpu")
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    triton = triton_version()  # the Triton kernels' results and speed depend on it
    if triton is not None:
        info["triton"] = triton
    import skyformer  # the code that ran, not an installed copy's metadata

    info["skyformer"] = skyformer.__version__
    return info
