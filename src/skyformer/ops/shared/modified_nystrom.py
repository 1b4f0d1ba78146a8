"""The modified Nystrom factorisation shared by ``skyformer`` and ``nystrom_softmax``.

Skyformer eqs. (4)-(6): lift the (non-PSD) Q-vs-K Gaussian kernel matrix C into the
PSD matrix C_bar of [Q; K] against itself, approximate C_bar by
C_bar S (S^T C_bar S)^+ S^T C_bar with S a uniform sub-sampling of d = m rows, and
keep the off-diagonal (Q-rows, K-columns) block:

    C ~ C(Q, X_S)  W  C(X_S, K),     W = Lemma-3 inverse of M = C(X_S, X_S).

Only the blocks [Nq, m], [m, m] and [Nk, m] are formed: O(N m) time and memory per
head, never an n x n or 2n x 2n matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import (
    GRADIENTS,
    KERNELS,
    PINV_INITS,
    PINV_METHODS,
    gather_rows,
    gaussian_kernel_block,
    half_sq_norm,
    landmark_inverse,
)
from ...linalg.rows import gather_rows_through
from ...sketch import Landmarks, uniform_landmarks
from .inputs import AttentionInputs, compute_dtype
from .options import (
    check_choice,
    check_nonnegative_float,
    check_pinv_iterations,
    check_positive_int,
)


@dataclass(frozen=True)
class NystromOptions:
    """Options common to the modified Nystrom methods (gamma and the 6 steps are the
    Skyformer authors' released code's, which the paper does not state; the identity
    start is this library's: ``ops/skyformer/README.md``).

    num_features: number of landmarks m sampled from the rows of [Q; K] (half from
        each); capped by the valid rows, so m >= 2 N uses every row once.
    gamma: ridge added to M before the Lemma 3 normalisation; 0 only with
        ``pinv_init="scaled_transpose"`` or ``pinv="exact"`` (from the identity the
        iteration needs Lemma 3's gamma > 0).
    pinv, pinv_iterations, pinv_init, pinv_gradient: the inverse of the non-causal
        form; with ``causal=True`` the core is the exact ridge inverse (one Cholesky)
        and they change nothing.
    pinv: ``"iterative"`` (Razavi et al.) or ``"exact"`` (the inverse by LU for
        gamma > 0; for gamma = 0 the pseudo-inverse, by LU where the core is well
        conditioned, else torch.linalg.pinv; ``linalg.nystrom.exact_inverse``).
    pinv_iterations: iterations of the iterative inverse.
    pinv_init: starting point of the iteration, ``"identity"`` (justified by Lemma 3)
        or ``"scaled_transpose"`` (A^T / (|A|_1 |A|_inf), per matrix).
    pinv_gradient: how the inverse is differentiated: ``"unrolled"`` (the adjoint of
        the ``pinv_iterations`` steps, the gradient of what they compute) or
        ``"implicit"`` (as an inverse, dA = -W^T G W^T: two products instead of about
        44-60 at m = 128; the steps are raised to what Lemma 3's bound needs for the
        gradient to be exact to rounding, 9 at m = 128 in float32, so W becomes the
        ridge inverse the 6 steps approximate, which CPU tensors form by a Cholesky
        factorisation instead; needs the iterative inverse from the identity and
        gamma > 0; ``linalg.implicit_inverse``).
    kernel: the [N, m] kernel products by ``"auto"`` (fused Triton kernels for float32
        and half CUDA inputs when Triton is installed, else PyTorch), ``"torch"`` or
        ``"triton"`` (``linalg.kernel_backend``); the landmark draw (one Triton kernel
        per side on eager CUDA tensors, the same landmarks, ``sketch.landmarks``) and
        the m x m core (C(X_S, X_S) and its Lemma 3 inverse in one launch, up to
        m = 128, differentiated or not, ``linalg.lemma3_triton``)
        follow it.
    """

    num_features: int = 128
    gamma: float = 0.1
    pinv: str = "iterative"
    pinv_iterations: int = 6
    pinv_init: str = "identity"
    pinv_gradient: str = "unrolled"
    kernel: str = "auto"

    def validate(self, method: str) -> None:
        check_positive_int(method, "num_features", self.num_features)
        check_nonnegative_float(method, "gamma", self.gamma)
        check_choice(method, "pinv", self.pinv, PINV_METHODS)
        check_choice(method, "pinv_init", self.pinv_init, PINV_INITS)
        check_pinv_iterations(method, self.pinv_iterations)
        check_choice(method, "pinv_gradient", self.pinv_gradient, GRADIENTS)
        check_choice(method, "kernel", self.kernel, KERNELS)
        if self.pinv == "iterative" and self.pinv_init == "identity" and not self.gamma > 0:
            # Lemma 3's ||I - A|| < 1 needs the ridge: without it repeated landmark rows
            # make A singular, and from V_0 = I its null space grows by 13/4 a step
            raise ValueError(
                f"{method}: the iterative inverse from the identity needs gamma > 0 "
                f"(Skyformer's Lemma 3; without it repeated landmark rows make the "
                f"iteration diverge), got gamma={self.gamma!r}; keep gamma > 0 (the "
                f"default is 0.1), or for gamma = 0 set pinv_init='scaled_transpose' "
                f"(converges to the pseudo-inverse) or pinv='exact'.")
        if self.pinv_gradient == "implicit":
            self._check_implicit(method)

    def _check_implicit(self, method: str) -> None:
        """What ``pinv_gradient="implicit"`` needs: the bound on the steps holds for the
        iterative inverse from the identity with a ridge (``linalg.implicit_inverse``)."""
        if self.pinv != "iterative" or self.pinv_init != "identity":
            raise ValueError(
                f"{method}: pinv_gradient='implicit' applies to the iterative inverse from "
                f"the identity; set pinv='iterative' and pinv_init='identity' (got "
                f"pinv={self.pinv!r}, pinv_init={self.pinv_init!r}), or keep "
                f"pinv_gradient='unrolled'.")
        if not self.gamma > 0:
            raise ValueError(
                f"{method}: pinv_gradient='implicit' needs gamma > 0 (the number of steps "
                f"comes from the bound gamma / (m + gamma)), got gamma={self.gamma!r}.")


@dataclass(frozen=True)
class NystromFactors:
    """C ~ c_qx @ w @ c_kx^T for the Gaussian kernel of the scaled inputs."""

    c_qx: Tensor  # [B, H, Nq, m]
    w: Tensor  # [B, H, m, m]
    c_kx: Tensor  # [B, H, Nk, m]  (rows of padded keys are zero)
    landmarks: Landmarks


def sample_landmarks(
    info: AttentionInputs, num_features: int, device: torch.device,
    generator: torch.Generator | Tensor | None, *, draw: str = "auto",
) -> Landmarks:
    """Uniform landmarks for one call (``generator``: a generator or a random key;
    ``draw``: the ``kernel`` option, which also picks how the selection keys are computed,
    ``sketch.landmarks.use_triton_draw``)."""
    return uniform_landmarks(
        num_features,
        batch=info.batch,
        query_len=info.query_len,
        key_len=info.key_len,
        query_valid=info.query_valid,
        key_valid=info.key_valid,
        device=device,
        generator=generator,
        draw=draw,
    )


def head_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``index: [B, m]`` of ``x: [B, H, N, D]`` for every head: ``[B, H, m, D]``."""
    return gather_rows(x, every_head(index, x))


def every_head(index: Tensor, x: Tensor) -> Tensor:
    """``index: [B, m]`` as ``[B, H, m]`` for ``x: [B, H, N, D]`` (a view)."""
    return index[:, None, :].expand(x.shape[0], x.shape[1], index.shape[1])


@dataclass(frozen=True)
class NystromCore:
    """What the fused and the materialised paths share: landmark rows and W
    (``inverse``).

    ``x_norm`` is |x|^2/2 of the landmark rows, +inf for slots holding no landmark
    (which zeroes their column of every kernel block). For bfloat16 inputs ``x_bf16``
    holds the rows before their scale ``x_factor``, exact bfloat16 numbers that the
    Triton products read in place of x (``gaussian_kernel_matmul``).
    """

    x: Tensor  # [B, H, m, D] landmark rows of [Q^; K^] (scaled)
    x_norm: Tensor  # [B, H, m]
    options: NystromOptions
    landmarks: Landmarks
    live: Tensor | None  # [B, m] bool: the slots that hold a landmark; None: every one
    x_bf16: Tensor | None = None  # [B, H, m, D] x / x_factor (no gradient), or None
    x_factor: float = 1.0

    @property
    def bf16_rows(self) -> dict:
        """``x_bf16`` and ``x_factor`` as ``gaussian_kernel_matmul``'s keywords."""
        return {"x_bf16": self.x_bf16, "x_factor": self.x_factor}

    def inverse(self) -> Tensor:
        """W ``[B, H, m, m]``, the Lemma-3 inverse of C(X_S, X_S), formed at each call:
        read it once, after the products that do not need it. Autograd runs the
        backward pass of what was computed last first, so the Lemma 3 backward (its
        scratch and saved iterates: 72 MiB at B = 4, H = 16, m = 128 on the Triton
        path) then runs before the C(X_S, K) V product's backward makes the gradients
        of k and v, not on top of them (``benchmarks/stubbed_memory.py``)."""
        options = self.options
        return landmark_inverse(  # of C(X_S, X_S): [B, H, m, m]
            self.x, self.x_norm,
            gamma=options.gamma,
            pinv=options.pinv,  # type: ignore[arg-type]
            iterations=options.pinv_iterations,
            init=options.pinv_init,  # type: ignore[arg-type]
            live=self.live,
            kernel=options.kernel,
            gradient=options.pinv_gradient,
        )


def nystrom_core(
    q: Tensor, k: Tensor, scale: float, options: NystromOptions, landmarks: Landmarks,
    *, bf16_values: bool | None = None,
) -> tuple[Tensor, Tensor, NystromCore]:
    """(q, k, core): landmark rows X_S of [s Q; s K] (gathered, then scaled: m rows, not
    N), their half squared norms, and W = Lemma-3 inverse of C(X_S, X_S) (Skyformer
    section 4.4); half inputs give float32 rows (``compute_dtype``). The products read
    the q and k returned here: the gradient of the landmark rows joins theirs in one
    ``index_add`` (``linalg.rows.gather_rows_through``), not through two zero tensors
    of their size and two more additions; in place, so the callers must read q and k
    only through operations whose backward gives a new tensor (the Gaussian products,
    views) or several of them (autograd then sums into a tensor of its own).
    ``bf16_values``: the rows are bfloat16 numbers, so the products may read them as
    such (``NystromCore.x_bf16``); by default where they are bfloat16 tensors (a caller
    that converted bfloat16 queries to float32 says so)."""
    (q, k), rows = gather_rows_through(  # [B, H, m, D]
        (q, k), [every_head(index, q) for index in (landmarks.query_index,
                                                     landmarks.key_index)],
        in_place=True)
    return q, k, core_of_rows(rows, scale, options, landmarks, bf16_values=bf16_values)


def core_of_rows(rows: Tensor, scale: float, options: NystromOptions, landmarks: Landmarks,
                 *, bf16_values: bool | None = None) -> NystromCore:
    """``nystrom_core``'s core of the gathered, unscaled landmark rows
    ``rows: [B, H, m, D]`` (its arguments)."""
    unscaled = rows.to(compute_dtype(rows.dtype))
    core = core_from_rows(unscaled * scale, options, landmarks)
    if not (rows.dtype == torch.bfloat16 if bf16_values is None else bf16_values):
        return core
    return dataclasses.replace(core, x_bf16=unscaled.detach(), x_factor=scale)


def core_from_rows(x: Tensor, options: NystromOptions, landmarks: Landmarks) -> NystromCore:
    """``NystromCore`` of the scaled landmark rows ``x: [B, H, m, D]`` (slots that hold
    no landmark may hold any finite numbers: their kernel entries are exact zeros)."""
    x_norm = half_sq_norm(x)  # [B, H, m]
    if landmarks.every_slot_live:  # the masks below would change nothing
        return NystromCore(x, x_norm, options, landmarks, None)
    live = landmarks.live  # [B, m]
    x_norm = torch.where(live[:, None, :], x_norm, float("inf"))
    return NystromCore(x, x_norm, options, landmarks, live)


def modified_nystrom_factors(
    q_hat: Tensor,
    k_hat: Tensor,
    info: AttentionInputs,
    options: NystromOptions,
    landmarks: Landmarks,
    *,
    shift_query_rows: bool = False,
) -> NystromFactors:
    """Materialised factors of the modified Nystrom approximation of exp(-|q^_i - k^_j|^2 / 2).

    Forms the [Nq, m] and [Nk, m] blocks whole: the straightforward path, kept as the
    reference the fused path of ``skyformer``/``nystrom_softmax`` is tested against, and
    for analyses that need the factors.

    Args:
        q_hat: scaled queries ``[B, H, Nq, D]``; k_hat: scaled keys ``[B, H, Nk, D]``.
        shift_query_rows: divide each row of ``c_qx`` by its maximum (for row-normalised
            outputs, where that factor cancels).
    """
    q_hat, k_hat, core = nystrom_core(q_hat, k_hat, 1.0, options, landmarks)
    k_norm = half_sq_norm(k_hat)  # [B, H, Nk]
    if info.key_valid is not None:
        k_norm = torch.where(info.key_valid[:, None, :], k_norm, float("inf"))
    c_qx = gaussian_kernel_block(
        q_hat, core.x, half_sq_norm(q_hat), core.x_norm, shift_rows=shift_query_rows
    )
    c_kx = gaussian_kernel_block(k_hat, core.x, k_norm, core.x_norm)
    return NystromFactors(c_qx, core.inverse(), c_kx, landmarks)
