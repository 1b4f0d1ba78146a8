"""The device a command or run is asked for: the CPU or a CUDA GPU, checked with a
sentence before any work (the library's paths are built and tested for those two)."""

from __future__ import annotations

import torch

CHOICES = "cpu, cuda or cuda:K"


def parse_device(request: object, *, also: str = "") -> torch.device:
    """``torch.device(request)`` if it is the CPU or a CUDA device this machine has;
    otherwise a ``ValueError`` that names the choices (``also``: further choices the
    caller handles itself, e.g. ``"auto"``, named first in the sentence)."""
    choices = f"{also}, {CHOICES}" if also else CHOICES
    try:
        device = torch.device(request)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be {choices}, got {request!r} (the library runs on "
                         "CPUs and CUDA GPUs).")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {request!r} was asked for but CUDA is not available "
                             "here; use cpu.")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {request!r} was asked for but this machine has "
                             f"{count} CUDA device{'s' if count > 1 else ''} (cuda:0 to "
                             f"cuda:{count - 1}).")
    return device
