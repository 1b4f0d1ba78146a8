"""Tile and grid sizes of the Triton launches, computed on the host as plain integers.

``triton.next_power_of_2`` and ``triton.cdiv`` are constexpr functions in recent
Tritons (3.9: about 1.6 us a call on the host, which unwraps each argument as a
constexpr); a Skyformer forward + backward sizes its launches with about twenty calls.
These give the same integers for the positive sizes the launches use.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def tile_width(n: int, least: int = 16) -> int:
    """A tile dimension covering n: a power of two, at least ``least`` (``tl.dot``
    needs 16)."""
    return max(least, next_power_of_2(n))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0."""
    return -(-a // b)
