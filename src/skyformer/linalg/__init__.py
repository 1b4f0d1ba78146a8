"""Shared numerics: iterative pseudo-inverse, Gaussian kernel blocks and products with
them, Lemma 3 inverse."""

from .kernel_matmul import gaussian_kernel_matmul
from .kernels import gaussian_exponent, gaussian_kernel_block, half_sq_norm
from .nystrom import PINV_METHODS, lemma3_inverse
from .pinv import PINV_INITS, initial_inverse, inverse_residual, iterative_pinv

__all__ = [
    "PINV_INITS",
    "PINV_METHODS",
    "gaussian_exponent",
    "gaussian_kernel_block",
    "gaussian_kernel_matmul",
    "half_sq_norm",
    "initial_inverse",
    "inverse_residual",
    "iterative_pinv",
    "lemma3_inverse",
]
