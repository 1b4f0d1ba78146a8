"""Autoregressive decoding with a per-layer state (``state.py``): constant memory for
``linear``, ``performer`` and ``skyformer``, a key/value cache for the other causal
methods. ``MultiHeadAttention.new_cache`` and ``skyformer.hf.DecodingCache`` use it."""

from .forms import CONSTANT_MEMORY, new_decoding_state
from .state import DecodingState

__all__ = ["CONSTANT_MEMORY", "DecodingState", "new_decoding_state"]
