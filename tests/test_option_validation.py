"""Every option of every registered method refuses values of the wrong kind with a
sentence naming the method and the option (``ops/shared/options.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from skyformer import get_method, list_methods


def _bad_values(default):
    """Values no option of this default's kind accepts."""
    if isinstance(default, bool):
        return ["yes", 1, None]
    if isinstance(default, int):
        return ["8", 1.5, True, -1]
    if isinstance(default, float):
        return ["0.1", math.inf, math.nan, True]
    if isinstance(default, str):
        return ["no-such-choice", 3]
    return [_ARBITRARY]  # an option defaulting to None: no option takes an arbitrary object


class _Arbitrary:
    """An object of a kind no option takes, with the same test id in every process
    (pytest-xdist requires the processes to collect the same ids)."""

    def __repr__(self) -> str:
        return "an-arbitrary-object"


_ARBITRARY = _Arbitrary()


CASES = [
    (method, field.name, bad)
    for method in list_methods()
    for field in dataclasses.fields(get_method(method).config_class)
    for bad in _bad_values(field.default)
]


@pytest.mark.parametrize(("method", "option", "bad"), CASES,
                         ids=[f"{m}-{o}-{b!r}" for m, o, b in CASES])
def test_a_bad_option_value_gets_a_sentence(method, option, bad):
    with pytest.raises((ValueError, TypeError)) as err:
        get_method(method).bind(**{option: bad})
    message = str(err.value)
    assert option in message, message


ITERATIVE = [m for m in list_methods() if "pinv_iterations" in get_method(m).option_names()]


@pytest.mark.parametrize("method", ITERATIVE)
def test_an_iteration_count_no_inverse_needs_is_refused_up_front(method):
    """Each iteration's matrices are kept for the backward pass: 10^6 iterations would
    ask for hundreds of GB before any sentence."""
    from skyformer.ops.shared.options import MAX_PINV_ITERATIONS

    get_method(method).bind(pinv_iterations=MAX_PINV_ITERATIONS)
    with pytest.raises(ValueError, match=f"pinv_iterations must be at most "
                                         f"{MAX_PINV_ITERATIONS}") as err:
        get_method(method).bind(pinv_iterations=10**6)
    assert method in str(err.value)


INTEGER_OPTIONS = [
    (method, field.name, field.default)
    for method in list_methods()
    for field in dataclasses.fields(get_method(method).config_class)
    if isinstance(field.default, int) and not isinstance(field.default, bool)
]


@pytest.mark.parametrize(("method", "option", "default"), INTEGER_OPTIONS,
                         ids=[f"{m}-{o}" for m, o, _ in INTEGER_OPTIONS])
def test_numpy_integers_are_taken_as_python_ints(method, option, default):
    """A sweep over ``np.arange`` passes ``np.int64``: it is taken as the int it equals
    (and written as one), not refused as "not a positive integer"."""
    import numpy as np

    value = getattr(get_method(method).bind(**{option: np.int64(default)}).config, option)
    assert value == default and type(value) is int
