"""Attention functions that fail, for ``bench`` runs (``module:function@target`` names):
one never timed, one that fails above 16 tokens, one whose output is not finite, and
ones that fail from their k-th call on (after their first call)."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this method always fails")


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention up to 16 tokens; longer inputs fail."""
    if q.shape[-2] > 16:
        raise RuntimeError("this method fails above 16 tokens")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def nan_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention with one NaN in the last head's first row: a method
    whose output is not finite on one head of the batch."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    spoil = torch.zeros_like(out)
    spoil[:, -1, 0, 0] = float("nan")
    return out + spoil  # out of place: SDPA's backward needs its output as it was


# calls of each function below above 16 tokens so far (a test resets it)
CALLS: dict[str, int] = {}


def _fails_from_call(name: str, k: int, error: type[Exception], q: torch.Tensor,
                     k_: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention; above 16 tokens, the k-th call and every later one raise
    ``error`` (a method that runs out of memory after its first calls)."""
    if q.shape[-2] > 16:
        CALLS[name] = CALLS.get(name, 0) + 1
        if CALLS[name] >= k:
            raise error(f"{name} fails from its call {k} on (call {CALLS[name]})")
    return torch.nn.functional.scaled_dot_product_attention(q, k_, v)


def fails_when_timed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Fails from its third call above 16 tokens: with --warmup 0 and the backward pass
    (a first call of the forward and of the step), its first timed one."""
    return _fails_from_call("fails_when_timed", 3, RuntimeError, q, k, v)


def fails_for_its_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Fails from its fifth call above 16 tokens: with --warmup 0 --repeats 1 and the
    backward pass (a first call of the forward and of the step, two timed ones), the
    forward call of its error."""
    return _fails_from_call("fails_for_its_error", 5, RuntimeError, q, k, v)


def breaks_when_timed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Raises a ``LookupError`` (no error of a call bench records) from its second call
    above 16 tokens: its first timed one, as ``fails_when_timed``."""
    return _fails_from_call("breaks_when_timed", 3, LookupError, q, k, v)
