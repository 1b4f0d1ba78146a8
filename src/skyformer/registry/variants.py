"""A method with some options set, named as one string: ``skyformer[pinv_gradient=implicit]``.

Everything that takes a method's name (``skyformer.attention``, ``MultiHeadAttention``,
the Hugging Face integration, ``skyformer compare`` / ``bench`` / ``approx`` /
``hf-eval``, ``skyformer lra train --attn``) takes such a variant too, so that two
settings of one method can be measured side by side on the same inputs, in one run, and
keep their names in the tables::

    skyformer bench --methods skyformer "skyformer[pinv_gradient=implicit]"

Inside the brackets, ``key=value`` items separated by commas. A value is a number
(``64``, ``0.5``, ``1e-3``, ``inf``, ``-inf``, ``nan``), ``true`` / ``false`` / ``null``
(or Python's ``True`` / ``False`` / ``None``), a quoted string, or else the bare word as a
string (``implicit``); no value holds a comma or a bracket. Options given at the call
override the variant's. The parser uses string methods alone, so that ``torch.compile``
traces a call that names a variant.
"""

from __future__ import annotations

from typing import Any

EXAMPLE = "skyformer[num_features=64,pinv_gradient=implicit]"
_WORDS = {"true": True, "True": True, "false": False, "False": False, "null": None,
          "None": None}


def is_variant(name: str) -> bool:
    """Whether ``name`` has the variant form ``base[...]``."""
    return "[" in name or "]" in name


def base_name(name: str) -> str:
    """The registered method a name stands for: a variant's without its brackets."""
    return name.partition("[")[0].strip()


def parse_variant(name: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """(base method name, the options set, in order) of ``name[key=value,...]``."""
    text = name.strip()
    base, bracket, rest = text.partition("[")
    items = rest[:-1]
    if not base.strip() or not bracket or not text.endswith("]") or "[" in items \
            or "]" in items:
        raise ValueError(f"{name!r}: a method with options set is written "
                         f"name[key=value,...], e.g. {EXAMPLE!r}.")
    options: list[tuple[str, Any]] = []
    for item in items.split(","):
        key, equals, raw = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ValueError(f"{name!r}: expected key=value items inside the brackets, got "
                             f"{item.strip()!r} (e.g. {EXAMPLE!r}).")
        if any(key == seen for seen, _ in options):
            raise ValueError(f"{name!r}: the option {key!r} is set twice.")
        options.append((key, _value(raw.strip())))
    return base.strip(), tuple(options)


def variant_name(name: str, options: dict[str, Any]) -> str:
    """``name`` (a method or a variant) with ``options`` added to its brackets, written so
    that ``parse_variant`` reads the same values back: ``variant_name("skyformer",
    {"num_features": 64})`` is ``"skyformer[num_features=64]"``; ``name`` itself where
    ``options`` is empty."""
    if not options:
        return name.strip()
    base, preset = parse_variant(name) if is_variant(name) else (name.strip(), ())
    items = [*preset, *options.items()]
    return f"{base}[{','.join(f'{key}={_written(value)}' for key, value in items)}]"


def canonical_variant(name: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(base method name, every option set, sorted by name) of ``name`` with ``options``
    (which win over the brackets'): one form for each way of writing the same setting,
    ``skyformer[num_features=16]``, ``skyformer`` with ``{"num_features": 16}``, options
    in another order or with spaces. ``variant_name(*canonical_variant(...))`` is its
    name."""
    base, preset = parse_variant(name) if is_variant(name) else (name.strip(), ())
    merged = {**dict(preset), **options}
    return base, dict(sorted(merged.items()))


def _written(value: Any) -> str:
    """``value`` as an item of a variant's brackets: a number or a word as it is, true /
    false / null, and a string that would read back as something else quoted."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str) and (_value(value) != value or value != value.strip()):
        return f'"{value}"'
    return str(value)


def option_value(raw: str) -> Any:
    """An option's value as written inside a variant's brackets (``64``, ``True``,
    ``null``, ``implicit``): what ``name[key=value]`` would set."""
    return _value(raw.strip())


def _value(raw: str) -> Any:
    """A number (``inf`` and ``nan`` too), a word of ``_WORDS``, a quoted string, or
    ``raw`` itself."""
    if raw in _WORDS:
        return _WORDS[raw]
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    unsigned = raw[1:] if raw[:1] in "+-" else raw
    if not unsigned.isascii():  # str.isdigit takes '²', which int() refuses; JSON has 0-9
        return raw
    if unsigned in ("inf", "nan"):  # as str() writes a float's infinities and NaN
        return float(raw)
    if unsigned.isdigit():
        return int(raw)
    if _is_decimal(unsigned):
        return float(raw)
    return raw


def _is_decimal(text: str) -> bool:
    """``1.5``, ``.5``, ``1.``, ``1e-3``, ``2.5E4`` (no sign in front)."""
    mantissa, e, exponent = text.lower().partition("e")
    if e:
        exponent = exponent[1:] if exponent[:1] in "+-" else exponent
        if not exponent.isdigit():
            return False
    whole, dot, fraction = mantissa.partition(".")
    digits = whole + fraction
    return digits.isdigit() and (bool(dot) or bool(e)) \
        and (whole == "" or whole.isdigit()) and (fraction == "" or fraction.isdigit())


def refuse_swept_option(name: str, preset: tuple[tuple[str, Any], ...], option: str,
                        sweep: str) -> None:
    """Fail in a sentence where a variant sets an ``option`` that ``sweep`` sets on every
    call (its rows would carry the variant's name with the sweep's values)."""
    if any(key == option for key, _ in preset):
        raise ValueError(f"{name}: {sweep} sets {option} on every call; drop it from the "
                         f"brackets.")


def refuse_learned_options(method: Any, command: str) -> None:
    """Fail in a sentence where ``method``'s options need learned weights of the layer's
    state (its config's ``state_needed_because``: Nystromformer's ``conv_kernel``), which
    ``command`` cannot measure: it holds the attention alone against exact attention, and
    weights at their initialisation are no part of it."""
    because = getattr(method.bind().config, "state_needed_because", None)
    if because is not None:
        raise ValueError(
            f"{method.name}: {because}, and {command} measures the attention against exact "
            f"attention without a layer to learn them; drop that option from the brackets, "
            f"or time it in a layer with skyformer bench, train it in one with skyformer "
            f"lra train.")
