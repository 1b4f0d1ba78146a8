"""The implicit core's inverse by scaled Newton-Schulz steps, paired.

With the implicit gradient (``implicit_inverse.py``) W only has to be A^-1 to rounding;
how the forward pass reaches it is free. Every eigenvalue of the normalised landmark
matrix A lies in [l, 1] (Lemma 3: l = gamma / (m + gamma); lambda_max <= 1 since A is
similar to a row-stochastic matrix). A Newton-Schulz step scaled by alpha,

    V' = V (2 alpha I - alpha^2 A V),

maps an eigenvalue x of A V to alpha x (2 - alpha x); with alpha = 2 / (1 + l) both ends
of [l, 1] go to the same value, so the interval becomes [l', 1] with

    1 - l' = ((1 - l) / (1 + l))^2,

which quadruples a small l per step (Razavi's step multiplies it by 3.25 and costs four
products, this one two) and then converges quadratically. The schedule of alphas is the
same for every input: it depends only on the lower end of the interval, and that is
taken from the number of steps K and the dtype alone (``newton_lower_end``: the
smallest l from which K steps bring 1 - l below the unit roundoff), so that no caller
passes gamma: K comes from Lemma 3's bound (``implicit_iterations``), which makes the
true lower end at least that one, and a spectrum inside [l, 1] stays inside the
intervals the schedule was made for.

V_k is a polynomial in A, so P_k = A V_k follows from P_k-1 alone: with
H_k = 2 alpha_k I - alpha_k^2 P_k,

    V_k+1 = V_k H_k,   P_k+1 = P_k H_k,

two products that read the same P_k and can run side by side: one dependent pass a step
(from P_0 = A, V_1 = H_0 takes none). P's recurrence is not corrected by A, so its
rounding drifts; the last step is therefore an ordinary one, P = A V_K-1 first, which
brings the residual back to what every step from A reaches (tested). At m = 128 in
float32, 9 steps: the Triton kernel's forward pass takes 13 passes and 16 products of
two m x m matrices, where the paired Razavi steps took 24 passes and 37 products.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .flush import flush_on_cpu, flush_on_cpu_


def newton_floor(dtype: torch.dtype) -> float:
    """The least lower end a step's scale is made for in ``dtype``: 2^-7, or 16 eps for
    the half types (module docstring). Rounding leaves A's largest eigenvalue up to about
    m eps above 1, and a scale made for [l, 1] sends an eigenvalue above 1 + l below
    zero, from where the steps diverge; a floor far above that costs no step in float32
    or float64 at m <= 512 (small eigenvalues still grow about fourfold a step)."""
    return max(2.0 ** -7, 16 * torch.finfo(dtype).eps)


def newton_scale(lower: float, floor: float) -> float:
    """The step's alpha for eigenvalues in [``lower``, 1]: 2 / (1 + max(l, floor))."""
    return 2.0 / (1.0 + max(lower, floor))


def newton_interval_step(lower: float, floor: float) -> float:
    """The lower end of the interval holding A V's eigenvalues after one scaled step
    from [``lower``, 1]: the least of alpha x (2 - alpha x) over it, at one of its ends
    (1 - ((1 - l) / (1 + l))^2 where l >= ``floor``, module docstring)."""
    alpha = newton_scale(lower, floor)
    return min(alpha * lower * (2.0 - alpha * lower), alpha * (2.0 - alpha))


def newton_lower_end(iterations: int, dtype: torch.dtype) -> float:
    """The smallest lower end l_0 from which ``iterations`` scaled steps take every
    eigenvalue of A V within ``dtype``'s unit roundoff of 1: ``newton_interval_step``
    inverted, step by step back from 1 - roundoff."""
    floor = newton_floor(dtype)
    limit = newton_interval_step(floor, floor)  # where the floor starts to bind
    lower = 1.0 - torch.finfo(dtype).eps / 2
    for _ in range(iterations):
        root = math.sqrt(1.0 - lower)
        if lower >= limit:  # l >= floor: 1 - l' = ((1 - l) / (1 + l))^2
            lower = (1.0 - root) / (1.0 + root)
        else:  # l < floor: alpha l (2 - alpha l) = l', alpha = 2 / (1 + floor)
            lower = (1.0 - root) * (1.0 + floor) / 2.0
    return lower


def newton_scales(iterations: int, dtype: torch.dtype) -> list[float]:
    """alpha_0 ... alpha_K-1 of ``iterations`` steps in ``dtype``, computed as the
    Triton kernel computes them (float64, the same operations in the same order)."""
    lower, floor, scales = newton_lower_end(iterations, dtype), newton_floor(dtype), []
    for _ in range(iterations):
        scales.append(newton_scale(lower, floor))
        lower = newton_interval_step(lower, floor)
    return scales


def newton_residual_bound(lower: float, iterations: int, dtype: torch.dtype) -> float:
    """||I - A V_K||_2 at worst for eigenvalues of A in [``lower``, 1] after
    ``iterations`` steps whose scales follow that interval (with ``dtype``'s floor)."""
    floor = newton_floor(dtype)
    for _ in range(iterations):
        lower = newton_interval_step(lower, floor)
    return 1.0 - lower


def newton_steps(a3: Tensor, iterations: int, in_place: bool = False) -> Tensor:
    """V_K of ``iterations`` scaled steps from V_0 = I for ``a3: [batch, m, m]``, paired
    as the Triton kernel pairs them (module docstring), the last step from A; plain
    operators, so autograd, forward-mode AD and ``torch.export`` go through them
    (``in_place``: the CPU's flush of subnormal entries in place, for a caller that
    differentiates nothing)."""
    scales = newton_scales(iterations, a3.dtype)
    flush = flush_on_cpu_ if in_place else flush_on_cpu  # subnormals slow CPU products
    eye = torch.eye(a3.shape[-1], dtype=a3.dtype, device=a3.device).expand_as(a3)
    v, p = None, a3  # V_k (None: the identity) and P_k = A V_k
    for k, alpha in enumerate(scales):
        if k == len(scales) - 1 and v is not None:
            p = flush(torch.bmm(a3, v))  # the last step from A
        if v is None:  # V_1 = H_0 = 2 alpha I - alpha^2 A
            v_next = torch.add(eye * (2 * alpha), p, alpha=-alpha * alpha)
        else:
            v_next = flush(torch.baddbmm(v, v, p, beta=2 * alpha, alpha=-alpha * alpha))
        if k < len(scales) - 2:  # P_k+1 = P_k H_k, unless the next step is the last
            p = flush(torch.baddbmm(p, p, p, beta=2 * alpha, alpha=-alpha * alpha))
        v = v_next
    assert v is not None, "newton_steps needs at least one step"
    return v
