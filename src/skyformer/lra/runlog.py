"""Run records: every entry goes to ``metrics.jsonl``, per-kind CSV files (``train.csv``,
``dev.csv``) and, when the ``tensorboard`` package is installed, TensorBoard event
files under ``tensorboard/``. ``metrics.jsonl`` is strict JSON, one entry a line: a NaN
or infinite value (a diverged loss) is ``null`` there; the CSV files write ``nan``.

The history also lives in the checkpoint: on resume the files are rewritten from it,
so entries logged after the last checkpoint by an interrupted run disappear (a CSV of a
kind the history has no entries of is removed), and TensorBoard is told to purge events
from the resumed step on, the history's entries of that step written again (a new run:
from step 0, hiding those of an attempt that died before its first checkpoint). Events
logged at the resumed step after its checkpoint (a test entry before result.json) are
purged too, so they are never there twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..io import atomic_write_text, json_text, write_csv

KINDS = ("train", "dev", "test")  # the entries a training run records, one CSV each


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def read_entries(metrics: Path, *, damaged: str | None = None
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, entry) of each entry of a run's ``metrics.jsonl`` (none where the
    file is missing). A line that is not JSON (a kill cut it short) is skipped, or, with
    ``damaged`` (what reads the file, for the sentence), named in a ValueError with its
    line number; blank lines and JSON other than an object are skipped."""
    if not metrics.is_file():
        return
    text = metrics.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            if damaged is None:
                continue
            raise ValueError(
                f"{metrics} line {number} is not JSON ({err.msg}, column {err.colno}): the "
                f"file is damaged; delete that line ({damaged}).") from None
        if isinstance(entry, dict):
            yield number, entry


def _json_line(entry: dict[str, Any]) -> str:
    """One ``metrics.jsonl`` line: strict JSON, a non-finite number as ``null``."""
    return json_text(entry) + "\n"


class RunLog:
    """Append-only record of a run, mirrored to files by the main process only."""

    def __init__(self, folder: str | Path, *, enabled: bool,
                 history: list[dict[str, Any]] | None = None, tensorboard: bool = True,
                 purge_step: int | None = None) -> None:
        self.folder = Path(folder)
        self.enabled = enabled
        self.history: list[dict[str, Any]] = list(history or [])
        self._writer = None
        if not enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.folder / "metrics.jsonl",
                          "".join(_json_line(e) for e in self.history))
        kinds = {e["kind"] for e in self.history}
        for kind in kinds:
            self._write_csv(kind)
        for kind in set(KINDS) - kinds:  # left by an interrupted run after its checkpoint
            (self.folder / f"{kind}.csv").unlink(missing_ok=True)
        if tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder / "tensorboard"), purge_step=purge_step)
            for entry in self.history:  # purged with what came after them: written again
                if purge_step is not None and entry.get("step", -1) >= purge_step:
                    self._add_scalars(entry)
            self._writer.flush()

    @property
    def tensorboard(self) -> bool:
        return self._writer is not None

    def _write_csv(self, kind: str) -> None:
        rows = [{k: v for k, v in e.items() if k != "kind"} for e in self.history
                if e["kind"] == kind]
        write_csv(self.folder / f"{kind}.csv", rows)  # the result files' CSV, "\n" ends

    def record(self, kind: str, **values: Any) -> dict[str, Any]:
        """Add an entry ``{"kind": kind, **values}`` (values must be JSON-able)."""
        entry = {"kind": kind, **values}
        self.history.append(entry)
        if not self.enabled:
            return entry
        with (self.folder / "metrics.jsonl").open("a", encoding="utf-8", newline="\n") as handle:
            handle.write(_json_line(entry))
        self._write_csv(kind)
        if self._writer is not None:
            self._add_scalars(entry)
            self._writer.flush()
        return entry

    def _add_scalars(self, entry: dict[str, Any]) -> None:
        """The numbers of ``entry`` as TensorBoard scalars ``kind/name`` at its step."""
        if self._writer is None or "step" not in entry:
            return
        for name, value in entry.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name != "step" and numeric:
                self._writer.add_scalar(f"{entry['kind']}/{name}", value, entry["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
