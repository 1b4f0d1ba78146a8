"""``torch.nn.functional.scaled_dot_product_attention`` as the exact methods call it.

SDPA's fused kernels (flash, memory-efficient, the CPU flash kernel) have no
forward-mode derivative: ``torch.func.jvp`` or ``jacfwd`` through them raises
NotImplementedError. Its math backend is composed of differentiable operators, so
calls under forward-mode AD run there (same values up to rounding, the [Nq, Nk]
scores formed whole); every other call lets SDPA choose its kernel.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...linalg.functional_ops import forward_mode_active


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **options: Any
         ) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, **options)``, on the math
    backend under forward-mode AD (module docstring)."""
    if forward_mode_active():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask, **options)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, **options)
