"""Iterative (matrix-product) pseudo-inverse, shared by every Nystrom-type method.

Razavi et al. (2014), "A new iterative method for finding approximate inverses of
complex matrices", the iteration used by Nystromformer and Skyformer:

    V_{k+1} = 1/4 V_k (13 I - A V_k (15 I - A V_k (7 I - A V_k)))

It converges (to A^+) when ||I - A V_0|| < 1. Two starting points are offered,
both computed *per matrix* (never a maximum over the batch, which would make one
sequence's output depend on the others):

- ``"scaled_transpose"``: V_0 = A^T / (||A||_1 ||A||_inf). Converges for any
  matrix (Pan & Schreiber 1991); the Nystromformer choice.
- ``"identity"``: V_0 = I. Converges when ||I - A|| < 1, the condition Skyformer's
  Lemma 3 establishes for D^-1/2 (M + gamma I) D^-1/2 (Skyformer section 3.4
  states exactly this condition for Razavi et al.'s Theorem 2). For such a matrix
  it starts every eigenvalue of A V_0 at lambda instead of lambda^2 / ||A||_1^2,
  so small eigenvalues converge in far fewer iterations.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

PinvInit = Literal["scaled_transpose", "identity"]
PINV_INITS: tuple[str, ...] = ("scaled_transpose", "identity")


def initial_inverse(a: Tensor, init: PinvInit) -> Tensor:
    """Starting point V_0 for ``a: [..., m, m]`` (see module docstring)."""
    if init == "identity":
        return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    if init == "scaled_transpose":
        abs_a = a.abs()
        norm_1 = abs_a.sum(dim=-2).amax(dim=-1)  # max column sum  [...]
        norm_inf = abs_a.sum(dim=-1).amax(dim=-1)  # max row sum   [...]
        scale = 1.0 / (norm_1 * norm_inf).clamp_min(torch.finfo(a.dtype).tiny)
        return a.transpose(-1, -2) * scale[..., None, None]
    raise ValueError(f"init must be one of {PINV_INITS}, got {init!r}.")


def iterative_pinv(
    a: Tensor,
    iterations: int = 6,
    *,
    init: PinvInit = "scaled_transpose",
) -> Tensor:
    """Approximate pseudo-inverse of ``a: [..., m, m]`` by ``iterations`` Razavi steps.

    Each step costs four batched m x m products. Differentiable by autograd.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}.")
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    v = initial_inverse(a, init)
    for _ in range(iterations):
        av = a @ v
        t = 7 * eye - av
        t = 15 * eye - av @ t
        t = 13 * eye - av @ t
        v = 0.25 * (v @ t)
    return v


def inverse_residual(a: Tensor, v: Tensor) -> Tensor:
    """Spectral norm ||I - A V||_2 per matrix, ``[...]``: how far V is from inverting A."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.matrix_norm(eye - a @ v, ord=2)
