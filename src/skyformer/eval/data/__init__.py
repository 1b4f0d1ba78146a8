"""Inputs of the experiments: real Q/K/V of the pretrained MiniLM-L6 model on the text that
ships with the package, GloVe vectors, Gaussian data."""

from .qkv import QKV, default_model_dir, extract_qkv, load_model, load_qkv
from .text import default_text, read_text, sentences

__all__ = [
    "QKV",
    "default_model_dir",
    "default_text",
    "extract_qkv",
    "load_model",
    "load_qkv",
    "read_text",
    "sentences",
]
