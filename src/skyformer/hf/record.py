"""The attention setting a saved model records in its ``config.json``.

``model.save_pretrained(path)`` (and so ``push_to_hub`` and transformers' ``Trainer``
checkpoints) writes, under the key ``skyformer_attention``, what each attention layer
runs at the time of saving::

    "skyformer_attention": {"format": 1, "layers": [
        {"layer": 1, "module": "encoder.layer.1.attention.self", "method": "linformer",
         "options": {"num_features": 64}, "seed": 0, "seed_offset": 1}]}

one entry per attention module that runs a skyformer method (exact layers are left
out; a model running exact attention everywhere records nothing). ``seed_offset``
(rows with a seed) is what the layer's seed was offset by: its position in the part of
the model it was set on (``set_attention(model.vision_model, ..., seed=0)`` counts from
that tower's first layer), which loading restores. ``options`` are those
given to ``set_attention``: the ones the model fills in (``scale``, ``max_seq_len``,
``causal``) are filled in again on loading. ``skyformer.hf.from_pretrained(path)`` reads
the record and sets every layer up as saved before loading the per-layer parameters.

The record is made while saving, from the model as it runs then, so no change of
setting leaves it behind: ``import skyformer.hf`` wraps ``PreTrainedModel.save_pretrained``
to add it to the written config (the model's own config is left as it was).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn
from transformers import PreTrainedModel

from .attention import PER_LAYER, PREFIX, is_skyformer_implementation
from .layers import (
    EXACT,
    attention_modules,
    current_layer,
    install_layer,
    new_state,
    seed_offset,
)

RECORD_KEY = "skyformer_attention"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class Setting:
    """One ``set_attention`` call that rebuilds part of a recorded model: ``method`` with
    ``options`` and ``seed`` in the layers ``layers`` (``None``: every layer)."""

    method: str
    options: dict[str, Any]
    seed: int | None
    layers: tuple[int, ...] | None

    def __str__(self) -> str:
        where = "every layer" if self.layers is None else (
            f"layer{'s' if len(self.layers) > 1 else ''} {', '.join(map(str, self.layers))}")
        given = [f"{name}={value!r}" for name, value in self.options.items()]
        given += [] if self.seed is None else [f"seed={self.seed}"]
        return f"{self.method} in {where}" + (f" ({', '.join(given)})" if given else "")


def setting_record(model: nn.Module) -> dict[str, Any] | None:
    """The ``skyformer_attention`` entry for ``model`` as it runs now: one row per attention
    module running a skyformer method, ``None`` where every module runs exact attention."""
    rows = []
    for index, qualified, module in attention_modules(model):
        runs = module.config._attn_implementation
        layer = current_layer(module)
        if layer is not None and layer.implementation == runs:
            if layer.method == EXACT:
                continue
            given = layer.options()
            method, seed = layer.method, layer.seed
            options = {name: _python(given[name]) for name in layer.explicit}
        elif is_skyformer_implementation(runs) and runs != PER_LAYER:
            # the attn_implementation route: the method's defaults, set up when it runs
            method, options, seed = runs.removeprefix(PREFIX), {}, None
        else:
            continue
        row = {"layer": index, "module": qualified, "method": method,
               "options": {k: v for k, v in options.items() if _round_trips(v)},
               "seed": seed}
        if seed is not None and layer is not None:
            row["seed_offset"] = seed_offset(layer)
        unrecorded = sorted(set(options) - set(row["options"]))
        if unrecorded:  # a plugin method's option JSON cannot hold (a tuple, a function)
            row["unrecorded_options"] = unrecorded
        rows.append(row)
    return {"format": RECORD_FORMAT, "layers": rows} if rows else None


def _python(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (``scale=np.float64(0.1)`` is 0.1),
    which JSON writes; anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _round_trips(value: Any) -> bool:
    """Whether JSON gives ``value`` back as it is (a tuple comes back a list)."""
    try:
        back = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False
    return type(back) is type(value) and back == value


@contextmanager
def _recorded(model: nn.Module) -> Iterator[None]:
    """``model.config`` holds the record of ``model`` while saving, then what it held."""
    config = model.config
    try:
        record = setting_record(model)
    except ValueError:  # no attention module skyformer.hf can set: nothing to record
        yield
        return
    except Exception as err:  # never lose a checkpoint to its record
        warnings.warn(f"skyformer.hf could not record the attention setting of "
                      f"{type(model).__name__} ({type(err).__name__}: {err}); it is saved "
                      f"without one, so load it with skyformer.hf.from_pretrained(path, "
                      f"method, ...).", UserWarning, stacklevel=4)
        record = None
    held = config.__dict__.get(RECORD_KEY, _NOTHING)
    config.__dict__.pop(RECORD_KEY, None)
    if record is not None:
        setattr(config, RECORD_KEY, record)
    try:
        yield
    finally:
        config.__dict__.pop(RECORD_KEY, None)
        if held is not _NOTHING:
            config.__dict__[RECORD_KEY] = held


_NOTHING = object()
_SAVING = threading.RLock()  # a save may save the models it holds


def record_settings_when_saving() -> None:
    """Make ``PreTrainedModel.save_pretrained`` write each model's record (module
    docstring) into the config it saves. Idempotent."""
    save = PreTrainedModel.save_pretrained
    if getattr(save, "_skyformer_recorded", False):
        return

    @functools.wraps(save)
    def save_pretrained(self, *args, **kwargs):
        # one save at a time: two saves of one model in two threads each put the record
        # in its config and then what it held, which was the other save's record
        with _SAVING, _recorded(self):
            return save(self, *args, **kwargs)

    save_pretrained._skyformer_recorded = True
    PreTrainedModel.save_pretrained = save_pretrained


def read_record(record: Any, where: str) -> list[dict[str, Any]]:
    """The rows of a ``skyformer_attention`` entry read from ``where`` (a config.json),
    checked; a sentence naming the entry and the fix where it is not one this reads."""
    def refuse(what: str) -> ValueError:
        return ValueError(
            f"{where}: its {RECORD_KEY!r} entry {what}, so the setting it was saved with "
            f"cannot be read back; pass the method: skyformer.hf.from_pretrained(path, "
            f"method, ...).")

    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise refuse(f"is not of format {RECORD_FORMAT} (a newer skyformer's, or edited)")
    rows = record.get("layers")
    if not isinstance(rows, list) or not rows:
        raise refuse("lists no layers")
    for row in rows:
        if not (isinstance(row, dict) and _is_index(row.get("layer"))
                and isinstance(row.get("method"), str) and isinstance(row.get("options"), dict)
                and (row.get("seed") is None or _is_index(row.get("seed")))
                and (row.get("seed_offset") is None or _is_index(row.get("seed_offset")))):
            raise refuse(f"has a row without layer, method, options and seed (and a "
                         f"seed_offset of 0 or more, where given) ({row!r})")
        if row.get("unrecorded_options"):
            raise refuse(f"could not hold the option{'s' * (len(row['unrecorded_options']) > 1)}"
                         f" {', '.join(map(str, row['unrecorded_options']))} of "
                         f"{row['method']} in layer {row['layer']} (not JSON)")
    return rows


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _key(row: dict[str, Any]) -> str:
    return json.dumps([row["method"], row["options"], row["seed"]], sort_keys=True)


def _grouped(rows: list[dict[str, Any]]) -> list[Setting]:
    """The record's rows as settings, in the order first recorded, each with its layer
    numbers (a decoder block's self- and cross-attention share one)."""
    groups: dict[str, Setting] = {}
    for row in rows:
        old = groups.get(_key(row)) or Setting(row["method"], row["options"], row["seed"], ())
        layers = old.layers if row["layer"] in old.layers else (*old.layers, row["layer"])
        groups[_key(row)] = Setting(old.method, old.options, old.seed, layers)
    return list(groups.values())


class _AmbiguousLayer(ValueError):
    """Modules sharing a layer number ran different settings (``settings_of``)."""


def settings_of(rows: list[dict[str, Any]], model: nn.Module, where: str) -> list[Setting]:
    """The ``set_attention`` calls that set ``model`` up as the record's ``rows`` say,
    refused with a sentence where calls by layer number cannot (the modules sharing a
    layer number, as an encoder layer and a decoder block of one number, ran different
    settings: ``_AmbiguousLayer``; a model of other layers)."""
    modules: dict[int, int] = {}
    for index, _, _ in attention_modules(model):
        modules[index] = modules.get(index, 0) + 1
    keys_at: dict[int, list[str]] = {}
    for row in rows:
        keys_at.setdefault(row["layer"], []).append(_key(row))
    for index, keys in sorted(keys_at.items()):
        if index not in modules:
            raise ValueError(f"{where} records a setting for layer {index}, and this model's "
                             f"layers are {min(modules)}..{max(modules)}: load it with the "
                             f"model class it was saved from, or pass the method.")
        if len(set(keys)) > 1 or len(keys) != modules[index]:
            raise _AmbiguousLayer(
                f"{where} records different settings for the {modules[index]} attention "
                f"modules of layer {index}, which set_attention by layer number cannot "
                f"rebuild: set it up with skyformer.hf.from_pretrained(path, 'exact'), one "
                f"set_attention call for each setting, then skyformer.hf.load_state(model, "
                f"path).")
    settings = _grouped(rows)
    if len(settings) == 1 and set(settings[0].layers) == set(modules):
        return [Setting(settings[0].method, settings[0].options, settings[0].seed, None)]
    return [Setting(s.method, s.options, s.seed, tuple(sorted(s.layers))) for s in settings]


def placements(rows: list[dict[str, Any]], model: nn.Module, where: str
               ) -> list[tuple[nn.Module, Setting]]:
    """``(part, setting)``: the ``set_attention(part, ...)`` calls that rebuild the
    record's ``rows``: on ``model``, or, where a layer number names modules of both parts
    of an encoder-decoder that ran different settings (a method set on
    ``model.get_encoder()`` alone), on each part, as it was set. The rows' module names
    say which part a row is of (the name in a model with a head, ``model.encoder...``,
    ends with the name in the base model, ``encoder...``, or the other way round)."""
    try:
        return [(model, setting) for setting in settings_of(rows, model, where)]
    except _AmbiguousLayer:
        parts = [getattr(model, getter)() for getter in ("get_encoder", "get_decoder")
                 if callable(getattr(model, getter, None))]
        parts = [part for part in parts if part is not None and part is not model]
        if not parts:
            raise
    names = {id(module): name for name, module in model.named_modules()}
    placed, claimed = [], 0
    for part in parts:
        own = [names[id(module)] for _, _, module in attention_modules(part)]
        part_rows = [row for row in rows
                     if any(_same_module(row.get("module"), name) for name in own)]
        claimed += len(part_rows)
        if part_rows:
            placed += [(part, setting) for setting in settings_of(part_rows, part, where)]
    if claimed != len(rows):
        raise ValueError(f"{where} records attention modules that are in neither part of "
                         f"this model: load it with the model class it was saved from, or "
                         f"pass the method.")
    return placed


def restore_seed_offsets(rows: list[dict[str, Any]], model: nn.Module) -> None:
    """Give each recorded layer of ``model`` (set up by ``placements``) the offset its
    seed had when saved, and its per-layer state drawn again under that seed: a layer
    set on one part (CLIP's ``vision_model``) counted from that part's first layer,
    which ``set_attention`` on the whole model by layer number cannot give."""
    for _, name, module in attention_modules(model):
        row = next((r for r in rows if _same_module(r.get("module"), name)), None)
        layer = current_layer(module)
        if row is None or row.get("seed_offset") is None or layer is None \
                or layer.seed is None or seed_offset(layer) == row["seed_offset"]:
            continue
        moved = dataclasses.replace(layer, position=row["seed_offset"])
        install_layer(module, moved, None if layer.bound is None
                      or layer.bound.method.state is None else new_state(module, moved))


def _same_module(recorded: Any, name: str) -> bool:
    """Whether a row's module name and a module's name in this model name one module
    (one of them may carry a head model's prefix)."""
    return isinstance(recorded, str) and (
        recorded == name or recorded.endswith("." + name) or name.endswith("." + recorded))


def describe_record(rows: list[dict[str, Any]]) -> str:
    """The record's settings in one line, for sentences: ``"linformer in layers 0, 1
    (num_features=8, seed=0)"``."""
    return "; ".join(map(str, _grouped(rows)))
