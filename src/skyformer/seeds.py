"""The seeds a user passes: integers that every generator the library seeds accepts."""

from __future__ import annotations

from .checks import integer_hint, is_integer

# torch.Generator.manual_seed takes at most 64 bits; numpy's and Python's generators
# take any integer >= 0. Negative seeds are refused too: numpy refuses them, and torch
# would wrap -1 onto 2^64 - 1, so two spellings would name one stream.
SEED_LIMIT = 2**64


def check_seed(name: str, value: object) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an integer in [0, 2^64)."""
    if not is_integer(value) or not 0 <= value < SEED_LIMIT:  # type: ignore[operator]
        hint = integer_hint(value, least=0)
        raise ValueError(f"{name} must be an integer from 0 to 2^64 - 1{hint}, got {value!r}.")
