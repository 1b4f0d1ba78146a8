"""Linformer (Wang et al. 2020): softmax attention over k projected keys and values."""

from .linformer import LinformerConfig, LinformerProjections, linformer_attention

__all__ = ["LinformerConfig", "LinformerProjections", "linformer_attention"]
