"""The modified Nystrom method on the softmax kernel (Skyformer Figure 1)."""

from .materialised import materialised_nystrom_softmax_attention
from .nystrom_softmax import NystromSoftmaxConfig, nystrom_softmax_attention

__all__ = [
    "NystromSoftmaxConfig",
    "materialised_nystrom_softmax_attention",
    "nystrom_softmax_attention",
]
