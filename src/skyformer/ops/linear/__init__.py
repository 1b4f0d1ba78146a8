"""Linear attention with the elu(x) + 1 feature map (Katharopoulos et al., ICML 2020)."""

from .linear import LinearConfig, linear_attention

__all__ = ["LinearConfig", "linear_attention"]
