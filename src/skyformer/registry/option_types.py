"""The types a config's annotations declare, checked for methods from outside the library.

The library's configs check their options in ``__post_init__`` with sentences of their
own (``ops/shared/options.py``). A plugin's config may check nothing: ``num_features="abc"``
then failed deep in its code (``'<=' not supported between 'Tensor' and 'str'``), and
``2.5`` for an ``int`` ran. ``Method.make_config`` checks each given value against its
field's annotation, read once per config class, where the annotation is plain: ``int``
(any integral number, NumPy's too), ``float`` (any real number), ``bool`` (NumPy's too),
``str``, ``None``, ``X | None``, ``Literal[...]``, and a sequence for ``tuple[...]`` or
``list[...]`` (a config may turn a list into a tuple). Other annotations (an ``Enum`` a
config converts from a string, a class of the plugin's own) are left to the config.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Accepted:
    """What one option takes: a value one of ``tests`` passes, or equal to one of
    ``literals``; ``text`` says it in a sentence."""

    tests: tuple[Callable[[Any], bool], ...]
    literals: tuple[Any, ...]
    text: str

    def takes(self, value: Any) -> bool:
        return any(_same_literal(value, literal) for literal in self.literals) \
            or any(test(value) for test in self.tests)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool | np.bool_)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _same_literal(value: Any, literal: Any) -> bool:
    """``value == literal`` where both are flags or both are not (True is no 1), and an
    int literal is matched by an int only (2.0 is no count, as an ``int`` option says)."""
    return _is_bool(value) == _is_bool(literal) and value == literal \
        and (_is_int(value) or not _is_int(literal))


_PLAIN: dict[Any, tuple[Callable[[Any], bool], str]] = {
    int: (_is_int, "an int"),
    float: (_is_real, "a float"),
    bool: (_is_bool, "a bool"),
    str: (lambda value: isinstance(value, str), "a str"),
    type(None): (lambda value: value is None, "None"),
}

_ACCEPTED: dict[type, dict[str, Accepted]] = {}


def accepted_options(config_class: type) -> dict[str, Accepted]:
    """Option name -> what it takes, for the fields whose annotation is plain."""
    known = _ACCEPTED.get(config_class)
    if known is None:
        try:
            hints = typing.get_type_hints(config_class)
        except Exception:  # an annotation naming what its module cannot resolve
            hints = {}
        known = {}
        for field in dataclasses.fields(config_class):
            accepted = _accepted(hints.get(field.name, Any))
            if accepted is not None:
                known[field.name] = accepted
        _ACCEPTED[config_class] = known
    return known


def _accepted(hint: Any) -> Accepted | None:
    """What ``hint`` takes, or None where it is not plain (left to the config)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        args = typing.get_args(hint)
        return Accepted((), args, " or ".join(repr(a) for a in args))
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted(arg) for arg in typing.get_args(hint)]
        if any(part is None for part in parts):
            return None
        return Accepted(tuple(t for p in parts for t in p.tests),  # type: ignore[union-attr]
                        tuple(v for p in parts for v in p.literals),  # type: ignore[union-attr]
                        " or ".join(p.text for p in parts))  # type: ignore[union-attr]
    if origin in (tuple, list):
        return Accepted((_is_sequence,), (), f"a {origin.__name__} (a sequence)")
    plain = _PLAIN.get(None if hint is None else hint)
    return None if plain is None else Accepted((plain[0],), (), plain[1])
