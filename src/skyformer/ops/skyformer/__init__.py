"""Skyformer: kernelized attention by the modified Nystrom method (Chen et al. 2021)."""

from .materialised import materialised_skyformer_attention
from .skyformer import SkyformerConfig, skyformer_attention

__all__ = ["SkyformerConfig", "materialised_skyformer_attention", "skyformer_attention"]
