"""Informer ProbSparse self-attention (Zhou et al., AAAI 2021)."""

from .informer import InformerConfig, informer_attention

__all__ = ["InformerConfig", "informer_attention"]
