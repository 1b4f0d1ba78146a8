"""KDEformer (Zandieh et al., ICML 2023): LSH sparse blocks + importance-sampled residual."""

from .kdeformer import KDEformerConfig, kdeformer_attention

__all__ = ["KDEformerConfig", "kdeformer_attention"]
