"""What an ``approx`` run has measured so far, kept for ``--resume``.

A run is a sequence of blocks: the sweep of one source at one length N (targets,
floors, baselines and every method, m and seed) and the analysis of one source. After
each block, ``ProgressFile.save`` rewrites ``approx.progress.json`` in the output folder
atomically with every block so far, at full precision (the result files keep 6
significant digits); ``skyformer approx --resume`` takes the blocks found there instead
of measuring them again. Every draw of a block is seeded by the config alone, so a
resumed run gives the numbers of an uninterrupted one.

A resumed run may ask for other ``--seq-lens`` and ``--sources``: the blocks of the file
it does not ask for are said on stderr when it starts, kept in the file as it saves, and
the file is then kept after the results are written (``left_out``), holding them and this
run's blocks, so that a run with every length and source and ``--resume`` writes results
with them all without measuring any again. Otherwise the file is removed once the result
files are written.

The files the blocks are measured on (``--text``, ``--glove``, ``--qkv``, the ``--model``
folder)
are recorded by where they resolve and a stamp of each (size and modification time in
ns: no file is read, a multi-gigabyte GloVe file costs a ``stat``); ``--resume`` refuses
one moved or changed since, naming it. A file written before the stamps were kept
resumes where the paths resolve alike, with a note that what they hold is unchecked.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ...io import atomic_write_text, read_to_resume

PROGRESS_FILE = "approx.progress.json"
# What a block holds: the parts of the result it added
PARTS = ("rows", "samples", "sources", "analysis", "notes")
# Settings that choose which blocks a run has, not what a block measures: a resumed run
# may ask for other lengths or sources (the blocks it does not ask for stay in the file)
_BLOCK_SETTINGS = ("seq_lens", "sources", "progress")
# Settings naming a file or folder the blocks are measured on: kept as ``data_stamp``s
# under "data" and compared by where they resolve and what they hold, not as spelt
_DATA_SETTINGS = ("text", "glove", "model", "qkv")
# The files of a model folder that decide its Q/K/V: config, weights, tokenizer
_MODEL_FILES = ("config.json", "*.safetensors", "*.bin", "*.index.json", "tokenizer*",
                "vocab.*", "merges.txt", "special_tokens_map.json", "*.model")


def block_key(kind: str, source: str, seq_len: int | None = None) -> str:
    """The name of a block: ``"sweep/<source>/<N>"`` or ``"analysis/<source>"``."""
    return f"{kind}/{source}" if seq_len is None else f"{kind}/{source}/{seq_len}"


def blocks_said(count: int) -> str:
    """``"1 block"``, ``"3 blocks"``."""
    return f"{count} block" + ("" if count == 1 else "s")


def asked_blocks(config: Any) -> list[str]:
    """The names of the blocks a run of ``config`` has, in its order."""
    keys = []
    for source in config.sources:
        if config.sweep:
            keys += [block_key("sweep", source, n) for n in config.seq_lens]
        if config.analysis:
            keys.append(block_key("analysis", source))
    return keys


def data_stamp(path: str) -> dict[str, Any]:
    """Where ``path`` resolves and, per file, ``[size, mtime_ns]``: of the file, or of a
    model folder's config, weight and tokenizer files (``_MODEL_FILES``); none where it
    does not exist. Only ``stat``: no file is read."""
    resolved = Path(path).resolve()
    if resolved.is_dir():
        files = {p for pattern in _MODEL_FILES for p in resolved.glob(pattern) if p.is_file()}
    else:
        files = {resolved} if resolved.is_file() else set()
    stats = {p.name: p.stat() for p in sorted(files)}
    return {"path": str(resolved),
            "files": {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}}


def data_stamps(config: Any) -> dict[str, dict[str, Any]]:
    """The ``data_stamp`` of each data setting ``config`` gives (``--qkv``, ``--model``,
    ...), by setting name."""
    return {name: data_stamp(getattr(config, name)) for name in _DATA_SETTINGS
            if getattr(config, name) is not None}


def data_changes(there: dict[str, Any], config: Any) -> list[str]:
    """What changed in ``config``'s data since ``there`` (``data_stamps`` taken then)."""
    now = data_stamps(config)
    return [said for name in now if isinstance(there.get(name), dict)
            for said in _changed(name, there[name], now[name])]


def _settings(config: Any) -> dict[str, Any]:
    """The config's settings that define what a block measures, as JSON reads them; the
    data files as ``data_stamp``s under "data"."""
    settings = json.loads(json.dumps(dataclasses.asdict(config)))
    settings = {key: value for key, value in settings.items()
                if key not in _BLOCK_SETTINGS + _DATA_SETTINGS}
    settings["data"] = data_stamps(config)
    return settings


def _is_block(block: Any) -> bool:
    """Whether ``block`` holds every part as a list: of strings (notes) or of objects."""
    return isinstance(block, dict) and set(block) == set(PARTS) and all(
        isinstance(items, list)
        and all(isinstance(item, str if part == "notes" else dict) for item in items)
        for part, items in block.items())


def _is_data(settings: dict[str, Any]) -> bool:
    """Whether ``settings`` hold "data" as ``_settings`` keeps it, or none (an older file)."""
    data = settings.get("data", {})
    return isinstance(data, dict) and all(
        isinstance(stamp, dict) and isinstance(stamp.get("path"), str)
        and isinstance(stamp.get("files"), dict) for stamp in data.values())


def _paths(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``settings`` with each data setting as the path it resolves to (None: not given),
    and the stamps; a file written before they were kept has none (None), its paths
    are resolved here, from the current folder."""
    paths = {key: value for key, value in settings.items() if key != "data"}
    if "data" not in settings:
        for name in _DATA_SETTINGS:
            if isinstance(paths.get(name), str):
                paths[name] = str(Path(paths[name]).resolve())
        return paths, None
    data = settings["data"]
    for name in _DATA_SETTINGS:
        paths[name] = data[name]["path"] if name in data else None
    return paths, data


def _changed(name: str, there: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What changed in the data of setting ``name`` at one path: ``"--glove /d/g.txt has
    changed (size or modification time)"``, ``"config.json of --model /d/m has been
    removed"``."""
    said = []
    for file in sorted(there["files"].keys() | now["files"].keys()):
        was, is_ = there["files"].get(file), now["files"].get(file)
        if was == is_:
            continue
        what = ("has changed (size or modification time)" if was and is_
                else "has been removed" if was else "has been added")
        place = f"--{name} {now['path']}"
        said.append(f"{place} {what}" if file == Path(now["path"]).name
                    else f"{file} of {place} {what}")
    return said


# Settings whose order changes no block's numbers: the sweep sorts m, statistics over
# seeds take them as a set, and each eps is its own row
_ORDERLESS = ("features", "seeds", "eps")


def _same_setting(key: str, now: Any, there: Any) -> bool:
    """Whether a setting holds the same in this run and the file (``--features 64 16``
    and ``--features 16 64`` are one setting)."""
    if key in _ORDERLESS and isinstance(now, list) and isinstance(there, list):
        return sorted(now) == sorted(there)
    return now == there


def finished_alike(saved: dict[str, Any], stamps: Any, now: dict[str, Any],
                   config: Any) -> bool:
    """Whether the config a finished run saved in its results (``saved``, with its data
    ``stamps``) is that of ``config`` (``now``: its settings as the results write them),
    as a progress file's are compared: ``--features 16 8`` as ``8 16``, ``--text g.txt``
    as ``./g.txt``; "progress" is no setting of what was measured."""
    earlier, _ = _paths({**saved, "data": stamps} if _is_data({"data": stamps}) else saved)
    here, _ = _paths({**now, "data": data_stamps(config)})
    return all(_same_setting(key, value, earlier.get(key))
               for key, value in here.items() if key != "progress")


def _difference(key: str, there: dict, now: dict) -> str:
    """``key=[16] there, [32] now``; a key one side lacks (a file written by another
    version) is said to be missing there, not to have been None."""
    if key not in there:
        return f"no {key} there, {key}={now[key]!r} now"
    return f"{key}={there[key]!r} there, {now[key]!r} now" if key in now else \
        f"{key}={there[key]!r} there, none now"


def _take_them(config: Any, keys: list[str]) -> str:
    """How a run has blocks ``keys`` in its results too: ``"run again with --seq-lens 64
    96 and --resume"``, the lengths and sources of this one and theirs."""
    parts = [key.split("/") for key in keys]
    sources = list(dict.fromkeys([*config.sources, *(p[1] for p in parts if len(p) > 1)]))
    lengths = {int(p[2]) for p in parts if len(p) == 3 and p[2].isdigit()}
    flags = [] if sources == list(config.sources) else ["--sources", *sources]
    if not lengths <= set(config.seq_lens):
        flags += ["--seq-lens", *map(str, sorted(lengths | set(config.seq_lens)))]
    return f"run again with {' '.join(flags) or 'their --seq-lens and --sources'} and --resume"


def kept_note(path: str | Path, config: Any, keys: list[str]) -> str:
    """The note of a progress file kept after the results are written, holding blocks
    ``keys`` that a run of ``config`` did not ask for."""
    return (f"note: kept {path}: it also holds {blocks_said(len(keys))} these results do "
            f"not ({', '.join(keys)}); {_take_them(config, keys)} to have them in the "
            f"results too (measuring none of them again), or remove it")


class ProgressFile:
    """The blocks of one run, saved to ``path`` after each; with ``resume``, those an
    earlier run with the same settings (and the same ``methods`` run, resolved) saved
    there first. ``left_out``: the names of those this run does not ask for (other
    --seq-lens or --sources), which stay in the file."""

    def __init__(self, path: str | Path, config: Any, *, resume: bool,
                 methods: list[str] | None = None) -> None:
        self.path = Path(path)
        self.config = config
        self.settings = _settings(config)
        if methods is not None:  # what runs, in order: config.methods None is "every
            # method", which a plugin (--plugin) or another version of the library changes
            self.settings["resolved_methods"] = list(methods)
        self.left_out: list[str] = []
        self.blocks: dict[str, dict[str, list]] = self._read() if resume else {}
        self.resumed = 0  # blocks taken from the file

    def _read(self) -> dict[str, dict[str, list]]:
        earlier = read_to_resume(self.path, "an approx progress file", "--out")
        if earlier is None:
            return {}
        blocks = earlier.get("blocks") if isinstance(earlier, dict) else None
        if not isinstance(blocks, dict) or not isinstance(earlier.get("settings"), dict) or \
                not all(_is_block(b) for b in blocks.values()) or \
                not _is_data(earlier["settings"]):
            raise ValueError(f"cannot resume from {self.path}: not an approx progress file (an "
                             f"object with settings and blocks), or one damaged; remove it "
                             f"to start over there, or write to another --out.")
        self._check_settings(earlier["settings"])
        print(f"resuming from {self.path}: {blocks_said(len(blocks))} measured before",
              file=sys.stderr)
        asked = set(asked_blocks(self.config))
        self.left_out = [key for key in blocks if key not in asked]
        if self.left_out:
            print(f"warning: {self.path} also holds {blocks_said(len(self.left_out))} this "
                  f"run does not ask for ({', '.join(self.left_out)}); they stay in it, "
                  f"which is kept after the results are written: "
                  f"{_take_them(self.config, self.left_out)} to have them in the results",
                  file=sys.stderr)
        return blocks

    def _check_settings(self, saved: dict[str, Any]) -> None:
        """Raise a sentence where ``saved`` (the file's settings) differs from this run's:
        a setting, a data path, or what a data file holds."""
        earlier, stamps = _paths(saved)
        settings, now_stamps = _paths(self.settings)
        if "resolved_methods" not in earlier and settings.get("methods"):
            # a file from before the resolved methods were kept: --methods named them
            settings.pop("resolved_methods", None)
        other = sorted(key for key in settings.keys() | earlier.keys()
                       if not _same_setting(key, settings.get(key), earlier.get(key)))
        if other:
            said = ", ".join(_difference(key, earlier, settings) for key in other)
            raise ValueError(f"cannot resume from {self.path}: it was measured with other "
                             f"settings ({said}); run with the same settings (other "
                             f"--seq-lens and --sources may differ), or remove that file (or "
                             f"give another --out) to start over.")
        if stamps is None:
            if now_stamps:
                flags = ", ".join(f"--{name}" for name in now_stamps)
                print(f"note: {self.path} was written before approx kept a stamp (size, "
                      f"modification time) of {flags}; resuming on the path alone: if the "
                      f"data changed since, run without --resume into a fresh --out",
                      file=sys.stderr)
            return
        changed = [said for name in now_stamps
                   for said in _changed(name, stamps[name], now_stamps[name])]
        if changed:
            raise ValueError(f"cannot resume from {self.path}: since its blocks were "
                             f"measured, {', '.join(changed)}; run without --resume into a "
                             f"fresh --out, or restore the file.")

    def restore(self, key: str) -> dict[str, list] | None:
        """The parts of block ``key`` as measured before, or None (to measure)."""
        block = self.blocks.get(key)
        if block is not None:
            self.resumed += 1
        return block

    def save(self, key: str, block: dict[str, list]) -> None:
        """Add block ``key`` and rewrite the file (NaN as JSON's NaN: Python reads it
        back as the float it was)."""
        self.blocks[key] = block
        atomic_write_text(self.path, json.dumps(
            {"settings": self.settings, "blocks": self.blocks}, allow_nan=True) + "\n")


def refuse_to_replace(path: str | Path) -> None:
    """Refuse to start over where ``path`` holds an interrupted run's blocks: the
    interrupt note says to rerun with --resume, and a rerun from the shell history
    without it replaced the blocks measured (as ``bench`` and ``lra stability`` refuse)."""
    if Path(path).exists():
        raise ValueError(f"{path} holds what an interrupted run measured: pass --resume to "
                         f"continue it, or remove that file (or give another --out) to start "
                         f"again.")
