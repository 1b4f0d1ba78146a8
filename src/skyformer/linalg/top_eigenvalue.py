"""The largest eigenvalue of symmetric PSD matrices by repeated squaring: no host wait.

``torch.linalg.eigvalsh`` checks the solver's status on the host, so on a GPU it waits
for the queued work. For a PSD matrix G of size n, with A_0 = G / tr G and
A_{k+1} = A_k^2 / tr(A_k^2) (each of trace 1),

    tr(G^(2^K))^(1 / 2^K) = lambda_max (1 + sum_{i>1} (lambda_i / lambda_max)^(2^K))^(1 / 2^K),

between lambda_max and n^(1 / 2^K) lambda_max: K = 40 squarings leave a relative error
below ln(n) 2^-40 (1e-11 at n = 65), float64's rounding of the products aside. Only
matrix products and traces: batched, compiled and vmapped as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

SQUARINGS = 40


def top_eigenvalue_psd(g: Tensor, squarings: int = SQUARINGS) -> Tensor:
    """lambda_max of each symmetric PSD ``g: [..., n, n]`` (0 for a zero matrix): ``[...]``,
    in g's dtype (float64 recommended: the squarings are exact to its rounding)."""
    tiny = torch.finfo(g.dtype).tiny
    trace = g.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(tiny)  # [...]
    a = g / trace[..., None, None]
    log_c = trace.log()  # G^(2^k) = c_k A_k: log c_{k+1} = 2 log c_k + log tr(A_k^2)
    for k in range(squarings):
        a = a @ a
        s = a.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(tiny)
        a = a / s[..., None, None]
        log_c = log_c + s.log() / 2.0 ** (k + 1)  # divided by 2^(k+1) as it goes: no overflow
    zero = g.diagonal(dim1=-2, dim2=-1).sum(-1) <= 0
    return torch.where(zero, 0.0, log_c.exp())
