"""Exact Gaussian kernelized attention (Skyformer eq. (3)), the target of Skyformer."""

from .kernelized import KernelizedConfig, kernelized_attention
from .naive import reference_materialised_kernelized_attention

__all__ = [
    "KernelizedConfig",
    "kernelized_attention",
    "reference_materialised_kernelized_attention",
]
