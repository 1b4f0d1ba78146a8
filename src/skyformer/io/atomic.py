"""Atomic writes: a file is written whole beside its name and renamed over it, so a crash
never leaves half of one; a full disk's error names the file; what a killed write
left is removed by the next run."""

from __future__ import annotations

import errno
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .output_paths import refuse_special_file

FILE_MODE = 0o644
DIR_MODE = 0o755


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """A handle (``mode`` "w" for UTF-8 text, "wb" for bytes) on a temporary file next to
    ``path`` that, when the ``with`` block ends without error, is flushed to disk, given
    ``FILE_MODE`` and renamed to ``path``; otherwise it is removed and ``path`` is left
    as it was. Text is written as given, "\\n" as "\\n" on every system (not "\\r\\n" on
    Windows, where a CSV's own "\\r\\n" would become "\\r\\r\\n"). The temporary file
    is ``.NAME.XXXXXXXX.tmp`` (``remove_interrupted_writes`` removes those a killed
    process left)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}.")
    target = Path(path)
    refuse_special_file(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _naming_a_full_disk(target):
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                   dir=target.parent)
        try:
            text = {"encoding": "utf-8", "newline": "\n"} if mode == "w" else {}
            with os.fdopen(fd, mode, **text) as handle:  # "\n" kept: the same everywhere
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, FILE_MODE)  # mkstemp creates 0600: results should be readable
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def fsync_path(path: str, flags: int) -> None:
    """Flush ``path`` to disk through a handle opened with ``flags`` (a file's open for
    writing, ``os.O_RDWR``: Windows flushes no other; a folder's ``os.O_RDONLY |
    os.O_DIRECTORY``)."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The errors of a disk (or quota) without room for a file
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def _naming_a_full_disk(target: Path) -> Iterator[None]:
    """An ``OSError`` of a full disk (or quota) raised with the file it was writing, as
    ``[Errno 28] No space left on device: 'results/p.json'``: the bare error a write
    or an fsync raises names none."""
    try:
        yield
    except OSError as err:
        if err.errno not in FULL_DISK or err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(target)) from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename."""
    with atomic_writer(path) as handle:
        handle.write(text)
    return Path(path)


def save_figure(fig: Any, path: str | os.PathLike[str], **savefig: Any) -> Path:
    """Save a matplotlib figure atomically (a temporary file in the same folder, mode
    ``FILE_MODE``, then rename) and close it where pyplot holds it: a reader never sees
    half a PNG."""
    target = Path(path)
    refuse_special_file(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with _naming_a_full_disk(target):
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.",  # its format's suffix
                                       suffix=f".tmp{target.suffix or '.png'}",
                                       dir=target.parent)
            os.close(fd)
            fig.savefig(tmp, **savefig)
            fsync_path(tmp, os.O_RDWR)  # on disk before the rename, as atomic_writer
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, target)
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")  # not imported here: it would pick
        if pyplot is not None:  # a backend; a Figure made without it needs no closing
            pyplot.close(fig)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return target


def remove_interrupted_writes(folder: Path, names: tuple[str, ...], *,
                              say: Callable[[str], Any] | None = None) -> list[Path]:
    """Remove the temporary files ``.NAME.XXXXXXXX.tmp`` (``.NAME.XXXXXXXX.tmp.png`` for
    a figure) that writes of ``names`` through a temporary file and a rename
    (``atomic_writer``: ``atomic_write_text``, LRA checkpoints; ``save_figure``) left in
    ``folder`` when killed before the rename, and return them; ``say`` (``print``) gets
    a line naming them where there were any. Only for a folder no other process writes
    these files in now (under its lock)."""
    if not folder.is_dir():
        return []
    pattern = re.compile(rf"\.({'|'.join(map(re.escape, names))})\.\w{{8}}\.tmp(\.\w+)?")
    found = [p for p in folder.iterdir()
             if pattern.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    for path in found:
        path.unlink(missing_ok=True)
    if found and say is not None:
        say(f"removed {len(found)} temporary file(s) of writes an interruption cut short: "
            f"{', '.join(p.name for p in found)}")
    return found


def remove_stale(*paths: str | os.PathLike[str]) -> list[Path]:
    """Remove those of ``paths`` that exist and return them: the plots an earlier run left
    that this run does not write, which would otherwise sit beside results they no longer
    show."""
    removed = []
    for path in map(Path, paths):
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed
