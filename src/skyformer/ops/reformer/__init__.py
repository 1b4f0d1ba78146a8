"""Reformer LSH attention (Kitaev et al., ICLR 2020)."""

from .reformer import ReformerConfig, reformer_attention

__all__ = ["ReformerConfig", "reformer_attention"]
