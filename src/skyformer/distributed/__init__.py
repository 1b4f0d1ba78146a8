"""Sequence-parallel execution over ``torch.distributed`` process groups.

``sequence_parallel_attention`` runs one sequence sharded along N across processes with
communication whose size does not depend on N (landmark rows and m x Dv sums);
``MultiHeadAttention(..., process_group=group)`` uses it; ``count_communication``
measures the bytes sent; ``destroy_process_group`` ends a run. See docs/distributed.md.
"""

from .attention import run_sequence_parallel, sequence_parallel_attention
from .collectives import Traffic, count_communication
from .forms import FORMS
from .training import destroy_process_group, shard_bounds, sum_gradients

SEQUENCE_PARALLEL_METHODS = tuple(FORMS)

__all__ = [
    "SEQUENCE_PARALLEL_METHODS",
    "Traffic",
    "count_communication",
    "destroy_process_group",
    "run_sequence_parallel",
    "sequence_parallel_attention",
    "shard_bounds",
    "sum_gradients",
]
