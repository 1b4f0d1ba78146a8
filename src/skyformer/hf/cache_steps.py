"""What the layers of one ``DecodingCache`` share about its steps: the mask readings
of the model step under way (``StepReadings``) and how far the layers got
(``StepProgress``), which tells a step refused before any layer changed (undone: the
cache goes on) from one that failed after some layer took its positions (every later
step refused)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor


class StepReadings:
    """The readings of one model step's attention masks, shared by a cache's layers: in
    a step the layers get the same mask tensor (or one per kind of layer: sliding-window
    and full layers alternate in some models) and hold the same positions, so what the
    mask checks read on the host (a wait for the device's queue on a GPU) is read once
    per step and mask instead of once per layer. A reading is known by its name, the
    mask (the very tensor, weakly held) and the step's positions; a step at other
    positions, reordering, cropping or resetting the cache forgets them."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.positions: tuple | None = None
        # id of a mask -> (the mask, weakly held; its readings by name)
        self.masks: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}

    def once(self, name: str, attention_mask: Tensor | None, positions: tuple,
             read: Callable[[], Any]) -> Any:
        """``read()``'s result, read at the first layer of the step that asks it of this
        mask (only results are kept: a reading that raises stops the step); without a
        mask tensor, ``read()``."""
        if not isinstance(attention_mask, Tensor):
            return read()
        if positions != self.positions:
            self.positions, self.masks = positions, {}
        held = self.masks.get(id(attention_mask))
        if held is None or held[0]() is not attention_mask:
            held = self.masks[id(attention_mask)] = (weakref.ref(attention_mask), {})
        if name not in held[1]:
            held[1][name] = read()
        return held[1][name]


class StepProgress:
    """How far a cache's layers got. In a model step the layers take the step's
    positions one after another, so at its ``update`` a layer holds ``front`` positions
    (the most any layer holds) or, once an earlier layer updated, ``front`` less the
    step's; anything else means an earlier step stopped between layers. ``taken_at`` is
    ``(positions after the step, the step's positions)`` of the last step that some
    layer took (stepped its state or kept its keys): a failed step that no layer took
    can be undone. ``failure`` says why a step failed after some layer took it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.front = 0
        self.taken_at: tuple[int, int] | None = None
        self.failure: str | None = None

    def check(self, held: int, new: int) -> None:
        """Refuse a layer's step of ``new`` positions over the ``held`` it holds once the
        layers hold different positions (that refusal then stays)."""
        if self.failure is None and self.front not in (held, held + new):
            self.failure = (
                f"an earlier step stopped between attention layers (an error in the model "
                f"after some layers had taken its positions): one layer holds {held} "
                f"positions, another {self.front}")
        if self.failure is not None:
            raise RuntimeError(
                f"DecodingCache: {self.failure}, so the layers hold different positions "
                f"and cannot take this step; start a new cache (DecodingCache(model)) or "
                f"call cache.reset().")
