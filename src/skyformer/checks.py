"""Checks of the integers a user passes (sizes, counts, lengths), shared by the layers,
the methods' options and the experiments' settings, and ``argparse`` types and checks of
the command lines (the CLI's and the examples').

Each raises ``ValueError`` with a sentence naming the setting, what it must be and what
it got: ``"MultiHeadAttention: dim must be a positive integer, got 0."``. ``True`` is
no integer here; a NumPy or 0-d torch integer is one to its user, so the sentence says
which kind is wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def is_integer(value: object) -> bool:
    """A Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def integer_hint(value: object, least: int = 1) -> str:
    """`` (a Python int: pass int(value))`` for a NumPy or torch integer scalar, else
    ``""`` (a float's or an array's trouble is not its type)."""
    if type(value).__module__ not in ("numpy", "torch") or getattr(value, "ndim", 0) != 0:
        return ""
    dtype = getattr(value, "dtype", None)  # NumPy's kind "i"/"u", torch.int*/uint*
    integral = getattr(dtype, "kind", None) in ("i", "u") or str(dtype).startswith(
        ("torch.int", "torch.uint"))
    # int() helps one the check would take as an int (from ``least``): a -3 is refused
    # for its value
    return " (a Python int: pass int(value))" if integral and int(value) >= least else ""


def check_positive_int(name: str, value: object, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a positive integer (or None, where ``optional``)."""
    if optional and value is None:
        return
    if not is_integer(value) or value <= 0:  # type: ignore[operator]
        kind = "a positive integer or None" if optional else "a positive integer"
        raise ValueError(f"{name} must be {kind}{integer_hint(value)}, got {value!r}.")


def check_positive_ints(name: str, values: Sequence[object]) -> None:
    """Refuse ``values`` unless it is a non-empty sequence of positive integers."""
    bad = [v for v in values if not is_integer(v) or v <= 0]  # type: ignore[operator]
    if len(values) == 0 or bad:  # not "not values": ambiguous for a NumPy array
        hint = next((integer_hint(v) for v in bad if integer_hint(v)), "")
        raise ValueError(f"{name} must be positive integers{hint}, got "
                         f"{bad if bad else 'none'}.")


def method_argument(text: str) -> str:
    """An ``argparse`` type for a method's name or variant (``skyformer[num_features=8]``):
    an unknown name or option is refused with argparse's one line and the registry's
    sentence, before any work (a script that trains one method after another reached a
    misspelt one after training the others)."""
    import argparse

    from .registry import get_method

    try:
        get_method(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def positive_int_argument(text: str) -> int:
    """An ``argparse`` type for counts and sizes: ``parser.add_argument("--steps",
    type=positive_int_argument)`` refuses 0 and negatives with argparse's one line,
    ``argument --steps: must be a positive integer, got 0``."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def shape_argument(fields: str) -> Callable[[str], tuple[int, ...]]:
    """An ``argparse`` type for a shape written ``2,2,64``, one positive integer for each
    of ``fields`` (``"B,H,D"``): ``type=shape_argument("B,H,D")`` refuses ``2,2`` or
    ``2,x,64`` with argparse's one line, ``argument --shape: must be B,H,D, positive
    integers, got '2,2'``."""
    import argparse

    names = fields.split(",")

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        try:
            values = tuple(int(part) for part in parts)
        except ValueError:
            values = ()
        if len(values) != len(names) or min(values) < 1:
            raise argparse.ArgumentTypeError(f"must be {fields}, positive integers, got "
                                             f"{text!r}")
        return values

    parse.__name__ = fields  # argparse names a type by it in some messages
    return parse


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def shape_dtype_argument(fields: str) -> Callable[[str], str]:
    """An ``argparse`` type for a shape and a floating dtype written ``4,16,64,bfloat16``,
    as the GPU scripts take them: ``type=shape_dtype_argument("B,H,D")`` refuses
    ``4,16,bf16`` with argparse's one line, ``argument --shape: must be B,H,D,dtype
    (dtype one of float32, ...), got '4,16,bf16'``. It returns the text as given, which
    the scripts print, store and split."""
    import argparse

    numbers = shape_argument(fields)

    def parse(text: str) -> str:
        head, _, dtype = text.rpartition(",")
        try:
            numbers(head)
        except argparse.ArgumentTypeError:
            dtype = ""
        if dtype not in FLOAT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"must be {fields},dtype (positive integers, dtype one of "
                f"{', '.join(FLOAT_DTYPES)}), got {text!r}")
        return text

    parse.__name__ = f"{fields},dtype"
    return parse


def positive_float_argument(text: str) -> float:
    """An ``argparse`` type for rates and scales (``--lr``): a finite number above 0,
    else argparse's one line, ``argument --lr: must be a positive number, got -1.0``
    (torch's optimisers refuse a negative rate in a traceback, and take NaN)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def heads_divide_width(parser: Any, dim: int, heads: int) -> None:
    """``parser.error`` where ``heads`` heads cannot split a model width ``dim`` (each
    takes ``dim / heads`` features): the layers refuse it after the data loads."""
    if dim % heads:
        parser.error(f"argument --heads: each of the {heads} heads takes dim / heads "
                     f"features, and --dim {dim} does not divide by {heads}")
