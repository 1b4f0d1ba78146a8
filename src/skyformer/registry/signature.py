"""A method's public function, generated from its core and its config dataclass.

Every built-in method is written once as a *core*
``core(q, k, v, config, *, key_padding_mask=None, generator=None, **state_arguments)``
that reads its options from ``config`` (a frozen dataclass: the one definition of the
options and their defaults). Users call the *public* form, with the options as keyword
arguments::

    skyformer_attention(q, k, v, key_padding_mask=mask, generator=g, num_features=64)

``public_function`` builds that form: its signature (``inspect.signature``, ``help()``,
IPython and Jupyter show it) lists every config field with its default, followed by the
core's own state arguments (e.g. Linformer's ``proj_k``); a call builds and validates
the config, then runs the core.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from .autocast import call_core
from .binding import query_mask_argument, takes_keyword

CALL_ARGUMENTS = ("key_padding_mask", "query_padding_mask", "generator")


def config_fields(config: Any) -> dict[str, Any]:
    """A config's fields as a dict (shallow: unlike ``dataclasses.asdict``, no deep copy)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def takes_config(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a core: its fourth positional parameter is ``config``."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 and positional[3].name == "config"


def _state_parameters(core: Callable[..., Any]) -> list[inspect.Parameter]:
    """The core's keyword-only arguments beyond the common call arguments."""
    return [
        p for p in inspect.signature(core).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in CALL_ARGUMENTS
    ]


def _signature(core: Callable[..., Any], config_class: type) -> inspect.Signature:
    keyword = inspect.Parameter.KEYWORD_ONLY
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(name, positional, annotation="Tensor") for name in "qkv"]
    parameters += [
        inspect.Parameter("key_padding_mask", keyword, default=None, annotation="Tensor | None"),
        inspect.Parameter("query_padding_mask", keyword, default="auto",
                          annotation="Tensor | None | str"),
        inspect.Parameter("generator", keyword, default=None,
                          annotation="torch.Generator | Tensor | None"),
    ]
    parameters += [
        inspect.Parameter(f.name, keyword, default=_default(f), annotation=f.type)
        for f in dataclasses.fields(config_class)
    ]
    parameters += _state_parameters(core)
    return inspect.Signature(parameters, return_annotation="Tensor")


def _docstring(core: Callable[..., Any], config_class: type) -> str:
    """The core's docstring, then the option descriptions of the config and of the
    config classes it extends (``SkyformerConfig`` documents only what it adds)."""
    docs = []
    for cls in reversed(config_class.__mro__):
        doc = cls.__dict__.get("__doc__")
        if dataclasses.is_dataclass(cls) and doc and not doc.startswith(cls.__name__ + "("):
            docs.append(inspect.cleandoc(doc))
    head = _without_config_argument(inspect.cleandoc(core.__doc__ or ""))
    # a config without a docstring (a plugin's): its fields as the signature shows them
    options = "\n\n".join(docs) or "\n".join(_field_line(f)
                                             for f in dataclasses.fields(config_class))
    return f"{head}\n\nOptions (``{config_class.__name__}``, keyword arguments):\n\n{options}"


class _Made:
    """A default made by a factory, shown as its call (``list()``) in signatures."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.text = f"{getattr(factory, '__name__', repr(factory))}()"

    def __repr__(self) -> str:
        return self.text


def _default(field: dataclasses.Field) -> Any:
    """A config field's default as a signature shows it: the value, the factory's call,
    or none (a required option)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return _Made(field.default_factory)
    return inspect.Parameter.empty


def _field_line(field: dataclasses.Field) -> str:
    """``name: type = default`` of a config field as its declaration reads (a string
    annotation as written; a default factory as ``factory()``)."""
    kind = field.type if isinstance(field.type, str) else \
        inspect.formatannotation(field.type)
    default = _default(field)
    return f"{field.name}: {kind}" if default is inspect.Parameter.empty else \
        f"{field.name}: {kind} = {default!r}"


def _without_config_argument(doc: str) -> str:
    """``doc`` without the core's ``config:`` argument (and its continuation lines): the
    public function takes the options as keyword arguments, listed below it."""
    lines, skipping = [], False
    for line in doc.splitlines():
        if line.startswith("    config:"):
            skipping = True
        elif not (skipping and line.startswith("        ")):
            skipping = False
            lines.append(line)
    return "\n".join(lines)


class AttentionFunction(Protocol):
    """The type of a registered method's public function (``skyformer_attention``, what
    ``register`` returns): q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``, v ``[B, H, Nk, Dv]``
    -> ``[B, H, Nq, Dv]``, its options (and state arguments) keyword-only."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *,
                 key_padding_mask: Tensor | None = ...,
                 query_padding_mask: Tensor | str | None = ...,
                 generator: torch.Generator | Tensor | None = ...,
                 **options: Any) -> Tensor: ...


def public_function(
    core: Callable[..., Tensor],
    config_class: type,
    make_config: Callable[[dict[str, Any]], Any],
    check_call: Callable[[Any, Any, Any, Any], None] | None = None,
) -> AttentionFunction:
    """The public form of ``core``: options as keyword arguments, defaults from the config.

    Args:
        core: ``core(q, k, v, config, *, key_padding_mask, generator, **state_arguments)``.
        config_class: the frozen dataclass of the options.
        make_config: builds and validates the config from a dict of options (rejecting
            unknown names with a sentence).
        check_call: ``check_call(q, k, key_padding_mask, config)`` fails with a sentence
            where the call needs a capability the method lacks (``Method.check_call``), as
            every other route to the method does.
    Returns:
        ``f(q, k, v, *, key_padding_mask=None, generator=None, **options, **state_arguments)``
        with ``f.core`` = ``core`` and ``f.config_class`` = ``config_class``.
    """
    state_names = frozenset(p.name for p in _state_parameters(core))
    takes_query_mask = takes_keyword(core, "query_padding_mask")

    @functools.wraps(core, assigned=("__module__", "__name__", "__qualname__"), updated=())
    def public(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Tensor | None = None,
               query_padding_mask: Tensor | str | None = "auto", generator: Any = None,
               **kwargs: Any) -> Tensor:
        # a loop, not ``state_names & kwargs.keys()``: Dynamo 2.11 cannot trace that set
        # operation (frozenset & dict_keys), so torch.compile refused the direct functions
        state = {name: kwargs.pop(name) for name in state_names if name in kwargs}
        config = make_config(kwargs)
        if check_call is not None:
            check_call(q, k, key_padding_mask, config)
        query = query_mask_argument(getattr(core, "__name__", "the method"),
                                    takes_query_mask, query_padding_mask, q, k,
                                    key_padding_mask)
        return call_core(core, q, k, v, config, key_padding_mask=key_padding_mask,
                         generator=generator, **query, **state)

    public.__signature__ = _signature(core, config_class)  # type: ignore[attr-defined]
    public.__doc__ = _docstring(core, config_class)
    public.core = core  # type: ignore[attr-defined]
    public.config_class = config_class  # type: ignore[attr-defined]
    return public


def core_of(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """The core form of a registered function.

    A generated public function carries its core. A function written with its options as
    keyword arguments (how methods may be registered from outside the library) is
    adapted: the config's fields become its keyword arguments.
    """
    core = getattr(function, "core", None)
    return core if core is not None else _adapted(function)


@functools.cache  # one adapter a function: callers cache by it (methods._argument_names)
def _adapted(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``core_of`` of a function taking its options as keyword arguments."""
    # named as the function (its module and name: where a sentence points, what a
    # registration again compares), which inspect.unwrap gives back
    @functools.wraps(function, assigned=("__module__", "__name__", "__qualname__"),
                     updated=())
    def adapted(q: Tensor, k: Tensor, v: Tensor, config: Any, **kwargs: Any) -> Tensor:
        return function(q, k, v, **config_fields(config), **kwargs)

    return adapted
