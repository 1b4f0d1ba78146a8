"""Autoregressive decoding with a per-layer state (``state.py``): constant memory for
``linear``, ``performer``, ``skyformer`` and ``nystrom_softmax``, a key/value cache for
the exact methods. ``MultiHeadAttention.new_cache`` and ``skyformer.hf.DecodingCache`` use it."""

from .forms import CONSTANT_MEMORY, new_decoding_state
from .state import DecodingState

__all__ = ["CONSTANT_MEMORY", "DecodingState", "new_decoding_state"]
