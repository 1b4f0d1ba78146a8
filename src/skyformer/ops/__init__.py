"""Attention functions on ``[B, H, N, D]``; importing this package registers them.

Each method has a fast function ``f(q, k, v, *, key_padding_mask=None,
generator=None, **options)`` and a naive ``reference_*`` version for tests.
Registration order (the order of ``list_methods()``) is the import order below:
exact methods, Skyformer, then the methods it is compared with.
"""

from .softmax import reference_softmax_attention, softmax_attention, softmax_scores
from .kernelized import gaussian_scores, kernelized_attention, reference_kernelized_attention
from .skyformer import skyformer_attention
from .nystrom_softmax import nystrom_softmax_attention
from .reference import reference_nystrom_softmax_attention, reference_skyformer_attention
from .nystromformer import nystromformer_attention, reference_nystromformer_attention
from .linformer import linformer_attention, reference_linformer_attention
from .linear import linear_attention, reference_linear_attention
from .informer import informer_attention, reference_informer_attention
from .bigbird import bigbird_attention, reference_bigbird_attention
from .performer import performer_attention
from .performer_ref import reference_performer_attention
from .reformer import reformer_attention
from .reformer_ref import reference_reformer_attention
from .kdeformer import kdeformer_attention
from .kdeformer_ref import reference_kdeformer_attention
from .scatterbrain import scatterbrain_attention
from .scatterbrain_ref import reference_scatterbrain_attention
from .skyformer_adaptive import skyformer_adaptive_attention
from .multipole import skyformer_multipole_attention, softmax_multipole_attention

__all__ = [
    "bigbird_attention",
    "gaussian_scores",
    "informer_attention",
    "kdeformer_attention",
    "kernelized_attention",
    "linear_attention",
    "linformer_attention",
    "nystrom_softmax_attention",
    "nystromformer_attention",
    "performer_attention",
    "reference_bigbird_attention",
    "reference_informer_attention",
    "reference_kdeformer_attention",
    "reference_kernelized_attention",
    "reference_linear_attention",
    "reference_linformer_attention",
    "reference_nystrom_softmax_attention",
    "reference_nystromformer_attention",
    "reference_performer_attention",
    "reference_reformer_attention",
    "reference_scatterbrain_attention",
    "reference_skyformer_attention",
    "reference_softmax_attention",
    "scatterbrain_attention",
    "skyformer_adaptive_attention",
    "skyformer_attention",
    "skyformer_multipole_attention",
    "softmax_attention",
    "softmax_multipole_attention",
    "softmax_scores",
]
