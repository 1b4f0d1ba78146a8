"""Exact softmax attention (the ground truth of the softmax approximators)."""

from .softmax import SoftmaxConfig, softmax_attention

__all__ = ["SoftmaxConfig", "softmax_attention"]
