"""Performer (Choromanski et al., ICLR 2021): positive orthogonal random features (FAVOR+)."""

from .performer import PerformerConfig, PerformerFeatures, features_held, performer_attention

__all__ = ["PerformerConfig", "PerformerFeatures", "features_held", "performer_attention"]
