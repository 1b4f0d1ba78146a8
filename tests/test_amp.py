"""``skyformer.amp``: autocast's state for any device type, eagerly and under
``torch.compile(fullgraph=True)`` (torch 2.11's dynamo could not trace
``torch.amp.is_autocast_available``: every compiled call failed at its first check)."""

from __future__ import annotations

import pytest
import torch

from skyformer.amp import AUTOCAST_DEVICE_TYPES, autocast_available, autocast_enabled, autocast_off


@pytest.mark.parametrize("device_type", sorted(AUTOCAST_DEVICE_TYPES | {"meta"}))
def test_the_known_device_types_are_torchs(device_type):
    assert autocast_available(device_type) == torch.amp.is_autocast_available(device_type)
    assert "cpu" in AUTOCAST_DEVICE_TYPES and "meta" not in AUTOCAST_DEVICE_TYPES


def test_meta_is_never_autocast_and_its_off_context_does_nothing():
    assert not autocast_enabled("meta")
    with autocast_off("meta"):
        assert torch.ones(2, device="meta").shape == (2,)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_state_traces_in_one_graph(enabled):
    def state(x):
        with autocast_off("cpu"):
            inner = autocast_enabled("cpu")
        return x + 1, autocast_enabled("cpu"), inner

    compiled = torch.compile(state, backend="eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        _, outer, inner = compiled(torch.ones(3))
    assert (outer, inner) == (enabled, False)
