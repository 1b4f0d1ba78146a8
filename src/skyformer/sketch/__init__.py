"""Randomised sketches. Everything random takes a ``torch.Generator``."""

from .angular_lsh import (
    angular_hash,
    draw_hyperplanes,
    equal_size_buckets,
    gray_code_order,
    gray_code_rank,
    gray_rank_of,
    hamming_order,
)
from .landmarks import Landmarks, uniform_landmarks
from .lsh_blocks import (
    LshBlocks,
    gather_block_rows,
    gather_block_values,
    hamming_blocks,
    scatter_block_rows,
)
from .random_features import gaussian_projection, softmax_log_features
from .rotation_lsh import draw_rotations, rotation_hash

__all__ = [
    "Landmarks",
    "LshBlocks",
    "angular_hash",
    "draw_hyperplanes",
    "draw_rotations",
    "equal_size_buckets",
    "gather_block_rows",
    "gather_block_values",
    "gaussian_projection",
    "gray_code_order",
    "gray_code_rank",
    "gray_rank_of",
    "hamming_blocks",
    "hamming_order",
    "rotation_hash",
    "scatter_block_rows",
    "softmax_log_features",
    "uniform_landmarks",
]
