"""Naive modified Nystrom softmax: D~^-1 A~ V with A~ = E_Q C~ E_K from the lifted matrix.

Skyformer eqs. (4)-(6) applied to the softmax kernel, one batch element at a time
(``shared/nystrom_naive``). O(n^2) memory: for tests.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ...linalg.scores import logit_scale
from ...sketch import Landmarks
from ..shared.nystrom_naive import naive_modified_nystrom
from .nystrom_softmax import NystromSoftmaxConfig


def reference_nystrom_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, landmarks: Landmarks, *,
    key_padding_mask: Tensor | None = None, **options: Any,
) -> Tensor:
    """Naive modified-Nystrom softmax with the given landmarks; ``options`` as
    ``NystromSoftmaxConfig``. ``[B, H, Nq, Dv]``.

    Rows with D~_i <= normalizer_threshold * sum_s C(q_i, x_s) |(W C(X_S, K) E_K 1)_s|
    return the mean of the values (see ``nystrom_softmax``)."""
    config = NystromSoftmaxConfig(**options)
    s = logit_scale(q.shape[-1], config.scale)
    return naive_modified_nystrom(
        q, k, v, landmarks, key_padding_mask, math.sqrt(s), config,
        softmax_threshold=config.normalizer_threshold,
    )
