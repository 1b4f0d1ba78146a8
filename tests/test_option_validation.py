"""Every option of every registered method refuses values of the wrong kind with a
sentence naming the method and the option (``ops/shared/options.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import skyformer
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


@pytest.mark.parametrize("given", ["landmarks", "num_landmarks", "nb_features", "proj_dim"])
def test_another_librarys_name_for_the_budget_points_to_num_features(given):
    """'landmarks' was answered with "did you mean 'landmark_stride'?", another option
    (a close spelling), and 'num_landmarks' with no suggestion at all."""
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=rf"^skyformer has no option '{given}' \(did you "
                                         rf"mean 'num_features'\? every approximate "):
        skyformer.attention(q, k, v, "skyformer", **{given: 4})
    with pytest.raises(ValueError, match=rf"^softmax has no option '{given}'; its options"):
        skyformer.attention(q, k, v, "softmax", **{given: 4})  # no budget to point to
    with pytest.raises(ValueError, match=rf"^linear has no option '{given}'; its options"):
        skyformer.attention(q, k, v, "linear", **{given: 4})  # one it takes and ignores


def test_hugging_face_and_seed_arguments_get_the_call_argument_they_mean():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"\(attention_mask: Hugging Face's mask goes to "
                                         r"each call as key_padding_mask, .* "
                                         r"\(attention_mask == 1\) to skyformer's calls"):
        skyformer.attention(q, k, v, "skyformer", attention_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"\(seed: pass generator=skyformer.random_key"
                                         r"\(seed\) when calling"):
        skyformer.attention(q, k, v, "skyformer", seed=0)
