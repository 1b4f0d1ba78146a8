"""Scatterbrain (Chen et al., NeurIPS 2021): LSH sparse + Performer low-rank."""

from .scatterbrain import ScatterbrainConfig, scatterbrain_attention

__all__ = ["ScatterbrainConfig", "scatterbrain_attention"]
