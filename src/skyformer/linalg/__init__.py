"""Shared numerics: iterative pseudo-inverse, Gaussian kernel blocks and products with
them, Lemma 3 inverse, materialised attention matrices, top singular subspaces,
whole-row gathers."""

from .implicit_inverse import GRADIENTS, implicit_iterations, implicit_pinv
from .kernel_backend import KERNELS
from .kernel_matmul import gaussian_kernel_matmul
from .kernels import gaussian_exponent, gaussian_kernel_block, half_sq_norm
from .nystrom import PINV_METHODS, landmark_inverse, lemma3_inverse
from .ones_column import with_ones_column
from .pinv import PINV_INITS, initial_inverse, inverse_residual, iterative_pinv
from .rows import gather_rows
from .scores import gaussian_scores, kernel_scale, logit_scale, softmax_scores
from .subspace import Subspace, top_singular_subspace

__all__ = [
    "GRADIENTS",
    "KERNELS",
    "PINV_INITS",
    "PINV_METHODS",
    "Subspace",
    "gather_rows",
    "gaussian_exponent",
    "gaussian_kernel_block",
    "gaussian_kernel_matmul",
    "gaussian_scores",
    "half_sq_norm",
    "implicit_iterations",
    "implicit_pinv",
    "initial_inverse",
    "inverse_residual",
    "iterative_pinv",
    "kernel_scale",
    "landmark_inverse",
    "lemma3_inverse",
    "logit_scale",
    "softmax_scores",
    "top_singular_subspace",
    "with_ones_column",
]
