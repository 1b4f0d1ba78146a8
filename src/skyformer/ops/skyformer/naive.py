"""Naive Skyformer: the lifted 2n x 2n kernel matrix and an explicit sub-sampling matrix.

Skyformer eqs. (4)-(6) and Lemma 3, one batch element at a time (``shared/nystrom_naive``).
O(n^2) memory: for tests.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...linalg import kernel_scale
from ...sketch import Landmarks
from ..shared.nystrom_naive import naive_modified_nystrom
from .skyformer import SkyformerConfig


def reference_skyformer_attention(
    q: Tensor, k: Tensor, v: Tensor, landmarks: Landmarks, *,
    key_padding_mask: Tensor | None = None, **options: Any,
) -> Tensor:
    """Naive Skyformer with the given landmarks; ``options`` as ``SkyformerConfig``.
    ``[B, H, Nq, Dv]``."""
    config = SkyformerConfig(**options)
    return naive_modified_nystrom(
        q, k, v, landmarks, key_padding_mask, kernel_scale(q.shape[-1], config.scale), config
    )
