"""The regularised, diagonally normalised inverse of Skyformer section 4.4 (Lemma 3).

For the landmark kernel matrix M = S^T C_bar S (``[..., m, m]``, entries >= 0), the
inverse used by the modified Nystrom method is

    W = D^-1/2 inv(D^-1/2 (M + gamma I) D^-1/2) D^-1/2 ,   D = diag((M + gamma I) 1),

which equals (M + gamma I)^-1 when the inner inverse is exact. Lemma 3: the inner
matrix A has its eigenvalues in (0, 1], so ||I - A|| < 1 and the iterative inverse
converges (from V_0 = I, see ``pinv.py``). (The lemma says (0, 1); the largest is in
fact exactly 1, with eigenvector D^1/2 1, as for a normalised graph Laplacian; the
conclusion ||I - A|| = 1 - lambda_min < 1 is unaffected.) With gamma = 0 and
``pinv="exact"`` the inner pseudo-inverse makes W a generalised inverse of M, and
B S W S^T B is the plain Nystrom approximation B S (S^T B S)^+ S^T B: the Nystrom
projector does not depend on which generalised inverse is used.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..user_frame import warn_from_user_frame
from .flush import flush_on_cpu
from .implicit_inverse import GRADIENTS, implicit_iterations, implicit_pinv
from .kernels import gaussian_kernel_block
from .lemma3_triton import fused_lemma3_applies, triton_lemma3_inverse
from .pinv import PinvInit, iterative_pinv
from .tracing import may_read_values

PinvMethod = Literal["iterative", "exact"]
PINV_METHODS: tuple[str, ...] = ("iterative", "exact")


def lemma3_inverse(
    m: Tensor,
    *,
    gamma: float,
    pinv: PinvMethod = "iterative",
    iterations: int = 6,
    init: PinvInit = "identity",
    live: Tensor | None = None,
    kernel: str = "torch",
    gradient: str = "unrolled",
) -> Tensor:
    """W ~ (M + gamma I)^-1 through the Lemma 3 normalisation.

    Args:
        m: landmark kernel matrix ``[..., m, m]`` with non-negative entries; rows and
            columns of dead landmarks must already be zero.
        gamma: ridge added to the diagonal (Skyformer uses 0.1).
        pinv: ``"iterative"`` (Razavi et al., ``iterations`` steps) or ``"exact"``
            (for tests and analysis: with gamma > 0 the inverse of the positive
            definite matrix, by LU; with gamma = 0 the pseudo-inverse, by LU too
            where the matrix is well conditioned, else ``torch.linalg.pinv``;
            ``exact_inverse``).
        live: ``[B, m]`` bool for ``m: [B, H, m, m]`` (shared by the heads), False for
            landmark slots that hold no landmark (more features than valid rows).
            Their diagonal is set to 1 so they decouple from the live block; their
            rows/columns of W are unused.
        kernel: ``"auto" | "torch" | "triton"`` as the methods' option: the Triton path
            runs the whole chain in one launch where it applies (``lemma3_triton``).
        gradient: ``"unrolled"`` (the adjoint of the ``iterations`` steps) or
            ``"implicit"`` (differentiated as an inverse, after at least as many steps
            as Lemma 3's bound needs: ``implicit_inverse``). The bound holds for a PSD
            ``m`` with entries in [0, 1], as a Gaussian block's are (the methods pass
            nothing else): a matrix scaled beyond that gets too few steps, so that the
            implicit gradient is not the gradient of W; the unrolled one always is.
            Float32 and float64 CPU tensors (PyTorch path) form the inverse by a
            Cholesky factorisation, exact for any positive definite M + gamma I; GPU
            tensors and the Triton path keep the steps and this bound.
    Returns:
        ``[..., m, m]``.
    """
    size = m.shape[-1]
    warn_of_a_ridge_below_rounding(gamma, size, m.dtype)
    iterations = core_iterations(gradient, iterations, size, gamma, pinv, init, m.dtype)
    diag = ridge_diagonal(gamma, live, size, m)
    if fused_lemma3_applies(kernel, m, size, pinv, init, iterations):
        return triton_lemma3_inverse(m, None, diag.reshape(-1, size), iterations,
                                     kernel=kernel, implicit=gradient == "implicit")
    return lemma3_by_pytorch(m, diag, pinv, iterations, init, gradient,
                             definite=gamma > 0)


def landmark_inverse(
    x: Tensor,
    x_norm: Tensor,
    *,
    gamma: float,
    pinv: PinvMethod = "iterative",
    iterations: int = 6,
    init: PinvInit = "identity",
    live: Tensor | None = None,
    kernel: str = "torch",
    gradient: str = "unrolled",
) -> Tensor:
    """``lemma3_inverse`` of M = C(X, X), the Gaussian block of the landmark rows
    ``x: [..., m, D]`` (already scaled) with half squared norms ``x_norm: [..., m]``
    (+inf for slots that hold no landmark). On the Triton path one launch forms M and
    runs the whole chain (``lemma3_triton``); options as ``lemma3_inverse``.
    Returns ``[..., m, m]``."""
    size = x.shape[-2]
    steps = core_iterations(gradient, iterations, size, gamma, pinv, init, x.dtype)
    if fused_lemma3_applies(kernel, x, size, pinv, init, steps):
        warn_of_a_ridge_below_rounding(gamma, size, x.dtype)
        ridge = ridge_diagonal(gamma, live, size, x)
        return triton_lemma3_inverse(x, x_norm, ridge.reshape(-1, size), steps,
                                     kernel=kernel, implicit=gradient == "implicit")
    return lemma3_inverse(gaussian_kernel_block(x, x, x_norm, x_norm), gamma=gamma,
                          pinv=pinv, iterations=iterations, init=init, live=live,
                          kernel=kernel, gradient=gradient)


def warn_of_a_ridge_below_rounding(gamma: float, size: int, dtype: torch.dtype) -> None:
    """Warn where Lemma 3's bound on the normalised core's condition number,
    (m + gamma) / gamma, reaches 1 / (16 eps) of ``dtype``: there a positive ``gamma``
    is lost to rounding beside close landmarks (as if 0, where the identity start
    diverges and LU meets a singular matrix), and the output can be off by orders of
    magnitude or NaN, with nothing else to say so (gamma = 1e-9 in float32: errors of
    1e6 to 1e7)."""
    if gamma <= 0 or not dtype.is_floating_point or torch.compiler.is_compiling():
        return  # compiled: warn_from_user_frame reads frames, which Dynamo cannot trace
    eps = torch.finfo(dtype).eps
    if (size + gamma) / gamma * 16 * eps < 1:
        return
    least = 16 * size * eps / (1 - 16 * eps)
    warn_from_user_frame(
        f"gamma={gamma:g} with {size} landmarks in {str(dtype).removeprefix('torch.')}: the "
        f"core's condition number may reach (m + gamma) / gamma = {(size + gamma) / gamma:.2g}, "
        f"past what that precision resolves, where close landmarks make the inverse "
        f"inaccurate or NaN; use gamma >= {least:.1g} or float64 inputs.", UserWarning)


def core_iterations(gradient: str, iterations: int, size: int, gamma: float, pinv: str,
                    init: str, dtype: torch.dtype) -> int:
    """The steps the core runs: ``iterations``, raised for the implicit gradient to what
    Lemma 3's bound needs for ``size`` landmarks in ``dtype``
    (``implicit_inverse.implicit_iterations``), which applies to the iterative inverse
    from the identity alone."""
    if gradient not in GRADIENTS:
        raise ValueError(f"gradient must be one of {GRADIENTS}, got {gradient!r}.")
    if gradient == "unrolled":
        return iterations
    if pinv != "iterative" or init != "identity":
        raise ValueError(f"the implicit gradient applies to the iterative inverse from the "
                         f"identity (pinv='iterative', pinv_init='identity'), got "
                         f"pinv={pinv!r}, pinv_init={init!r}.")
    return implicit_iterations(size, gamma, dtype, at_least=iterations)


def ridge_diagonal(gamma: float, live: Tensor | None, size: int, like: Tensor) -> Tensor:
    """The diagonal added to M: gamma, 1 on dead slots; ``[m]`` or ``[B, 1, m]`` (for
    ``live: [B, m]``, broadcast over the heads of ``[B, H, m, m]``)."""
    check_ridge_in_range(gamma, like.dtype)
    diag = torch.full((size,), float(gamma), dtype=like.dtype, device=like.device)
    if live is not None:
        _check_live(live, like, size)
        diag = torch.where(live[:, None, :], diag, torch.ones_like(diag))
    return diag


def check_ridge_in_range(gamma: float, dtype: torch.dtype) -> None:
    """A ``gamma`` past the largest value of ``dtype``, the core's (float32 for half
    inputs), is refused in a sentence (torch would stop at filling the diagonal with a
    bare overflow message)."""
    if dtype.is_floating_point and gamma > torch.finfo(dtype).max:
        raise ValueError(
            f"gamma={gamma:g} is past the largest {str(dtype).removeprefix('torch.')} value "
            f"({torch.finfo(dtype).max:.3g}), the dtype the Nystrom core is computed in: "
            f"use a smaller gamma (the default is 0.1) or float64 inputs.")


def _check_live(live: Tensor, like: Tensor, size: int) -> None:
    """``live`` marks slots per batch element of ``[B, H, m, m]`` (or ``[B, H, m, D]``
    landmark rows): any other pairing would broadcast into a wrong shape silently."""
    if like.dim() != 4 or tuple(live.shape) != (like.shape[0], size):
        raise ValueError(
            f"live must be [B, m] = [{like.shape[0]}, {size}] for [B, H, m, m] matrices "
            f"(one row of slots per batch element, shared by its heads), got live of "
            f"shape {list(live.shape)} for a tensor of shape {list(like.shape)}; for a "
            f"stack of [B, m, m] matrices pass m[:, None] and take w[:, 0].")


def lemma3_by_pytorch(m: Tensor, diag: Tensor, pinv: PinvMethod, iterations: int,
                      init: PinvInit, gradient: str = "unrolled", *,
                      definite: bool = False) -> Tensor:
    """``lemma3_inverse``'s PyTorch path, ``diag`` the ridge (broadcast against the
    diagonal of ``m: [..., m, m]``); ``iterations`` as ``core_iterations`` gives them;
    ``definite``: every entry of ``diag`` is > 0 (``exact_inverse``)."""
    m = m + torch.diag_embed(diag)
    d_inv_sqrt = m.sum(dim=-1).clamp_min(torch.finfo(m.dtype).tiny).rsqrt()  # [..., m]
    a = d_inv_sqrt[..., :, None] * m * d_inv_sqrt[..., None, :]
    a = flush_on_cpu(a)  # far landmarks: subnormal entries (flush.py)
    if pinv == "iterative" and gradient == "implicit":
        a_inv = implicit_pinv(a, iterations)
    elif pinv == "iterative":
        a_inv = iterative_pinv(a, iterations, init=init)
    elif pinv == "exact":
        a_inv = exact_inverse(a, definite)
    else:
        raise ValueError(f"pinv must be one of {PINV_METHODS}, got {pinv!r}.")
    return d_inv_sqrt[..., :, None] * a_inv * d_inv_sqrt[..., None, :]


def exact_inverse(a: Tensor, definite: bool) -> Tensor:
    """``pinv="exact"`` of the normalised matrix ``a: [..., m, m]``: its inverse by LU
    where a positive ridge makes it positive definite (``definite``), else its
    pseudo-inverse, which is the inverse by LU too where the values may be read (eager
    calls) and LU shows ``a`` well conditioned (``_well_conditioned``), else
    ``torch.linalg.pinv``. An eigendecomposition is exact norm-wise only: landmarks far
    apart leave entries near 1e-20 in the inverse, which it returns with errors of
    order eps, and the softmax factors exp(|k|^2 / 2) of ``nystrom_softmax`` magnify
    them (rows 3e-2 off in float64 at |q|, |k| ~ 7 with a ridge; O(1) at |q|, |k| ~ 5
    with gamma = 0 and every row a landmark, where eq. (5) is met exactly); LU keeps
    them. A matrix that is singular in floating point all the same (a ridge below
    rounding, repeated rows) takes the pseudo-inverse where the values may be read."""
    inverse, info = torch.linalg.inv_ex(a)
    if not may_read_values(a):
        return inverse if definite else torch.linalg.pinv(a, hermitian=True)
    usable = info == 0
    if not definite:
        usable = usable & _well_conditioned(a.detach(), inverse.detach())
    if bool(usable.all()):
        return inverse
    pseudo = torch.linalg.pinv(a, hermitian=True)
    if not bool(usable.any()):
        return pseudo
    # the inverse of the usable matrices alone: a singular one's inf or NaN, unselected,
    # would still reach the gradient through inv's backward (0 times inf)
    keep = usable[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.where(keep, torch.linalg.inv(torch.where(keep, a, eye)), pseudo)


def _well_conditioned(a: Tensor, inverse: Tensor) -> Tensor:
    """``[...]`` bool: whether ``a``'s condition number, estimated from LU's ``inverse``
    in the 1-norm, is below 1 / (100 m eps): far from where ``torch.linalg.pinv`` drops
    eigenvalues (below m eps of the largest), so that the two are one matrix and LU's
    is the more accurate entry by entry."""
    size, eps = a.shape[-1], torch.finfo(a.dtype).eps
    condition = torch.linalg.matrix_norm(a, ord=1) * torch.linalg.matrix_norm(inverse, ord=1)
    return torch.isfinite(condition) & (condition * (100 * size * eps) < 1)
