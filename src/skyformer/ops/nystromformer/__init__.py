"""Nystromformer (Xiong et al., AAAI 2021): segment-means landmarks, three softmax kernels."""

from .nystromformer import NystromformerConfig, NystromformerConv, nystromformer_attention

__all__ = ["NystromformerConfig", "NystromformerConv", "nystromformer_attention"]
