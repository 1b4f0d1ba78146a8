"""BigBird block-sparse attention (Zaheer et al., NeurIPS 2020)."""

from .bigbird import BigBirdConfig, bigbird_attention

__all__ = ["BigBirdConfig", "bigbird_attention"]
