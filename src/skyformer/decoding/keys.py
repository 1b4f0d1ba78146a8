"""Decoding state that keeps the keys and values: the exact methods, and any causal
method without a constant-size form (none of the built-in ones; ``forms.py``).

- Methods that take any ``attn_mask`` (``softmax``, ``kernelized``): the new queries
  attend to every kept key under the causal pattern shifted by the length, as a KV cache.
- Any other causal method (a newly registered one): its causal forward is recomputed
  over all positions and the new rows kept, so outputs are the full forward's exactly;
  the queries are kept too. Memory O(length), time per step that of the full forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import BoundMethod
from .state import DecodingState, append, padding_as_false


class KeyValueDecoding(DecodingState):
    """Keeps K, V (and Q where the forward is recomputed) of every position."""

    batched = ("q", "k", "v", "valid")

    def __init__(self, bound: BoundMethod, generator: torch.Generator | Tensor | None = None
                 ) -> None:
        super().__init__(bound.name, generator)
        self.masked = bound.method.capabilities.attn_mask
        self.bound = bound.replace(causal=not self.masked)
        self.q: Tensor | None = None
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.valid: Tensor | None = None  # [B, length] bool

    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        self._keep(q, k, v, key_valid)
        if not self.masked:
            return self._attend(q, q.shape[2])
        # the causal forward itself: with a mask its guard cannot tell causal, and would
        # mark the rows before a non-finite key too
        return self.bound.replace(causal=True)(q, k, v, key_padding_mask=key_valid,
                                               generator=self.key)

    def _extend(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        self._keep(q, k, v, key_valid)
        return self._attend(q, q.shape[2])

    def _keep(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> None:
        valid = padding_as_false(key_valid, q)
        if not self.masked:
            self.q = append(self.q, q, 2)
        self.k, self.v = append(self.k, k, 2), append(self.v, v, 2)
        self.valid = append(self.valid, valid, 1)

    def _attend(self, q: Tensor, n: int) -> Tensor:
        """Rows of the last ``n`` positions."""
        assert self.k is not None and self.v is not None and self.valid is not None
        if not self.masked:  # the whole forward again (a read of the mask on the host)
            assert self.q is not None
            valid = None if bool(self.valid.all()) else self.valid
            return self.bound(self.q, self.k, self.v, key_padding_mask=valid,
                              generator=self.key)[:, :, -n:]
        total = self.k.shape[2]
        position = torch.arange(total, device=q.device)
        sees = position[None, :] <= position[total - n:, None]  # [n, total]
        mask = sees[None, None] & self.valid[:, None, None, :]  # [B, 1, n, total]
        out = self.bound(q, self.k, self.v, attn_mask=mask, query_padding_mask=None,
                         generator=self.key)
        return torch.where(self.valid[:, None, total - n:, None], out, 0.0)
