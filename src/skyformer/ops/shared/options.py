"""Checks of option values, called from the configs' ``__post_init__``.

Each raises ``ValueError`` with a sentence naming the method, the option, what it must
be and what it got: ``"skyformer: num_features must be a positive integer, got 0."``.
"""

from __future__ import annotations

import math
import numbers

from ... import checks
from ...checks import is_integer as _is_int


def _is_number(value: object) -> bool:
    """A finite real number: int, float, or NumPy's scalars (inf and NaN would turn
    every output into NaN). Comparisons rather than ``math.isfinite``, which
    ``torch.compile(dynamic=True)`` cannot trace on the symbolic float a default
    becomes."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and -math.inf < value < math.inf  # type: ignore[operator]


def check_positive_int(method: str, name: str, value: object) -> None:
    checks.check_positive_int(f"{method}: {name}", value)


def check_optional_positive_int(method: str, name: str, value: object) -> None:
    if value is not None:
        check_positive_int(method, name, value)


def check_nonnegative_int(method: str, name: str, value: object) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{method}: {name} must be an integer >= 0, got {value!r}.")


def check_nonnegative_float(method: str, name: str, value: object) -> None:
    if not _is_number(value) or not value >= 0:  # type: ignore[operator]
        raise ValueError(f"{method}: {name} must be a finite number >= 0, got {value!r}.")


def check_probability(method: str, name: str, value: object) -> None:
    if not _is_number(value) or not 0.0 <= value <= 1.0:  # type: ignore[operator]
        raise ValueError(f"{method}: {name} must be a number in [0, 1], got {value!r}.")


def check_fraction(method: str, name: str, value: object) -> None:
    """A number in (0, 1] (NumPy's scalars too, as every float option takes them)."""
    if not _is_number(value) or not 0.0 < value <= 1.0:  # type: ignore[operator]
        raise ValueError(f"{method}: {name} must be a number in (0, 1], got {value!r}.")


def check_bool(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method}: {name} must be True or False, got {value!r}.")


def check_choice(method: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{method}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}."
        )


def check_scale(method: str, scale: object) -> None:
    """A softmax logit scale: a positive number, or ``None`` for 1/sqrt(head dim)."""
    if scale is not None and (not _is_number(scale) or not scale > 0):  # type: ignore[operator]
        raise ValueError(
            f"{method}: scale must be a finite positive number (the factor of the scores) "
            f"or None (the method's default), got {scale!r}.")


def check_finite_scale(method: str, scale: object) -> None:
    """A softmax logit scale (exact softmax, and the methods that form softmax weights of
    the scores themselves: Linformer, Informer, BigBird): any finite number, as
    ``scaled_dot_product_attention`` takes (0 weighs the visible keys alike; a negative
    one favours the farthest), or ``None`` for 1/sqrt(head dim). The kernel and feature
    methods need a positive one (``check_scale``): their Gaussian or random features,
    and the norms their expansions rest on, are not defined otherwise."""
    if scale is not None and not _is_number(scale):
        raise ValueError(
            f"{method}: scale must be a finite number (the factor of the scores) or None "
            f"(1/sqrt(head dim)), got {scale!r}.")


def check_positive_float(method: str, name: str, value: object) -> None:
    if not _is_number(value) or not value > 0:  # type: ignore[operator]
        raise ValueError(f"{method}: {name} must be a finite positive number, got {value!r}.")


# Budgets whose size shapes the result for any sequence (random features, projections,
# sampled columns, BigBird's blocks) are bounded by a constant, not by N: capping them by
# the padded width would make a sequence's output depend on how far its batch is padded.
# The bound stops a typo such as num_features=10**7 before it asks for gigabytes (the
# papers use at most a few hundred). Budgets that stop mattering beyond the sequence
# (landmarks, chunks, LSH blocks) are capped by N instead (``budget_caps`` of the configs).
MAX_BUDGET = 2**16
MAX_RANDOM_FEATURES = MAX_BUDGET


def check_budget(method: str, name: str, value: object) -> None:
    """A positive integer at most ``MAX_BUDGET`` (module comment)."""
    check_positive_int(method, name, value)
    if value > MAX_BUDGET:  # type: ignore[operator]
        raise ValueError(
            f"{method}: {name} must be at most {MAX_BUDGET} (the tensors it sizes hold N * "
            f"{name} values per head), got {value!r}."
        )


# The iterative inverses (Razavi's third-order step, Lemma 3) reach float64 precision
# within ~60 steps from any start they converge from (the error cubes each step; the
# papers use 6), and each step's matrices are kept for the backward pass: memory grows
# with the count, 10^6 steps ask for hundreds of GB.
MAX_PINV_ITERATIONS = 100


def check_pinv_iterations(method: str, value: object) -> None:
    """An integer in [0, ``MAX_PINV_ITERATIONS``] (comment above)."""
    check_nonnegative_int(method, "pinv_iterations", value)
    if value > MAX_PINV_ITERATIONS:  # type: ignore[operator]
        raise ValueError(
            f"{method}: pinv_iterations must be at most {MAX_PINV_ITERATIONS}, got "
            f"{value!r}: the iteration's error cubes each step, so more steps change "
            f"nothing, while each keeps its matrices for the backward pass; the papers "
            f"use 6.")


def check_random_features(method: str, value: object) -> None:
    check_budget(method, "num_features", value)
