"""Multipole attention: exact near field + first-order far-field expansion around
k-means query centres (``skyformer_multipole``, ``softmax_multipole``)."""

from .multipole import (
    SkyformerMultipoleConfig,
    SoftmaxMultipoleConfig,
    multipole_with_choice,
    skyformer_multipole_attention,
    softmax_multipole_attention,
)

__all__ = [
    "SkyformerMultipoleConfig",
    "SoftmaxMultipoleConfig",
    "multipole_with_choice",
    "skyformer_multipole_attention",
    "softmax_multipole_attention",
]
