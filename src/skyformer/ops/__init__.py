"""Attention functions on ``[B, H, N, D]``; importing this package registers them.

Each module holds a fast function ``f(q, k, v, *, key_padding_mask=None,
generator=None, **options)`` and a naive ``reference_*`` version for tests.
"""

from . import softmax, kernelized, skyformer, nystrom_softmax  # noqa: F401  (registration order = listing order)
from .kernelized import gaussian_scores, kernelized_attention, reference_kernelized_attention
from .nystrom_softmax import nystrom_softmax_attention
from .reference import reference_nystrom_softmax_attention, reference_skyformer_attention
from .skyformer import skyformer_attention
from .softmax import reference_softmax_attention, softmax_attention, softmax_scores
from .performer import performer_attention  # noqa: F401
from .reformer import reformer_attention  # noqa: F401
from .kdeformer import kdeformer_attention  # noqa: F401
from .scatterbrain import scatterbrain_attention  # noqa: F401

__all__ = [
    "gaussian_scores",
    "kernelized_attention",
    "nystrom_softmax_attention",
    "reference_kernelized_attention",
    "reference_nystrom_softmax_attention",
    "reference_skyformer_attention",
    "reference_softmax_attention",
    "skyformer_attention",
    "softmax_attention",
    "softmax_scores",
]
