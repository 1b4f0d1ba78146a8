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


def forward_mode_active() -> bool:
    """Whether forward-mode AD is running: a dual level is open (``torch.func.jvp``,
    ``jacfwd`` and ``hessian`` open one, as ``forward_ad.dual_level`` does). Asked of
    the level rather than of the tensors: inside ``hessian`` (``jacfwd`` over
    ``jacrev``) the tensors a method sees are wrapped by the inner transform and show
    no tangent, yet the outer one differentiates the call forward. (A level opened with
    no tangent in sight also takes the plain path: same values, more memory.) False while
    compiling or exporting, where no tangents exist."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return forward_ad._current_level >= 0


def functional_ops_only() -> bool:
    """Whether the fast paths must give way to plain operators (module docstring):
    under ``torch.export`` or forward-mode AD."""
    return torch.compiler.is_exporting() or forward_mode_active()
