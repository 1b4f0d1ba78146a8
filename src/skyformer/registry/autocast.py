"""Run a method's core the way ``scaled_dot_product_attention`` runs under autocast.

Under ``torch.autocast`` SDPA casts its floating-point inputs other than float64 to the
autocast dtype and returns that dtype (float64 calls run in float64, as every
operation autocast lists). Every method does the same: the inputs are cast, autocast is turned
off inside the method (its own precision choices apply: the kernel methods compute half
inputs in float32, except exact kernelized attention, which hands bfloat16 to SDPA's
fused kernels, and their fused products write into buffers of that dtype), and the
output comes back in the autocast dtype. Outside autocast nothing changes.

It is also where token budgets are capped by the sequence length (``capped``): the one
place every call of every method passes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from ..amp import autocast_enabled, autocast_off, warn_if_compiled_backward_casts
from ..ops.shared.inputs import check_attention_inputs, check_generator, zero_padded_queries
from .guard import marked_by_core, show_nonfinite, zero_padding
from .outputs import check_output, registered_name


def call_core(core: Callable[..., Tensor], q: Any, k: Any, v: Any, config: Any,
              **kwargs: Any) -> Tensor:
    """``core(q, k, v, config, **kwargs)``, with the autocast rule above, the budget caps
    of ``capped`` and the padding and non-finite rules of ``guard``."""
    masks = (kwargs.get("key_padding_mask"), kwargs.get("query_padding_mask", "auto"))
    owned = in_the_library(core)
    # the library's methods check their inputs themselves (as autocast hands them over:
    # Llama's rotary step gives float32 q, k beside a bfloat16 v); one from outside gets
    # the same checks here, and its padded queries' rows are set to 0 after it
    outside = None if owned else check_attention_inputs(
        *as_autocast_hands_them(q, k, v), masks[0], method=registered_name(core),
        query_padding_mask=masks[1])
    if not owned and isinstance(q, Tensor):  # its generator too (an int was taken silently)
        check_generator(registered_name(core), kwargs.get("generator"), q.device)
    config = capped(config, q, k)
    q, k, v = zero_padding(q, k, v, *masks)
    if not isinstance(q, Tensor) or not q.is_floating_point():
        return core(q, k, v, config, **kwargs)
    causal = getattr(config, "causal", False) is True
    cast = autocast_dtype(q) is not None
    if cast and getattr(config, "FLOAT32_STEPS", True):  # a plugin's: maybe
        warn_if_compiled_backward_casts(q, k, v)
    q, k, v, precision = autocast_rule(q, k, v)
    with precision:
        out = _guarded(core, q, k, v, config, masks, owned, causal, cast, kwargs)
    return out if outside is None else zero_padded_queries(out, outside.query_valid)


def as_autocast_hands_them(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """``q, k, v`` cast as ``autocast_rule`` casts them for the method (as they are where
    they are no floating-point tensors: the checks then name what they are)."""
    if isinstance(q, Tensor) and q.is_floating_point():
        return autocast_rule(q, k, v)[:3]
    return q, k, v


def autocast_dtype(q: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts a call's inputs to on ``q``'s device, or None
    where it is off or ``q`` is float64, which autocast leaves as it is
    (``autocast_rule``; the capability check asks it too)."""
    device_type = q.device.type
    if q.dtype == torch.float64 or not autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_rule(q: Tensor, k: Any, v: Any) -> tuple[Tensor, Any, Any, AbstractContextManager]:
    """``(q, k, v, context)``: under ``torch.autocast`` on ``q``'s device the inputs
    cast to the autocast dtype and a context turning autocast off for the method; else
    (and for float64 inputs, which run as they are in float64) the inputs as they are
    and a context that turns autocast off where it is on."""
    device_type = q.device.type
    if not autocast_enabled(device_type):
        return q, k, v, nullcontext()
    dtype = autocast_dtype(q)
    if dtype is not None:
        q, k, v = (t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                   and t.dtype != torch.float64 else t for t in (q, k, v))
    return q, k, v, autocast_off(device_type)


def _guarded(core: Callable[..., Tensor], q: Tensor, k: Any, v: Any, config: Any,
             masks: tuple, owned: bool, causal: bool, cast: bool, kwargs: dict) -> Tensor:
    """``core``'s output with non-finite rows marked: by ``show_nonfinite``, or by the
    core itself where it says it marks them in this call (``guard.marked_by_core``)."""
    if marked_by_core(core, q, k, v, config):
        return core(q, k, v, config, **kwargs)
    out = core(q, k, v, config, **kwargs)
    if not owned:  # a method registered from outside: its output is checked
        out = check_output(core, out, q, v, autocast=cast)
    return show_nonfinite(out, q, k, v, *masks, owned=owned, causal=causal)


def in_the_library(defined: Any) -> bool:
    """Whether a method's core or config class is the library's (``skyformer.ops``): its
    core checks its inputs and returns a new tensor of its own, its config checks its
    options; a method registered from outside gets those checks here and in
    ``Method.make_config``, and might return a view of a buffer it keeps."""
    return getattr(defined, "__module__", "").startswith("skyformer.ops.")


def capped(config: Any, q: Any, k: Any) -> Any:
    """``config`` with its token budgets capped by the sequence: ``config.budget_caps(nq,
    nk)`` returns the options to change (e.g. no more landmarks than tokens), so that a
    budget far above the sequence costs what the sequence allows, not gigabytes. A
    config without ``budget_caps``, or within its caps, is returned unchanged."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() < 2:
        return config
    nq, nk = q.shape[-2], k.shape[-2]
    if torch._C._get_tracing_state() is not None:  # torch.jit.trace: sizes are tensors
        nq, nk = int(nq), int(nk)  # a traced graph is for these lengths anyway
    return capped_for(config, nq, nk)


def capped_for(config: Any, nq: int, nk: int) -> Any:
    """``capped`` for ``nq`` queries and ``nk`` keys: the options a call on that sequence
    runs with (what result files record)."""
    caps = getattr(config, "budget_caps", None)
    over = None if caps is None else caps(nq, nk)
    return dataclasses.replace(config, **over) if over else config
