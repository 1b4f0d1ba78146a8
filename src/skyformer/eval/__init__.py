"""Experiments: approximation error, speed and memory (they use the registry, never ops internals)."""
