"""A method with some options set, named as one string: ``skyformer[pinv_gradient=implicit]``.

Everything that takes a method's name (``skyformer.attention``, ``MultiHeadAttention``,
the Hugging Face integration, ``skyformer compare`` / ``bench`` / ``approx``) takes such a
variant too, so that two settings of one method can be measured side by side on the same
inputs, in one run, and keep their names in the tables::

    skyformer bench --methods skyformer "skyformer[pinv_gradient=implicit]"

Inside the brackets, ``key=value`` items separated by commas; a value is read as JSON
(``64``, ``0.5``, ``true``, ``null``) or, if it is not JSON, kept as a string (``implicit``).
Options given at the call override the variant's.
"""

from __future__ import annotations

import json
import re
from typing import Any

_VARIANT = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<items>[^\[\]]*)\]$")
EXAMPLE = "skyformer[num_features=64,pinv_gradient=implicit]"


def is_variant(name: str) -> bool:
    """Whether ``name`` has the variant form ``base[...]``."""
    return "[" in name or "]" in name


def parse_variant(name: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """(base method name, the options set, in order) of ``name[key=value,...]``."""
    match = _VARIANT.match(name)
    if match is None:
        raise ValueError(f"{name!r}: a method with options set is written "
                         f"name[key=value,...], e.g. {EXAMPLE!r}.")
    items: list[tuple[str, Any]] = []
    for item in match["items"].split(","):
        key, equals, raw = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ValueError(f"{name!r}: expected key=value items inside the brackets, got "
                             f"{item.strip()!r} (e.g. {EXAMPLE!r}).")
        if key in dict(items):
            raise ValueError(f"{name!r}: the option {key!r} is set twice.")
        items.append((key, _value(raw.strip())))
    return match["base"].strip(), tuple(items)


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
