"""Loading a model with a method set, and the per-layer state it saved.

- ``from_pretrained(path, method, ...)``: transformers' loader and ``set_attention`` in
  one call, so a method that cannot serve the model (e.g. a decoder and a method without
  causal masking) fails at load; a model saved with skyformer settings gets them back.
- ``load_state(model, path)``: the per-layer state (Performer's features, Linformer's
  projections, ...) from the weights that ``save_pretrained`` wrote, in safetensors or
  ``.bin`` files, sharded or not.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from ..registry import get_method, list_methods
from ..registry.methods import option_suggestion, refuse_misspelt_arguments
from ..registry.variants import is_variant
from .attention import (
    PER_LAYER,
    implementation_name,
    is_skyformer_implementation,
    make_first_forward_layers,
    register_methods,
)
from .layers import (
    EXACT,
    STATE_NAME,
    attention_modules,
    check_setting_arguments,
    resolve_method_name,
)
from .model import _ORIGINAL, _implementation, check_layers, describe, set_attention
from .record import (
    RECORD_KEY,
    describe_record,
    placements,
    read_record,
    restore_seed_offsets,
)


def _refuse_missing_folder(path: str | Path) -> None:
    """A sentence for a path that names no folder: transformers takes what is not one
    for a Hub repository id and answers with the Hub's rules for those ("Repo id must
    be in the form 'repo_name'..."). What reads as a Hub id (``bert-base-uncased``,
    ``sentence-transformers/all-MiniLM-L6-v2``) goes on to it."""
    text = str(path)
    if Path(text).expanduser().is_dir():
        return
    if Path(text).expanduser().exists():
        raise NotADirectoryError(f"{text} is a file; from_pretrained takes the folder that "
                                 f"save_pretrained wrote (its config.json and weights).")
    # a Hub id is "name" or "org/name": one slash at most, and no path's own marks
    if isinstance(path, Path) or text.startswith(("/", "~", ".")) or "\\" in text \
            or text.count("/") > 1:
        raise FileNotFoundError(f"{text} does not exist; pass the folder that "
                                f"save_pretrained wrote (or a model's folder).")


def from_pretrained(
    path: str | Path,
    method: str | None = None,
    *,
    layers: Iterable[int] | int | None = None,
    seed: int | None = None,
    auto_class: Any = None,
    model_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Load a model from a local folder with ``method`` in ``layers`` (default all), or
    without ``method`` as it was saved.

    Like ``auto_class.from_pretrained(path, attn_implementation=..., **model_kwargs)``
    followed by ``set_attention``, so an unsuitable method fails at load time (a half
    precision ``dtype`` too). ``method=None``: every layer as the folder's config records
    it (``skyformer.hf.record``: what each layer ran when ``save_pretrained`` wrote it,
    with its options and seed; refused with a sentence where it records nothing).
    ``auto_class`` defaults to the class the folder's config names (its first
    ``architectures`` entry that transformers has: ``LlamaForCausalLM`` for a saved
    decoder, with its head), else ``transformers.AutoModel``; pass e.g.
    ``AutoModel`` for the model without its head. ``model_kwargs``: keyword arguments of the
    transformers loader (``dtype``, ``device_map``, ``revision``, ...), all but
    ``attn_implementation``, which the method sets. The per-layer state of a method
    (``skyformer_state``) is made on the device and dtype of each attention module and
    loaded from the folder's weights.
    """
    _refuse_missing_folder(path)
    register_methods()
    model_kwargs = _loader_kwargs(model_kwargs)
    auto_class = auto_class or _saved_class(path, model_kwargs)
    if method is None:
        return _as_recorded(path, layers, seed, options, auto_class, model_kwargs)
    name = resolve_method_name(method)
    _refuse_loader_keywords(name, options)
    check_setting_arguments(name, seed, options)  # before the model is loaded
    # a variant is no registered implementation: set_attention gives it per layer
    whole = layers is None and name != EXACT and not is_variant(name)
    initial = implementation_name(name) if whole else "sdpa"
    model, record = _load(auto_class, path, initial, model_kwargs)
    if name != EXACT:
        set_attention(model, name, layers=layers, seed=seed, **options)
        try:
            load_saved_state(model, path, name, **_weights_choice(model_kwargs))
        except ValueError as err:
            saved = _recorded_settings(record)
            if saved is None:
                raise
            raise ValueError(f"{err} Its config records {saved}, which skyformer.hf."
                             f"from_pretrained(path) sets up.") from None
    else:  # every layer runs the model's own attention already
        check_layers(model, layers)
    return model


def _load(auto_class: Any, path: str | Path, implementation: str,
          model_kwargs: dict[str, Any]) -> tuple[PreTrainedModel, Any]:
    """The transformers loader's model with ``implementation``, and the record of the
    setting it was saved with, taken off its config (what the model runs decides what
    is saved next)."""
    model = auto_class.from_pretrained(path, attn_implementation=implementation,
                                       **model_kwargs)
    model.__dict__[_ORIGINAL] = "sdpa"
    return model, model.config.__dict__.pop(RECORD_KEY, None)


def _recorded_settings(record: Any) -> str | None:
    """A record's settings in words, ``None`` where there is none this reads."""
    try:
        return describe_record(read_record(record, "config.json"))
    except ValueError:
        return None


def _as_recorded(path: str | Path, layers: Any, seed: Any, options: dict[str, Any],
                 auto_class: Any, model_kwargs: dict[str, Any]) -> PreTrainedModel:
    """``from_pretrained(path)``: the model with every layer set up as the folder's
    config records, and the per-layer parameters loaded."""
    if layers is not None or seed is not None or options:
        given = [*(["layers"] if layers is not None else []),
                 *(["seed"] if seed is not None else []), *options]
        raise TypeError(
            f"from_pretrained(path) sets every layer up as it was saved, so it takes no "
            f"{', '.join(given)}; to choose them, pass the method: "
            f"skyformer.hf.from_pretrained(path, method, ...).")
    record, where = _saved_record(path, model_kwargs)
    if record is None:
        raise ValueError(
            f"{where} records no skyformer attention setting (saved from a model running "
            f"exact attention, or by transformers without skyformer.hf imported); pass "
            f"the method: skyformer.hf.from_pretrained(path, method, ...) ('exact' for "
            f"the model's own attention).")
    rows = read_record(record, where)
    model, _ = _load(auto_class, path, "sdpa", model_kwargs)
    for part, setting in placements(rows, model, where):
        set_attention(part, setting.method, layers=setting.layers, seed=setting.seed,
                      **setting.options)
    restore_seed_offsets(rows, model)
    saved = describe_record(rows)
    loaded = load_saved_state(model, path, saved, **_weights_choice(model_kwargs))
    if not loaded and any(f".{STATE_NAME}." in key for key in model.state_dict()):
        warnings.warn(
            f"{where} records {saved}, but the weights hold no per-layer {STATE_NAME} "
            f"tensors: they start from the method's initialisation (the model that "
            f"wrote the folder had not made them: on the attn_implementation route a "
            f"layer makes them in its first forward pass).", UserWarning, stacklevel=3)
    return model


# The transformers loader's keywords that also choose which config.json it reads.
_CONFIG_KEYWORDS = ("cache_dir", "force_download", "proxies", "token", "local_files_only",
                    "revision", "subfolder")


def _saved_record(path: str | Path, model_kwargs: dict[str, Any]) -> tuple[Any, str]:
    """The ``skyformer_attention`` entry of the config the loader will read (``None``
    where it has none), and that config's name for sentences."""
    return _config_entry(path, model_kwargs, RECORD_KEY)


def _saved_class(path: str | Path, model_kwargs: dict[str, Any]) -> Any:
    """The transformers class that the config the loader will read names first among
    its ``architectures`` (``save_pretrained`` writes the model's class there), else
    ``AutoModel`` (none named, or none that transformers has: a model of remote code)."""
    import transformers

    architectures, _ = _config_entry(path, model_kwargs, "architectures")
    for name in architectures or ():
        found = getattr(transformers, str(name), None)
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel):
            return found
    return transformers.AutoModel


def _config_entry(path: str | Path, model_kwargs: dict[str, Any], key: str
                  ) -> tuple[Any, str]:
    """The entry ``key`` of the config the loader will read (``None`` where it has
    none), and that config's name for sentences."""
    import transformers

    config = model_kwargs.get("config")
    if isinstance(config, transformers.PretrainedConfig):
        return getattr(config, key, None), "the config passed in model_kwargs"
    source = path if config is None else config
    keywords = {name: model_kwargs[name] for name in _CONFIG_KEYWORDS if name in model_kwargs}
    values, _ = transformers.PretrainedConfig.get_config_dict(source, **keywords)
    where = Path(str(source)) / keywords.get("subfolder", "") / "config.json"
    return values.get(key), str(where)


def _refuse_loader_keywords(method: str, options: dict[str, Any]) -> None:
    """Fail before loading where a keyword is an option of no method: most likely one of
    the transformers loader's (``dtype``, ``device_map``), which go in ``model_kwargs``."""
    every = {option for m in list_methods() for option in get_method(m).option_names()}
    unknown = [key for key in options if key not in every]
    if unknown and unknown[0] == "attn_implementation":  # model_kwargs refuses it too
        raise ValueError("skyformer.hf.from_pretrained chooses attn_implementation from the "
                         "method it loads with: pass the method instead (method='exact' "
                         "for the model's own attention).")
    # a misspelt argument of from_pretrained itself, not one for the loader
    refuse_misspelt_arguments(unknown, "skyformer.hf.from_pretrained", from_pretrained)
    if unknown:
        known = () if method == EXACT else get_method(method).option_names()
        close = option_suggestion(unknown[0], known)
        if close:  # a misspelt option: the method's own sentence, not the loader's
            raise ValueError(f"{method} has no option {unknown[0]!r}{close}; its options "
                             f"are {', '.join(known)}.")
        raise ValueError(
            f"{unknown[0]!r} is no option of {method} (its options: "
            f"{', '.join(known) or 'none'}); keyword arguments of the transformers loader "
            f"go in model_kwargs: from_pretrained(path, {method!r}, "
            f"model_kwargs={{{unknown[0]!r}: ...}}).")


def _loader_kwargs(model_kwargs: Any) -> dict[str, Any]:
    """``from_pretrained``'s ``model_kwargs`` checked: a dict without attn_implementation."""
    if model_kwargs is None:
        return {}
    if not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict of keyword arguments for the "
                        f"transformers loader, got {type(model_kwargs).__name__}.")
    if "attn_implementation" in model_kwargs:
        raise ValueError(
            "model_kwargs: attn_implementation is chosen by the method skyformer.hf."
            "from_pretrained loads with; leave it out (pass method='exact' for the "
            "model's own attention).")
    return model_kwargs


def _weights_choice(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The transformers loader's keywords that choose which weights files of a folder it
    reads (``subfolder``, ``variant``, ``use_safetensors``): the per-layer state is read
    from the same files."""
    return {key: model_kwargs[key] for key in ("subfolder", "variant", "use_safetensors")
            if model_kwargs.get(key) is not None}


def load_saved_state(model: nn.Module, path: str | Path, method: str, *, subfolder: str = "",
                     variant: str | None = None, use_safetensors: bool | None = None) -> int:
    """Load the per-layer parameters (``skyformer_state``, e.g. trained Linformer
    projections) that ``save_pretrained`` wrote to the folder ``path`` into ``model``,
    whose layers ``set_attention`` has set up; returns how many tensors were loaded (0:
    the folder's weights hold none, as those of a model saved before they existed, whose
    layers then keep the method's initialisation). transformers leaves them out when
    loading (no attention setting is stored in the config), so without this they would
    start again from the method's initialisation. A local folder without a weights file
    this reads is refused when ``model`` has such parameters, since whether they were
    saved cannot be told; a Hub name (no local folder) loads with a warning that they
    start from the initialisation, the case of a Hub model saved without them.
    ``subfolder``, ``variant`` and ``use_safetensors`` choose the files as they do for
    transformers' ``from_pretrained``: ``path/subfolder/model.<variant>.safetensors``, ...
    (``pytorch_model.bin`` files only where ``use_safetensors`` is not True, and only
    those where it is False)."""
    current = model.state_dict()
    expected = {key for key in current if f".{STATE_NAME}." in key}
    names = _weight_files(variant, use_safetensors)
    saved = _saved_tensors(Path(path) / subfolder, f".{STATE_NAME}.", names)
    if saved is None and expected and not Path(path).is_dir():
        warnings.warn(
            f"{path} is not a local folder: the per-layer {STATE_NAME} tensors of {method} "
            f"start from its initialisation (read back only from the folder "
            f"save_pretrained wrote).", UserWarning, stacklevel=3)
        return 0
    if saved is None and expected:
        hint = _variant_hint(Path(path) / subfolder, variant)
        raise ValueError(
            f"{Path(path) / subfolder} is not a folder holding {', '.join(names)}, so the "
            f"per-layer {STATE_NAME} tensors of {method} cannot be read back from it: load "
            f"from the local folder save_pretrained wrote{hint}.")
    if not saved:
        return 0
    prefix = getattr(model, "base_model_prefix", "")
    renamed = {}
    for key, value in saved.items():  # saved by the base model or by a head model
        for candidate in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
            if candidate in expected:
                renamed[candidate] = value
                break
    if set(renamed) != expected or len(renamed) != len(saved):
        raise ValueError(_misfit_sentence(path, method, saved, expected, renamed, prefix))
    # checked before any is copied: load_state_dict copies those that fit, then raises
    misfits = [f"{key}: {tuple(value.shape)} saved, {tuple(current[key].shape)} here"
               for key, value in renamed.items() if value.shape != current[key].shape]
    if misfits:
        raise ValueError(f"{path}: the saved {STATE_NAME} tensors do not fit {method} as set "
                         f"up now ({'; '.join(misfits)}); load it with the options it was "
                         f"saved with.")
    model.load_state_dict(renamed, strict=False)
    return len(renamed)


def _misfit_sentence(path: str | Path, method: str, saved: dict[str, Any], expected: set[str],
                     renamed: dict[str, Any], prefix: str) -> str:
    """Why the saved ``skyformer_state`` tensors do not fit the model as set up now, and
    what to do: naming the attention modules that held some when saved and hold none
    now (set when saved, by this method or another)."""
    def module(key: str) -> str:
        return key.split(f".{STATE_NAME}.")[0].removeprefix(f"{prefix}.")

    others = sorted({module(key) for key in saved} - {module(key) for key in expected})
    sentence = (f"{path} holds per-layer {STATE_NAME} tensors that do not fit {method} as "
                f"set up now ({len(saved)} saved, {len(expected)} here, {len(renamed)} "
                f"matched)")
    if others:
        sentence += (f"; {', '.join(others)} held some when saved and hold none now (those "
                     f"layers were set too)")
    return sentence + (
        ": load it with the method, layers and options it was saved with (a model whose "
        "layers ran different methods: skyformer.hf.from_pretrained(path, 'exact'), one "
        "set_attention(model, method, layers=..., ...) call for each method, then "
        "skyformer.hf.load_state(model, path)).")


def load_state(model: nn.Module, path: str | Path, *, subfolder: str = "",
               variant: str | None = None, use_safetensors: bool | None = None) -> int:
    """Load the per-layer parameters (``skyformer_state``) that ``save_pretrained`` wrote
    to the local folder ``path`` into ``model`` as its layers are set up now; returns how
    many tensors were loaded. For a model whose layers ran different methods when saved
    (which one ``from_pretrained`` call cannot set up): load it with
    ``from_pretrained(path, "exact")``, make one ``set_attention`` call for each method
    with the layers and options it was saved with, then ``load_state(model, path)``. Refused with
    a sentence, changing nothing, where the saved tensors do not fit (another method,
    other layers, other shapes). A model loaded with
    ``attn_implementation="skyformer:<method>"``, whose layers make their state at their
    first forward pass, has it made first, as that pass would (and keeps it when
    refused, as after that pass). ``subfolder``, ``variant`` and ``use_safetensors``
    choose the files as for ``from_pretrained`` (``load_saved_state``)."""
    implementation = _implementation(model)
    if is_skyformer_implementation(implementation) and implementation != PER_LAYER:
        make_first_forward_layers([m for _, _, m in attention_modules(model)], implementation)
    used = [f"{row['method']} in layer {row['layer']}" for row in describe(model)
            if row["method"] != EXACT and not row["method"].startswith(f"{EXACT} (")]
    return load_saved_state(model, path, f"the model's layers ({', '.join(used) or 'all exact'})",
                            subfolder=subfolder, variant=variant,
                            use_safetensors=use_safetensors)


def _variant_hint(folder: Path, variant: str | None) -> str:
    """`` (it holds model.fp16.safetensors: pass variant='fp16')`` where the folder holds
    weights of a variant not asked for (one file, or the index of shards
    ``model.safetensors.index.fp16.json``), else ``""``."""
    if variant is not None or not folder.is_dir():
        return ""
    for pattern in ("model.*.safetensors", "pytorch_model.*.bin",
                    "model.safetensors.index.*.json", "pytorch_model.bin.index.*.json"):
        for path in sorted(folder.glob(pattern)):
            found = path.name.split(".")[-2]  # the part before the last suffix
            if "-of-" not in found:  # a shard's name is read from its index instead
                return f" (it holds {path.name}: pass variant={found!r})"
    return ""


# The weights files of a saved model, in the order transformers looks for them.
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _weight_files(variant: str | None, use_safetensors: bool | None) -> tuple[str, ...]:
    """The names of ``_WEIGHT_FILES`` transformers' ``from_pretrained`` looks for with these
    loader keywords, in its order: a ``variant`` goes before the last suffix
    (``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``)."""
    names = []
    for name in _WEIGHT_FILES:
        safe = name.startswith("model.safetensors")
        if (safe and use_safetensors is False) or (not safe and use_safetensors):
            continue
        stem, suffix = name.rsplit(".", 1)
        names.append(name if variant is None else f"{stem}.{variant}.{suffix}")
    return tuple(names)


def _saved_tensors(folder: Path, marker: str, names: tuple[str, ...] = _WEIGHT_FILES
                   ) -> dict[str, Any] | None:
    """The tensors of a saved model whose names contain ``marker``, from its safetensors
    or its ``pytorch_model.bin`` files (one, or shards listed in an index): from the first
    of ``names`` (``_weight_files``, in the order transformers loads them) that ``folder``
    holds, or ``None`` when it holds none of them.

    transformers has loaded the model's weights already; this reads only the tensors
    asked for, and of shards only those that hold some: safetensors files are opened
    lazily, and a zip ``.bin`` is memory-mapped (as transformers loads it), so the other
    tensors are never copied into memory. Only a legacy (pre-zip) ``.bin`` is read whole."""
    name = next((name for name in names if (folder / name).exists()), None)
    if name is None:
        return None
    files = _shards_holding(folder / name, marker) if name.endswith(".json") else [folder / name]
    if name.startswith("pytorch_model"):
        return _bin_tensors(files, marker)
    from safetensors import safe_open

    found = {}
    for file in files:
        with _reading(file), safe_open(str(file), framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys()  # noqa: SIM118
                          if marker in key})
    return found


@contextmanager
def _reading(file: Path) -> Iterator[None]:
    """Name ``file`` and the fix when reading it fails (a file cut short, of another
    format, or not holding tensors), instead of the reader's words alone."""
    try:
        yield
    except Exception as err:  # the readers' own types: SafetensorError, UnpicklingError, ...
        raise ValueError(f"{file} could not be read as saved weights ({type(err).__name__}: "
                         f"{err}); save the model again with save_pretrained, or give the "
                         "folder it was saved to.") from err


def _shards_holding(index: Path, marker: str) -> list[Path]:
    """The shards that the ``index`` of a sharded checkpoint lists for tensors whose names
    contain ``marker``."""
    with _reading(index):
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({index.parent / file for key, file in weight_map.items()
                       if marker in key})


def _bin_tensors(files: list[Path], marker: str) -> dict[str, Any]:
    """The tensors whose names contain ``marker`` in the ``torch.save`` files ``files``."""
    found = {}
    for file in files:
        with _reading(file):
            weights = torch.load(file, map_location="cpu", weights_only=True,
                                 mmap=zipfile.is_zipfile(file))  # mmap needs the zip format
            found.update({key: value for key, value in weights.items() if marker in key})
    return found
