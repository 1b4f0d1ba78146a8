"""The regularised, diagonally normalised inverse of Skyformer section 3.4 (Lemma 3).

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

from .flush import flush_on_cpu
from .kernels import gaussian_kernel_block
from .lemma3_triton import fused_lemma3_applies, triton_lemma3_inverse
from .pinv import PinvInit, iterative_pinv

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
) -> Tensor:
    """W ~ (M + gamma I)^-1 through the Lemma 3 normalisation.

    Args:
        m: landmark kernel matrix ``[..., m, m]`` with non-negative entries; rows and
            columns of dead landmarks must already be zero.
        gamma: ridge added to the diagonal (Skyformer uses 0.1).
        pinv: ``"iterative"`` (Razavi et al., ``iterations`` steps) or ``"exact"``
            (``torch.linalg.pinv``; for tests and analysis).
        live: ``[B, m]`` bool, False for landmark slots that hold no landmark (more
            features asked for than valid rows). Their diagonal is set to 1 so they
            decouple from the live block; their rows/columns of W are unused.
        kernel: ``"auto" | "torch" | "triton"`` as the methods' option: the Triton path
            runs the whole chain in one launch where it applies (``lemma3_triton``).
    Returns:
        ``[..., m, m]``.
    """
    size = m.shape[-1]
    diag = _ridge(gamma, live, size, m)
    if fused_lemma3_applies(kernel, m, size, pinv, init, iterations):
        return triton_lemma3_inverse(m, None, diag.reshape(-1, size), iterations,
                                     kernel=kernel)
    return lemma3_by_pytorch(m, diag, pinv, iterations, init)


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
) -> Tensor:
    """``lemma3_inverse`` of M = C(X, X), the Gaussian block of the landmark rows
    ``x: [..., m, D]`` (already scaled) with half squared norms ``x_norm: [..., m]``
    (+inf for slots that hold no landmark). On the Triton path one launch forms M and
    runs the whole chain (``lemma3_triton``); options as ``lemma3_inverse``.
    Returns ``[..., m, m]``."""
    size = x.shape[-2]
    if fused_lemma3_applies(kernel, x, size, pinv, init, iterations):
        ridge = _ridge(gamma, live, size, x)
        return triton_lemma3_inverse(x, x_norm, ridge.reshape(-1, size), iterations,
                                     kernel=kernel)
    return lemma3_inverse(gaussian_kernel_block(x, x, x_norm, x_norm), gamma=gamma,
                          pinv=pinv, iterations=iterations, init=init, live=live,
                          kernel=kernel)


def _ridge(gamma: float, live: Tensor | None, size: int, like: Tensor) -> Tensor:
    """The diagonal added to M: gamma, 1 on dead slots; ``[m]`` or ``[B, 1, m]`` (for
    ``live: [B, m]``, broadcast over the heads of ``[B, H, m, m]``)."""
    diag = torch.full((size,), float(gamma), dtype=like.dtype, device=like.device)
    if live is not None:
        diag = torch.where(live[:, None, :], diag, torch.ones_like(diag))
    return diag


def lemma3_by_pytorch(m: Tensor, diag: Tensor, pinv: PinvMethod, iterations: int,
                      init: PinvInit) -> Tensor:
    """``lemma3_inverse``'s PyTorch path, ``diag`` the ridge (broadcast against the
    diagonal of ``m: [..., m, m]``)."""
    m = m + torch.diag_embed(diag)
    d_inv_sqrt = m.sum(dim=-1).clamp_min(torch.finfo(m.dtype).tiny).rsqrt()  # [..., m]
    a = d_inv_sqrt[..., :, None] * m * d_inv_sqrt[..., None, :]
    a = flush_on_cpu(a)  # far landmarks: subnormal entries (flush.py)
    if pinv == "iterative":
        a_inv = iterative_pinv(a, iterations, init=init)
    elif pinv == "exact":
        a_inv = torch.linalg.pinv(a, hermitian=True)
    else:
        raise ValueError(f"pinv must be one of {PINV_METHODS}, got {pinv!r}.")
    return d_inv_sqrt[..., :, None] * a_inv * d_inv_sqrt[..., None, :]
