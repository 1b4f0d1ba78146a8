"""Gaussian kernel blocks, computed stably from dot products and half squared norms.

Skyformer's kernel (eq. (3)): kappa(x, y) = exp(-|x - y|^2 / 2) applied to inputs
already scaled by p^(-1/4), so that C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))).
Expanded, exp(x.y - |x|^2/2 - |y|^2/2): one matrix product plus two rank-one
shifts, never a [N1, N2, D] difference tensor.

Masking: a half norm of ``+inf`` turns that row or column of the block into exact
zeros (exp(-inf) = 0, and its gradient is 0, never NaN).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .eager_calls import untraced_eager
from .flush import flush_exponent_on_cpu, flush_exponent_on_cpu_


def half_sq_norm(x: Tensor) -> Tensor:
    """|x|^2 / 2 over the last dim: ``[..., N, D] -> [..., N]``."""
    return 0.5 * (x * x).sum(dim=-1)


def overwrite_allowed() -> bool:
    """Whether a fresh result of an operator may be written over in place: not under a
    dispatch mode outside compilation. Selective activation checkpointing
    (``torch.utils.checkpoint`` with a ``context_fn``) runs the forward under one and
    keeps the outputs of the operators its policy saves (matrix products, say) to hand
    them back when the backward pass recomputes the forward: written over in place,
    they would come back changed, and the gradients would be wrong."""
    return torch.compiler.is_compiling() or not torch._C._len_torch_dispatch_stack()


def overwrite_in_eager() -> bool:
    """Whether eager code may write over a fresh result in place where tracers and
    transforms take the out-of-place form: ``eager_calls.untraced_eager`` and no dispatch
    mode (``overwrite_allowed``)."""
    return untraced_eager() and overwrite_allowed()


def gaussian_exponent(x1: Tensor, x2: Tensor, half_norm1: Tensor, half_norm2: Tensor) -> Tensor:
    """x1.x2 - |x1|^2/2 - |x2|^2/2, i.e. -|x1 - x2|^2/2: ``[..., N1, N2]``."""
    logits = x1 @ x2.transpose(-1, -2)
    if overwrite_allowed():
        return logits.sub_(half_norm1[..., :, None]).sub_(half_norm2[..., None, :])
    return logits - half_norm1[..., :, None] - half_norm2[..., None, :]


def gaussian_kernel_block(
    x1: Tensor,
    x2: Tensor,
    half_norm1: Tensor | None = None,
    half_norm2: Tensor | None = None,
    *,
    shift_rows: bool = False,
    flush: bool = True,
) -> Tensor:
    """Gaussian kernel block exp(-|x1_i - x2_j|^2 / 2).

    Args:
        x1: ``[..., N1, D]``; x2: ``[..., N2, D]`` (already scaled by p^(-1/4)).
        half_norm1, half_norm2: precomputed ``|x|^2/2`` (``[..., N1]``, ``[..., N2]``),
            ``+inf`` for rows/columns that must be zero.
        shift_rows: divide each row by its largest entry (computed in log space).
            Used where a per-row factor cancels, e.g. a row-normalised output.
        flush: on the CPU, entries below sqrt(tiny) of the dtype are zero (subnormal
            numbers are slow there: ``flush.py``); False keeps every normal entry (only
            those below tiny are zero), as the exact matrices of the analyses must (far
            queries' rows are nothing else).
    Returns:
        ``[..., N1, N2]``.
    """
    if half_norm1 is None:
        half_norm1 = half_sq_norm(x1)
    if half_norm2 is None:
        half_norm2 = half_sq_norm(x2)
    exponent = gaussian_exponent(x1, x2, half_norm1, half_norm2)
    if shift_rows:
        row_max = exponent.detach().amax(dim=-1, keepdim=True)
        # A row with every column masked has max -inf: leave it at exp(-inf) = 0.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        exponent = exponent - row_max
    if not flush:  # only what would be subnormal (slow on CPUs), NaN kept
        if exponent.device.type == "cpu":
            below = exponent < math.log(torch.finfo(exponent.dtype).tiny)
            exponent = exponent.masked_fill_(below, float("-inf")) if overwrite_allowed() \
                else exponent.masked_fill(below, float("-inf"))
        return exponent.exp_() if overwrite_allowed() else exponent.exp()
    # far pairs would give subnormal entries, slow on CPUs (flush.py)
    if overwrite_allowed():
        return flush_exponent_on_cpu_(exponent).exp_()
    return flush_exponent_on_cpu(exponent).exp()


def finite_matrices(x: Tensor) -> Tensor:
    """``x: [..., n, n]`` with every matrix holding a NaN or inf replaced by zeros, so that
    an eigen-solver over a batch does not fail (or return garbage) for all of it
    because of one element; the rows such inputs reach are NaN anyway
    (``registry/guard.py``)."""
    ok = torch.isfinite(x).all(dim=-1, keepdim=True).all(dim=-2, keepdim=True)
    return torch.where(ok, x, 0.0)
