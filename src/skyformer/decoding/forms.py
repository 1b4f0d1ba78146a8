"""Which decoding state each method gets (``state.py``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import BoundMethod, CapabilityError
from ..registry.methods import Method, _capability_sentence
from .keys import KeyValueDecoding
from .nystrom import NystromSoftmaxDecoding, SkyformerDecoding
from .prefix_sums import LinearDecoding, PerformerDecoding
from .state import DecodingState

# Methods whose decoding state is constant in the generated length.
CONSTANT_MEMORY = ("linear", "performer", "skyformer", "nystrom_softmax")


def new_decoding_state(bound: BoundMethod, *, generator: torch.Generator | Tensor | None = None,
                       state: nn.Module | None = None) -> DecodingState:
    """An empty decoding state for ``bound`` (causal attention, ``state.py``).

    Args:
        bound: the method with its options (``get_method(name).bind(...)``); decoding is
            causal whatever its ``causal`` option says.
        generator: the random key of every step (a layer's fixed key or a generator);
            ``None`` draws one from torch's global generator at the first step.
        state: the layer's method state (``BoundMethod.new_state``), e.g. Performer's
            features, read once at the first step.
    Raises:
        CapabilityError: the method cannot attend causally.
    """
    if not isinstance(bound, BoundMethod):
        raise TypeError(_not_bound_sentence(bound))
    spec = bound.method
    if not spec.capabilities.causal:
        raise CapabilityError(_capability_sentence(spec.name, "causal").replace(
            "cannot do causal masking", "cannot decode (it cannot do causal masking)"))
    method = spec.base_name  # a variant ("performer[num_features=64]") is its method
    if method == "skyformer":
        return SkyformerDecoding(bound, generator)
    if method == "nystrom_softmax":
        return NystromSoftmaxDecoding(bound, generator)
    if method == "linear":
        return LinearDecoding(bound, generator)
    if method == "performer":
        return PerformerDecoding(bound, generator, state)
    return KeyValueDecoding(bound, generator)


def _not_bound_sentence(given: object) -> str:
    """What ``new_decoding_state`` says of a method name or an unbound ``Method``."""
    if isinstance(given, Method):
        call, got = f"get_method({given.name!r})", f"the unbound method {given.name!r}"
    elif isinstance(given, str):
        call, got = f"get_method({given!r})", f"the name {given!r}"
    else:
        call, got = "get_method(name)", type(given).__name__
    return (f"new_decoding_state takes a bound method, {call}.bind(...) with the method's "
            f"options, got {got}.")
