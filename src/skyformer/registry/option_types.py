"""The types a config's annotations declare, checked for methods from outside the library.

The library's configs check their options in ``__post_init__`` with sentences of their
own (``ops/shared/options.py``). A plugin's config may check nothing: ``num_features="abc"``
then failed deep in its code (``'<=' not supported between 'Tensor' and 'str'``), and
``2.5`` for an ``int`` ran. ``Method.make_config`` checks each given value against its
field's annotation, read once per config class: ``int``, ``float`` (an int is taken),
``bool``, ``str``, other classes, ``X | None``, ``Literal[...]`` and the origin of a
generic (``tuple[int, ...]`` takes a tuple). Annotations it cannot read are not checked.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Accepted:
    """What one option takes: instances of ``classes`` (a bool only where ``bool`` is
    among them), or one of ``literals``; ``text`` says it in a sentence."""

    classes: tuple[type, ...]
    literals: tuple[Any, ...]
    text: str

    def takes(self, value: Any) -> bool:
        if any(value == literal and type(value) is type(literal) for literal in self.literals):
            return True
        if isinstance(value, bool) and bool not in self.classes:
            return False
        return isinstance(value, self.classes)


_ACCEPTED: dict[type, dict[str, Accepted]] = {}


def accepted_options(config_class: type) -> dict[str, Accepted]:
    """Option name -> what it takes, for the fields whose annotation can be read."""
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
    """What ``hint`` takes, or None where anything goes (``Any``, a type variable, an
    annotation of a kind not read here)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return Accepted((), typing.get_args(hint),
                        " or ".join(repr(a) for a in typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted(arg) for arg in typing.get_args(hint)]
        if any(part is None for part in parts):
            return None
        return Accepted(tuple(c for p in parts for c in p.classes),  # type: ignore[union-attr]
                        tuple(v for p in parts for v in p.literals),  # type: ignore[union-attr]
                        " or ".join(p.text for p in parts))  # type: ignore[union-attr]
    if hint is type(None) or hint is None:
        return Accepted((type(None),), (), "None")
    if hint is float:
        return Accepted((float, int), (), "a float")
    if isinstance(origin, type):  # tuple[int, ...], list[str]: the container's class
        return Accepted((origin,), (), f"a {origin.__name__}")
    if isinstance(hint, type) and hint is not typing.Any:
        article = "an" if hint.__name__[0] in "aeiou" else "a"
        return Accepted((hint,), (), f"{article} {hint.__name__}")
    return None
