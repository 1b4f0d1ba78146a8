"""skyformer: efficient attention for long sequences.

Skyformer (Chen et al., NeurIPS 2021) replaces softmax attention by Gaussian
kernelized attention and approximates it with a modified Nystrom method; this
package implements it, the methods it is compared with, and the experiments that
compare them. Layout everywhere: ``[B, H, N, D]``; masks: ``key_padding_mask [B, N]``
bool, True = real token.
"""

from .functional import scaled_dot_product_attention
from .linalg.graph_launches import cuda_graph_launches
from .nn import MultiHeadAttention
from .ops import (
    kernelized_attention,
    nystrom_softmax_attention,
    skyformer_attention,
    softmax_attention,
)
from .registry import Capabilities, CapabilityError, attention, get_method, list_methods
from .sketch.rng import fold_in, random_key
from .torch_attention import TorchMultiheadAttention, replace_attention
from .weights import attention_weights

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "CapabilityError",
    "MultiHeadAttention",
    "TorchMultiheadAttention",
    "attention",
    "attention_weights",
    "cuda_graph_launches",
    "fold_in",
    "get_method",
    "kernelized_attention",
    "list_methods",
    "nystrom_softmax_attention",
    "random_key",
    "replace_attention",
    "scaled_dot_product_attention",
    "skyformer_attention",
    "softmax_attention",
]
