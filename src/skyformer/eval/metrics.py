"""Approximation error of attention outputs."""

from __future__ import annotations

import torch
from torch import Tensor


def relative_error(approx: Tensor, exact: Tensor, ord: int | str = 2) -> Tensor:
    """||approx - exact|| / ||exact|| per matrix, for ``[..., N, D]`` inputs: ``[...]``.

    ``ord=2``: spectral norm (largest singular value), the metric of Skyformer
    section 3.5 and KDEformer; ``ord="fro"``: Frobenius norm. Computed in float64.
    """
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(approx.shape)} vs {tuple(exact.shape)}.")
    a = approx.detach().to(torch.float64)
    e = exact.detach().to(torch.float64)
    num = torch.linalg.matrix_norm(a - e, ord=ord)
    den = torch.linalg.matrix_norm(e, ord=ord)
    return num / den.clamp_min(torch.finfo(torch.float64).tiny)
