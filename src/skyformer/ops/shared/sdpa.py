"""``torch.nn.functional.scaled_dot_product_attention`` as the exact methods call it.

SDPA's fused kernels (flash, memory-efficient, the CPU flash kernel) have no
forward-mode derivative: ``torch.func.jvp`` or ``jacfwd`` through them raises
NotImplementedError. Its math backend is composed of differentiable operators, so
calls under forward-mode AD run there (same values up to rounding, the [Nq, Nk]
scores formed whole); every other call lets SDPA choose its kernel.

The flash kernels (CPU and CUDA) take q, k, v of one head dim, CUDA's memory-efficient
kernel widths that are multiples of 8 (4 in float32) and any Dv: a value width Dv other
than the query's D sent a CPU call, and an unaligned one on CUDA, to the math backend
and its [Nq, Nk] scores. All three are then padded with zero columns (zero columns of q
and k change no logit, those of v are sliced off the output) to max(D, Dv) rounded up
to a multiple of ``WIDTH_MULTIPLE``: O((Nq + Nk) width) more memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...linalg.functional_ops import forward_mode_active
from ...linalg.launch_grid import cdiv

WIDTH_MULTIPLE = 8


def fused_width(n: int) -> int:
    """The least head dim >= n that every fused SDPA kernel takes: a multiple of
    ``WIDTH_MULTIPLE``."""
    return cdiv(n, WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **options: Any
         ) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, **options)``: q, k ``[.., N, D]``
    and v ``[.., Nk, Dv]`` padded to one head dim where a fused kernel needs it, and on
    the math backend under forward-mode AD (module docstring). Returns ``[.., Nq, Dv]``."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv or (q.device.type == "cuda" and not d % WIDTH_MULTIPLE
                   and not dv % WIDTH_MULTIPLE):
        return _fused_or_math(q, k, v, attn_mask, **options)
    if options.get("scale") is None:  # SDPA's default, read off the unpadded q
        options["scale"] = 1.0 / math.sqrt(d)
    width = fused_width(max(d, dv))
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    return _fused_or_math(q, k, v, attn_mask, **options)[..., :dv]


def _fused_or_math(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                   **options: Any) -> Tensor:
    """SDPA's own choice of kernel, the math backend under forward-mode AD."""
    if forward_mode_active():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask, **options)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, **options)
