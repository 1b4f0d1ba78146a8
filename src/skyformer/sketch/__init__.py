"""Randomised sketches. Everything random takes a ``torch.Generator``."""

from .landmarks import Landmarks, gather_rows, gather_values, uniform_landmarks

__all__ = ["Landmarks", "gather_rows", "gather_values", "uniform_landmarks"]
