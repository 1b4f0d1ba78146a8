"""When a computation must be written in plain differentiable operators.

The library's fast paths are custom ``autograd.Function``s (chunked products whose
backward rebuilds the block, the Razavi iteration, the multipole near field), Triton
kernels and SDPA's fused kernels. Two callers cannot use them:

- ``torch.export`` traces through a Function's forward, whose ``out=`` writes into
  preallocated buffers cannot be replayed in the exported graph with grad enabled;
- forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``,
  ``torch.autograd.forward_ad``): the Functions have a hand-written backward only, and
  SDPA's fused kernels (flash, memory-efficient, the CPU flash kernel) have no
  forward-mode derivative.

There the same computation runs as functional operators that autograd differentiates in
both modes (the block formed whole, as a naive reference would), giving the same values
up to rounding. Reverse-mode training, ``torch.compile`` and ``vmap`` keep the fast paths.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor


def carries_tangent(*tensors: Tensor | None) -> bool:
    """Whether any tensor carries a forward-mode tangent (a dual tensor of
    ``torch.autograd.forward_ad``, or an input of ``torch.func.jvp`` / ``jacfwd`` or
    anything computed from one). ``None`` entries are skipped; always False while
    compiling or exporting, where no tangents exist."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None
               for t in tensors)


def functional_ops_only(*tensors: Tensor | None) -> bool:
    """Whether the fast paths must give way to plain operators (module docstring):
    under ``torch.export``, or when any of ``tensors`` carries a tangent."""
    return torch.compiler.is_exporting() or carries_tangent(*tensors)
