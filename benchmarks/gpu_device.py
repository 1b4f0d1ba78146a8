"""The device check of the GPU benchmarks that can also run on the CPU through Triton's
interpreter (``gpu_kernels.py``, ``lemma3_tiles.py``, ``product_tiles.py``,
``gpu_profile.py``, ``gpu_host_split.py``)."""

from __future__ import annotations

import torch

from skyformer.linalg.kernel_backend import interpreter_on


def device_problem(script: str, device: str) -> str | None:
    """Why ``script`` cannot run on ``device`` ("cuda", "cuda:1" or "cpu") here, as a
    sentence with the fix; None where it can."""
    device = torch.device(device).type
    if device == "cuda" and not torch.cuda.is_available():
        return (f"{script} needs a CUDA device (--device cpu with TRITON_INTERPRET=1 checks "
                "the script without one).")
    if device == "cpu" and not interpreter_on():
        return ("--device cpu runs the Triton kernels under Triton's interpreter: set "
                "TRITON_INTERPRET=1 before Python starts.")
    return None
