"""The host's tile and grid sizes (``linalg.launch_grid``) equal Triton's own."""

from __future__ import annotations

import pytest

from skyformer.linalg.launch_grid import cdiv, next_power_of_2, tile_width

triton = pytest.importorskip("triton")


def test_next_power_of_2_is_tritons():
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(2**40 + 1) == 2**41
    assert [tile_width(n) for n in (1, 16, 17, 64, 100)] == [16, 16, 32, 64, 128]


def test_cdiv_is_tritons():
    for a in range(0, 300):
        for b in (1, 2, 3, 16, 17, 64, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
