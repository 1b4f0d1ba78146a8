"""Attention implementations named by a string: a registered method or any function.

Experiments take a list of names. A name is either a registered method (``skyformer``)
or ``package.module:function`` for any ``f(q, k, v, **options)`` outside the registry
(e.g. a materialised reference kept for comparison), optionally followed by
``@softmax`` or ``@gaussian``: the exact attention it approximates, so that its error
can be measured. Registered methods are called as inside ``MultiHeadAttention``
(``layer_call.call_as_layer``: methods with a per-layer state, such as Linformer's
learned projections, get it), so what is measured is what a model runs.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..registry import get_method
from .layer_call import call_as_layer

LAYER_CALL = "skyformer.eval.layer_call:call_as_layer"

TARGETS = ("softmax", "gaussian")


@dataclass(frozen=True)
class NamedAttention:
    """A resolved name: how to call it, what it approximates, which options it has."""

    name: str  # without the @target suffix: what a MemoryJob takes
    target: str | None
    exact: bool
    option_names: tuple[str, ...] | None  # None: unknown (a plain function)
    fixed_length: bool = False
    half_precision: bool = True
    function: Callable[..., Tensor] | None = None  # set for plain functions
    takes_generator: bool = True

    @property
    def registered(self) -> bool:
        return self.function is None

    @property
    def label(self) -> str:
        """Short name for tables: the registered name or the function's name."""
        return self.name.rpartition(":")[2]

    def options(self, seq_len: int, num_features: int | None) -> dict[str, Any]:
        """Options for one call: ``num_features`` where the method has it, and
        ``max_seq_len`` = the sequence length for fixed-length methods."""
        known = self.option_names or ()
        options: dict[str, Any] = {}
        if num_features is not None and "num_features" in known:
            options["num_features"] = num_features
        if self.fixed_length and "max_seq_len" in known:
            options["max_seq_len"] = seq_len
        return options

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, generator: torch.Generator | None,
                 options: dict[str, Any]) -> Tensor:
        if self.function is None:
            return call_as_layer(q, k, v, method=self.name, generator=generator, **options)
        if self.takes_generator:
            return self.function(q, k, v, generator=generator, **options)
        return self.function(q, k, v, **options)

    def job_spec(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(name, options) that make the same call from a ``memory.MemoryJob``."""
        if self.registered:
            return LAYER_CALL, {"method": self.name, **options}
        return self.name, dict(options)


def resolve(spec: str) -> NamedAttention:
    """Resolve ``name``, ``module:function`` or ``module:function@target``."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a method name must be a non-empty string, got {spec!r}.")
    name, _, target = spec.partition("@")
    if target and target not in TARGETS:
        raise ValueError(
            f"{spec!r}: the part after '@' names the exact target, one of {', '.join(TARGETS)}."
        )
    if ":" not in name:
        if target:
            raise ValueError(f"{spec!r}: registered methods know their target; drop '@{target}'.")
        method = get_method(name)
        caps = method.capabilities
        return NamedAttention(
            name, caps.target, caps.exact, method.option_names(), caps.fixed_length,
            caps.half_precision,
        )
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"cannot load {name!r} ({err}); expected 'package.module:function'."
        ) from None
    parameters = inspect.signature(function).parameters
    takes_generator = "generator" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
    option_names = tuple(
        p
        for p, info in parameters.items()
        if info.kind is inspect.Parameter.KEYWORD_ONLY
        and p not in ("generator", "key_padding_mask")
    )
    return NamedAttention(
        name,
        target or None,
        False,
        option_names,
        function=function,
        takes_generator=takes_generator,
    )
