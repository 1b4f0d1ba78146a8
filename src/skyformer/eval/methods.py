"""Attention implementations named by a string: a registered method or any function.

Experiments take a list of names. A name is either a registered method (``skyformer``)
or ``package.module:function`` for any ``f(q, k, v, **options)`` outside the registry
(e.g. a materialised reference kept for comparison), optionally followed by
``@softmax`` or ``@gaussian``: the exact attention it approximates, so that its error
can be measured. ``NamedAttention.prepare`` turns a name into the call an experiment
times: registered methods are bound once through the registry (``Method.bind``), and
``as_layer=True`` gives them the per-layer state a ``MultiHeadAttention`` layer owns
(Linformer's learned projections, Performer's kept features), initialised from a fixed
seed, so that what is measured is what a model runs.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..registry import exact_method, get_method
from ..registry.autocast import capped_for
from ..registry.capabilities import TARGETS
from ..registry.variants import is_variant, parse_variant

STATE_SEED = 0  # initialisation seed of the per-layer state of layer-like calls
# Options a method shares with the exact attention it approximates (softmax and
# kernelized take both): its error is measured against the target with the same ones.
TARGET_OPTIONS = ("causal", "scale")


class PreparedCall(Protocol):
    """``f(q, k, v, generator, key_padding_mask=None) -> out``: a call that
    ``NamedAttention.prepare`` bound; the mask ``[B, Nk]`` bool (True = real token)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, generator: torch.Generator | None,
                 /, key_padding_mask: Tensor | None = None) -> Tensor: ...


@dataclass(frozen=True)
class NamedAttention:
    """A resolved name: how to call it, what it approximates, which options it has."""

    name: str  # without the @target suffix: what a MemoryJob takes
    target: str | None
    exact: bool
    option_names: tuple[str, ...] | None  # None: unknown (a plain function)
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

    def options(self, num_features: int | None) -> dict[str, Any]:
        """``num_features`` where the method has it (else no option)."""
        if num_features is not None and "num_features" in (self.option_names or ()):
            return {"num_features": num_features}
        return {}

    def resolved_options(self, options: dict[str, Any], seq_len: int) -> dict[str, Any]:
        """Every option of a registered method with the defaults, the layer rules and the
        sequence's caps on token budgets filled in (what a call on ``seq_len`` tokens runs
        with, and what a result file records); a plain function's options as given."""
        if not self.registered:
            return dict(options)
        bound = get_method(self.name).bind(seq_len=seq_len, **options)
        return bound.method.options_of(capped_for(bound.config, seq_len, seq_len))

    def prepare(
        self, shape: tuple[int, int, int, int], options: dict[str, Any], *,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
        as_layer: bool = False,
    ) -> PreparedCall:
        """The call ``f(q, k, v, generator, key_padding_mask=None) -> out``
        (``PreparedCall``) for inputs of ``shape`` [B, H, N, D].

        Registered methods are bound once (options validated, fixed-length methods given
        ``max_seq_len = N``); with ``as_layer`` they get their per-layer state, built
        under ``STATE_SEED`` on ``device`` in ``dtype``. A plain function is given
        ``key_padding_mask`` only where a mask is passed (it need not take one)."""
        if self.function is not None:
            return self._plain_call(options)
        _, heads, seq_len, head_dim = shape
        bound = get_method(self.name).bind(heads, head_dim, seq_len=seq_len, **options)
        state = bound.new_state(seed=STATE_SEED) if as_layer else None
        if state is not None:
            state = state.to(device=device, dtype=dtype)
        return lambda q, k, v, g, key_padding_mask=None: bound(
            q, k, v, generator=g, state=state, key_padding_mask=key_padding_mask)

    def _plain_call(self, options: dict[str, Any]) -> PreparedCall:
        """``prepare`` of a plain function: ``generator`` where it takes one, the mask
        where one is given."""
        function, takes_generator = self.function, self.takes_generator

        def call(q: Tensor, k: Tensor, v: Tensor, g: torch.Generator | None,
                 key_padding_mask: Tensor | None = None) -> Tensor:
            extra: dict[str, Any] = {"generator": g} if takes_generator else {}
            if key_padding_mask is not None:
                extra["key_padding_mask"] = key_padding_mask
            return function(q, k, v, **extra, **options)

        return call


def call_shape(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    """The shape ``[B, H, N, D]`` that ``NamedAttention.prepare`` binds a call on ``q:
    [B, H, Nq, D]`` and ``k: [B, H, Nk, D]`` for, with ``N = max(Nq, Nk)``: the longest
    sequence the call sees (a fixed-length method holds one position per key; token
    budgets are capped by the longer of the two)."""
    b, h, nq, d = q.shape
    return b, h, max(nq, k.shape[-2]), d


def target_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of the exact target that a call with (resolved) ``options`` approximates:
    its causal masking and its logit scale, where it has them (``causal=True`` against
    causal softmax, ``scale=0.5`` against softmax at that scale)."""
    return {name: options[name] for name in TARGET_OPTIONS if name in options}


def exact_output(target: str, q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """The exact attention ``target`` ("softmax" or "gaussian") with ``options`` (its
    ``target_options``) on ``q, k, v`` in float32, or float64 for float64 inputs:
    ``[B, H, Nq, Dv]``. Half-precision inputs are upcast first, so that an error
    measured against it includes a method's rounding instead of sharing the target's."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        return exact_method(target).function(q.to(work), k.to(work), v.to(work), **options)


def resolve_all(specs: list[str] | tuple[str, ...]) -> list[NamedAttention]:
    """``resolve`` for each spec, in order, after the ``module:function`` ones: importing
    such a module may register a method that another spec names."""
    functions = {spec: resolve(spec) for spec in specs if ":" in spec.partition("@")[0]}
    return [functions.get(spec) or resolve(spec) for spec in specs]


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
        # the options a sweep may set: not num_features where it has no effect (linear)
        swept = tuple(o for o in method.option_names()
                      if o != "num_features" or method.budget_changes_output())
        return NamedAttention(name, caps.target, caps.exact, swept,
                              caps.half_precision)
    module_name, _, function_name = name.partition(":")
    if "[" in function_name:
        raise ValueError(
            f"{spec!r}: options in brackets are for registered methods; a function is "
            f"called with its own defaults (and num_features from --features). Give the "
            f"options as the function's defaults, or register it as a method (skyformer "
            f"--plugin MODULE; CONTRIBUTING.md, 'Adding a method').")
    try:
        function = getattr(_import_from_here_too(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"cannot load {name!r} ({err}); expected 'package.module:function', the module "
            f"importable from here (a file of the current folder, an installed package's "
            f"module, or one on PYTHONPATH)."
        ) from None
    if not callable(function):
        raise ValueError(f"{name!r} is not a function; expected 'package.module:function'.")
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without one (torch's SDPA): f(q, k, v)
        parameters = {}
    takes_generator = "generator" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
    option_names = _option_parameters(parameters)
    return NamedAttention(name, target or None, False, option_names, function=function,
                          takes_generator=takes_generator)


def unread_features_note(specs: Any, num_features: int | None) -> str | None:
    """A note where ``--features`` is given but no method of ``specs`` has a number of
    features to set (exact methods, linear attention): it would change nothing, without
    a word."""
    if num_features is None or not specs:
        return None
    if any(resolve(spec).options(num_features) for spec in specs):
        return None
    which = f"{specs[0]} has no" if len(specs) == 1 else f"none of {', '.join(specs)} has a"
    return (f"note: --features {num_features} changes nothing: {which} number of features "
            f"to set (exact methods and linear attention have none).")


def _option_parameters(parameters: Any) -> tuple[str, ...]:
    """The options of a function called as ``function(q, k, v, **options)``: its
    parameters after the first three positional ones, keyword-only or not (``def f(q,
    k, v, num_features=64)`` takes ``--features`` as ``def f(q, k, v, *,
    num_features=64)`` does), but ``generator`` and ``key_padding_mask``."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names, skipped = [], 0
    for name, info in parameters.items():
        if info.kind in positional and skipped < 3:
            skipped += 1  # q, k, v
        elif info.kind in (inspect.Parameter.KEYWORD_ONLY,
                           inspect.Parameter.POSITIONAL_OR_KEYWORD) \
                and name not in ("generator", "key_padding_mask"):
            names.append(name)
    return tuple(names)


def _import_from_here_too(module_name: str) -> Any:
    """``importlib.import_module``, finding the modules of the current folder too (as
    ``--plugin`` does; searched after the installed packages, which it shadows none of):
    ``skyformer bench --methods my_methods:f@softmax`` run beside ``my_methods.py``."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.split(".")[0]
        if err.name != top or os.getcwd() in sys.path or not (
                os.path.isfile(f"{top}.py") or os.path.isdir(top)):
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def refuse_repeated_methods(methods: Any, setting: str | None = None) -> None:
    """``refuse_repeats`` for a list of method names, comparing what they run: a variant's
    options in another order or spelling (``linear[eps=0.001,causal=false]`` and
    ``linear[causal=False, eps=1e-3]``) name one method, whose rows would repeat.
    ``setting``: how the sentences name the list (default ``methods (--methods)``)."""
    setting = setting or setting_name("methods")
    refuse_repeats(setting, methods)
    seen: dict[Any, str] = {}
    for name in methods or ():
        key = _runs(name)
        if key in seen:
            raise ValueError(f"{setting} lists {seen[key]!r} and {name!r}, one method with the "
                             f"same options; give it once.")
        seen[key] = name


def _runs(name: str) -> Any:
    """What ``name`` runs: a variant as (method, its options by name), else the name."""
    if not isinstance(name, str) or ":" in name or not is_variant(name):
        return name
    base, preset = parse_variant(name)
    return base, tuple(sorted(preset, key=lambda item: item[0]))


def setting_name(field: str, flag: str | None = None) -> str:
    """A setting of an experiment as its sentences name it: the config field and the
    command's flag, ``repeats (--repeats)``; ``flag`` where it is not the field's name
    (``analysis_seq_len (--analysis-len)``)."""
    return f"{field} (--{(flag or field).replace('_', '-')})"


def refuse_repeats(name: str, values: Any) -> None:
    """Fail in a sentence where the list ``values`` of setting ``name`` holds a value
    twice: each would be measured again, into rows of its own."""
    values = list(values or ())
    twice = sorted({str(x) for x in values if values.count(x) > 1})
    if twice:
        raise ValueError(f"{name} lists {', '.join(twice)} more than once; give each once.")
