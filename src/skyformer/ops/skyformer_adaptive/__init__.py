"""Skyformer with adaptive landmarks: k-means query centres + ridge-leverage keys."""

from .skyformer_adaptive import SkyformerAdaptiveConfig, skyformer_adaptive_attention

__all__ = ["SkyformerAdaptiveConfig", "skyformer_adaptive_attention"]
