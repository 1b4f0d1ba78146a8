"""What an ``approx`` run has measured so far, kept for ``--resume``.

A run is a sequence of blocks: the sweep of one source at one length N (targets,
floors, baselines and every method, m and seed) and the analysis of one source. After
each block, ``ProgressFile.save`` rewrites ``approx.progress.json`` in the output folder
atomically with every block so far, at full precision (the result files keep 6
significant digits); ``skyformer approx --resume`` takes the blocks found there instead
of measuring them again. Every draw of a block is seeded by the config alone, so a
resumed run gives the numbers of an uninterrupted one. The file is removed once the
result files are written.
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
# may ask for other lengths or sources (the blocks it does not ask for are dropped)
_BLOCK_SETTINGS = ("seq_lens", "sources", "progress")


def block_key(kind: str, source: str, seq_len: int | None = None) -> str:
    """The name of a block: ``"sweep/<source>/<N>"`` or ``"analysis/<source>"``."""
    return f"{kind}/{source}" if seq_len is None else f"{kind}/{source}/{seq_len}"


def blocks_said(count: int) -> str:
    """``"1 block"``, ``"3 blocks"``."""
    return f"{count} block" + ("" if count == 1 else "s")


def _settings(config: Any) -> dict[str, Any]:
    """The config's settings that define what a block measures, as JSON reads them."""
    settings = json.loads(json.dumps(dataclasses.asdict(config)))
    return {key: value for key, value in settings.items() if key not in _BLOCK_SETTINGS}


def _is_block(block: Any) -> bool:
    """Whether ``block`` holds every part as a list: of strings (notes) or of objects."""
    return isinstance(block, dict) and set(block) == set(PARTS) and all(
        isinstance(items, list)
        and all(isinstance(item, str if part == "notes" else dict) for item in items)
        for part, items in block.items())


def _difference(key: str, there: dict, now: dict) -> str:
    """``key=[16] there, [32] now``; a key one side lacks (a file written by another
    version) is said to be missing there, not to have been None."""
    if key not in there:
        return f"no {key} there, {key}={now[key]!r} now"
    return f"{key}={there[key]!r} there, {now[key]!r} now" if key in now else \
        f"{key}={there[key]!r} there, none now"


class ProgressFile:
    """The blocks of one run, saved to ``path`` after each; with ``resume``, those an
    earlier run with the same settings (and the same ``methods`` run, resolved) saved
    there first."""

    def __init__(self, path: str | Path, config: Any, *, resume: bool,
                 methods: list[str] | None = None) -> None:
        self.path = Path(path)
        self.settings = _settings(config)
        if methods is not None:  # what runs, in order: config.methods None is "every
            # method", which a plugin (--plugin) or another version of the library changes
            self.settings["resolved_methods"] = list(methods)
        self.blocks: dict[str, dict[str, list]] = self._read() if resume else {}
        self.resumed = 0  # blocks taken from the file

    def _read(self) -> dict[str, dict[str, list]]:
        earlier = read_to_resume(self.path, "an approx progress file", "--out")
        if earlier is None:
            return {}
        blocks = earlier.get("blocks") if isinstance(earlier, dict) else None
        if not isinstance(blocks, dict) or not isinstance(earlier.get("settings"), dict) or \
                not all(_is_block(b) for b in blocks.values()):
            raise ValueError(f"cannot resume from {self.path}: not an approx progress file (an "
                             f"object with settings and blocks); write to another --out.")
        settings = dict(self.settings)
        if "resolved_methods" not in earlier["settings"] and settings.get("methods"):
            # a file from before the resolved methods were kept: --methods named them
            settings.pop("resolved_methods", None)
        other = sorted(key for key in settings.keys() | earlier["settings"].keys()
                       if settings.get(key) != earlier["settings"].get(key))
        if other:
            said = ", ".join(_difference(key, earlier["settings"], settings)
                             for key in other)
            raise ValueError(f"cannot resume from {self.path}: it was measured with other "
                             f"settings ({said}); run with the same settings (other "
                             f"--seq-lens and --sources may differ), or without --resume to "
                             f"start over.")
        print(f"resuming from {self.path}: {blocks_said(len(blocks))} measured before",
              file=sys.stderr)
        return blocks

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


def warn_if_left(path: str | Path) -> None:
    """Say on stderr that a run starting over leaves an interrupted run's blocks behind."""
    if Path(path).exists():
        print(f"note: {path} holds what an interrupted run measured; this run starts over "
              f"(pass --resume to continue it instead)", file=sys.stderr)
