"""The Lemma 3 core differentiated as an inverse: ``pinv_gradient="implicit"``.

The Razavi steps from V_0 = I (``pinv.py``) make V_K a polynomial in the normalised
matrix A; their unrolled adjoint costs about twice the steps' products (44-60 products
of two m x m matrices at K = 6, the largest single cost of a Skyformer call on a GPU at
N = 4096, docs/gpu-record.md). Were V_K = A^-1, its gradient would be two products:

    dA = -V^T G V^T        (from d(A^-1) = -A^-1 dA A^-1, G the gradient of V).

That is the gradient of what the forward pass computes only where ||I - A V_K|| is
negligible, and at the authors' K = 6 it is not for every input (0.40 at m = 128 in the
worst case, docs/gpu-record.md "The implicit gradient of the inverse"). Lemma 3 bounds it for
every input: A >= gamma D^-1 and D <= (m + gamma) I (entries of M at most 1), so
lambda_min(A) >= gamma / (m + gamma), and lambda_max(A) <= 1. The implicit option
therefore forms A^-1 to rounding, so that dA is its exact gradient: by scaled
Newton-Schulz steps from V_0 = I (``newton_inverse.py``), as many as the bound needs to
take every eigenvalue of A V_K within the unit roundoff of the core's dtype of 1
(``implicit_iterations``: 9 at m = 128 in float32, 10 in float64), never fewer than
asked. (Razavi's steps, ``eigenvalue_step``, reach the same with twice the products; the
unrolled gradient keeps them, as the authors ran them.)

The forward pass thus changes (W becomes the inverse the authors' 6 steps approximate),
so it is an option, not the default. What a call holds for its backward pass shrinks to
V_K alone (the unrolled path holds every iterate, and on the PyTorch path each step's
products too). The bound needs M PSD with entries in [0, 1], as the Gaussian blocks the
methods pass are; ``nystrom.lemma3_inverse`` says so for a matrix given directly.

Since W is then A^-1 to rounding, it need not come from the steps: for float32 and
float64 CPU tensors it comes from a Cholesky factorisation of A
(``SOLVERS``, ``implicit_pinv``), which the same bound makes safe (A is symmetric
positive definite with condition number at most (m + gamma) / gamma). The
factorisation and the inverse from it cost about m^3 / 2 multiply-adds, the steps'
16 products of two m x m matrices (9 steps at m = 128) 16 m^3; on a 2-core CPU the
core's forward pass is 1.3-1.5x faster, its forward and backward passes as fast
(``benchmarks/implicit_gradient_cost.py``), and its inverse about twice as accurate
in float32 (docs/gpu-record.md). GPU tensors keep the steps,
which the Triton kernel runs in one program per matrix (a factorisation there is not
measured).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .eager_calls import apply
from .functional_ops import first_order_backward, functional_ops_only
from .newton_inverse import newton_floor, newton_interval_step, newton_steps
from .pinv import iterative_pinv
from .tracing import may_read_values

GRADIENTS: tuple[str, ...] = ("unrolled", "implicit")
# how the implicit core's forward pass forms A^-1: "auto" = "cholesky" for float32 and
# float64 CPU tensors, "steps" (scaled Newton) elsewhere (factorises); "razavi": the
# authors' steps, the forward pass of the unrolled gradient (for studies that compare
# the two gradients of one forward pass, benchmarks/implicit_core_gradient.py)
SOLVERS: tuple[str, ...] = ("auto", "steps", "cholesky", "razavi")
MAX_ITERATIONS = 64  # far beyond any bound reached (m = 10^6, gamma = 1e-6: 27)


def eigenvalue_step(p: float) -> float:
    """What one Razavi step does to an eigenvalue p of A V (A V commutes with A): the
    eigenvalue of A V' is p' = p (13 - 15p + 7p^2 - p^3) / 4, so 1 - p' =
    (1 - p)^3 (4 - p) / 4, and p' increases with p on [0, 1]."""
    return p * (13 - 15 * p + 7 * p * p - p ** 3) / 4


def residual_bound(m: int, gamma: float, iterations: int) -> float:
    """||I - A V_K||_2 at worst over every input with m landmarks (module docstring):
    1 - f^K(gamma / (m + gamma)), reached when all m landmarks coincide."""
    p = gamma / (m + gamma)
    for _ in range(iterations):
        p = eigenvalue_step(p)
    return 1 - p


def implicit_iterations(m: int, gamma: float, dtype: torch.dtype, at_least: int = 0) -> int:
    """The scaled Newton steps (``newton_inverse``) after which every input's eigenvalues
    of A V, in [gamma / (m + gamma), 1] to start with (Lemma 3), are within ``dtype``'s
    unit roundoff of 1, or ``at_least`` if more; ``gamma`` must be > 0."""
    if not gamma > 0:
        raise ValueError(f"the implicit gradient needs gamma > 0 (its number of steps comes "
                         f"from the bound gamma / (m + gamma)), got {gamma!r}.")
    roundoff, floor = torch.finfo(dtype).eps / 2, newton_floor(dtype)
    lower = gamma / (m + gamma)
    for k in range(MAX_ITERATIONS + 1):
        if 1 - lower <= roundoff:
            return max(k, at_least)
        lower = newton_interval_step(lower, floor)
    raise ValueError(f"m = {m}, gamma = {gamma!r}: the residual bound stays above "
                     f"{roundoff:.1e} after {MAX_ITERATIONS} steps; raise gamma.")


class _ImplicitInverse(torch.autograd.Function):
    """A^-1 for ``a: [..., m, m]`` by ``solver`` (``"steps"``: ``iterations`` scaled
    Newton steps from V_0 = I; ``"cholesky"``: a Cholesky factorisation), differentiated as
    A^-1: dA = -V^T G V^T. Holds V alone for the backward pass."""

    @staticmethod
    def forward(a: Tensor, iterations: int, solver: str) -> Tensor:  # type: ignore[override]
        m = a.shape[-1]
        a3 = a.reshape(-1, m, m)
        if solver == "cholesky":
            return _factorised_inverse(a3, iterations).reshape(a.shape)
        if solver == "razavi":
            return iterative_pinv(a3, iterations, init="identity").reshape(a.shape)
        return newton_steps(a3, iterations, in_place=True).reshape(a.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        # [batch, m, m], a batch dim even for one matrix: a transform of the backward
        # pass (jacrev) folds its mapped dim into dim 0 of the saved and incoming tensors
        ctx.save_for_backward(output.reshape(-1, *output.shape[-2:]))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, a: Tensor, iterations: int,
             solver: str) -> tuple[Tensor, int]:
        """Both solvers take any batch shape: the mapped dim becomes the first one."""
        return _ImplicitInverse.apply(a.movedim(in_dims[0], 0), iterations, solver), 0

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (v,) = ctx.saved_tensors  # [batch, m, m]
        v_t = v.mT
        g = grad.reshape(-1, *v.shape[-2:])
        return -(v_t @ g @ v_t).reshape(grad.shape), None, None


def _factorised_inverse(a3: Tensor, iterations: int) -> Tensor:
    """A^-1 for ``a3: [batch, m, m]`` from its Cholesky factor (the lower triangle of
    ``a3``, symmetric in the methods' calls). A batch holding a matrix that is not
    positive definite in floating point (NaN; a condition number near 1 / eps, which
    Lemma 3's bound allows for many landmarks with a tiny gamma in float32) takes the
    steps where the values may be read (eager calls; free on the CPU), and one that is
    not symmetric (``_symmetric``; a direct call's matrix) an LU factorisation; in
    traced code, which cannot branch on it, such a matrix's inverse is NaN, or that of
    the symmetric matrix of its lower triangle."""

    factor, info = torch.linalg.cholesky_ex(a3)
    if not may_read_values(a3):
        failed = (info != 0)[:, None, None]
        return torch.where(failed, float("nan"), torch.cholesky_inverse(factor))
    if not _symmetric(a3):
        return torch.linalg.inv(a3)
    if bool(info.any()):
        return newton_steps(a3, iterations, in_place=True)
    return torch.cholesky_inverse(factor)


def _symmetric(a3: Tensor) -> bool:
    """Whether every matrix of ``a3: [batch, m, m]`` equals its transpose to within m
    units of rounding of its largest entry (the Lemma 3 matrices the methods form differ
    by under one: ``d_i m_ij d_j`` is rounded in another order than ``d_j m_ji d_i``)."""
    top = a3.abs().amax(dim=(1, 2))
    gap = (a3 - a3.mT).abs().amax(dim=(1, 2))
    return bool((gap <= a3.shape[-1] * torch.finfo(a3.dtype).eps * top).all())


def _resolve_solver(solver: str, a: Tensor) -> str:
    """The solver ``implicit_pinv`` runs for ``a``: ``"auto"`` factorises where that is
    measured faster (``factorises``) and runs the steps elsewhere."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    if solver != "auto":
        return solver
    return "cholesky" if factorises(a.device, a.dtype) else "steps"


def factorises(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the implicit core on the PyTorch path forms its inverse by a Cholesky
    factorisation on ``device`` in ``dtype`` (the landmark rows' compute dtype): float32
    and float64 CPU tensors (the CPU has no half-precision factorisation)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.float64)


def implicit_pinv(a: Tensor, iterations: int, solver: str = "auto") -> Tensor:
    """A^-1 for ``a: [..., m, m]`` with the implicit gradient (module docstring):
    V_K of ``iterations`` scaled Newton steps from the identity (``iterations`` from
    ``implicit_iterations``), or the same inverse to rounding from a Cholesky
    factorisation (``solver``, ``SOLVERS``: ``"auto"`` factorises float32 and float64
    CPU tensors, by Cholesky where they are symmetric, as the Lemma 3 matrix is, else
    by LU; ``"razavi"``: the authors' steps instead, not A^-1 unless converged). The
    steps' schedule is made for the Lemma 3 matrix: symmetric, eigenvalues in (0, 1].
    Under ``torch.export`` and forward-mode AD the steps in plain operators
    (``newton_steps``; their unrolled derivative, equal to rounding at those steps;
    PyTorch's forward-mode derivative of ``cholesky_inverse`` is wrong in 2.13,
    pytorch/pytorch#196682)."""
    if iterations < 1:
        raise ValueError(f"the implicit gradient needs at least one step, got {iterations}.")
    solver = _resolve_solver(solver, a)
    if functional_ops_only():
        if solver == "razavi":
            return iterative_pinv(a, iterations, init="identity")
        m = a.shape[-1]
        return newton_steps(a.reshape(-1, m, m), iterations).reshape(a.shape)
    return apply(_ImplicitInverse, a, iterations, solver)
