"""Call a registered method the way ``MultiHeadAttention`` does, for measurements.

Methods with a per-layer state (Linformer's learned E and F, Nystromformer's
convolution) get the keyword arguments of their state module, as inside a layer,
instead of what a bare call does without them (Linformer would draw Gaussian
projections on every call). The module is built once per (method, options, heads,
head dim, device, dtype) and kept, as a layer keeps its parameters, so repeated calls
(warm-up, then the measured call) measure the attention, not the initialisation.

Usable as a ``MemoryJob`` method: ``"skyformer.eval.layer_call:call_as_layer"`` with
``options={"method": name, **method_options}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from ..registry import check_capabilities

_STATES: dict[tuple, nn.Module] = {}


def call_as_layer(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    method: str,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    **options: Any,
) -> Tensor:
    """``method``'s function on ``q, k, v: [B, H, N, D]`` with its state module's
    arguments (built with parameters drawn from a fixed seed). Returns ``[B, H, Nq, Dv]``."""
    spec = check_capabilities(method, mask=key_padding_mask is not None)
    config = spec.make_config(**options)
    extra: dict[str, Any] = {}
    if spec.state is not None:
        key = (method, repr(config), q.shape[1], q.shape[-1], q.device, q.dtype)
        if key not in _STATES:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                _STATES[key] = spec.state(config, q.shape[1], q.shape[-1]).to(q.device, q.dtype)
        extra = _STATES[key](q, k)
    return spec.function(
        q, k, v, key_padding_mask=key_padding_mask, generator=generator,
        **dataclasses.asdict(config), **extra,
    )
