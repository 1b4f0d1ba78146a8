"""An attention function that always fails, for ``bench`` runs where a method is never
timed (``module:function@target`` names)."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this method always fails")
