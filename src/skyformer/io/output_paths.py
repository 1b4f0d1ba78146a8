"""Checks of an output path before any work: one that cannot be written later, a device
or pipe a result would replace, an output that is one of the run's inputs; and a
method's name as a file name every system takes."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any


def check_output_path(path: str | os.PathLike[str] | None, *, folder: bool = False) -> None:
    """Fail now, with a sentence, if ``path`` cannot be written later (a file where a
    folder is needed, a folder where a file is needed, a device or named pipe where a
    file is needed: ``refuse_special_file``, no write permission), so that a
    long run does not end in an error at its last step. ``folder``: ``path`` is an
    output folder (or a prefix whose folder is its parent when False: then a string
    ending in a separator, which ``Path`` would drop, is refused too)."""
    if path is None:
        return
    if str(path) == "":  # Path("") is the current folder: files would land there
        raise ValueError("the output path is empty; give a file or folder name (or leave the "
                         "option out where it is optional).")
    if str(path) == "-":  # the shell's standard-output name, which would make a file "-"
        kind = "a folder" if folder else "a file"
        raise ValueError(f"the output path '-' would be {kind} named '-': this option does not "
                         f"write to standard output; choose a name (./- for {kind} named so).")
    separators = tuple(sep for sep in (os.sep, os.altsep) if sep)
    if not folder and isinstance(path, str) and path.endswith(separators):
        raise IsADirectoryError(f"the output file {path} ends in a path separator, which names "
                                "a folder; choose a file name.")
    target = Path(path)
    if folder and target.exists() and not target.is_dir():
        raise NotADirectoryError(f"the output folder {target} is a file; choose another path.")
    if not folder and target.is_dir():
        raise IsADirectoryError(f"the output file {target} is a folder; choose a file name.")
    refuse_special_file(target)
    ancestor = (target if folder else target.parent).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(
            f"cannot write {target}: {ancestor} is a file, not a folder; choose another path.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {target}: no write permission in {ancestor}.")


def _file_names(path: str | os.PathLike[str]) -> set[tuple[Any, ...]]:
    """What names one file however it is written: its resolved path, and its device and
    inode where it exists (a hard link)."""
    names: set[tuple[Any, ...]] = {("path", os.path.realpath(path))}
    try:
        info = os.stat(path)
    except OSError:
        return names
    return names | {("inode", info.st_dev, info.st_ino)}


def refuse_overwriting_inputs(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    """A sentence, before any work, where an output file (``{"--json": path}``; ``None``
    and ``-`` skipped) is a file the run reads (``{"the --qkv file": path}``), which it
    would replace, or where two outputs are one file."""
    held = [(_file_names(path), f"{said}: writing it would replace what the run reads")
            for said, path in inputs.items() if path is not None]
    for flag, path in outputs.items():
        if path is None or str(path) == "-":
            continue
        names = _file_names(path)
        for other, said in held:
            if names & other:
                raise ValueError(f"{flag} {path} is {said}; choose another name.")
        held.append((names, f"the file {flag} writes too"))


_SPECIAL_FILES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def refuse_special_file(path: str | os.PathLike[str]) -> None:
    """Refuse, with a sentence, a ``path`` (links followed) that is a device, named pipe
    or socket (``/dev/null``, ``/dev/stdout``, a FIFO): a result file is written whole
    beside it and renamed over its name, which would put a plain file where the device
    or pipe was (as root, in place of ``/dev/null`` for every program)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # absent (or unreadable: the write will say why)
        return
    for is_kind, kind in _SPECIAL_FILES:
        if is_kind(mode):
            raise ValueError(
                f"the output file {path} is {kind}, not a regular file: results are written "
                "to a new file renamed over that name, which would replace it; choose a "
                "file name (and read the file afterwards).")


def portable_name(name: str) -> str:
    """``name`` (a method's, as a folder of results) as a file name every system takes:
    a double quote (a variant's quoted value) becomes a single quote, which means the
    same in a variant; any other character Windows refuses in a name (``<>:/\\|?*`` and
    control characters) becomes ``_``."""
    name = name.replace('"', "'")
    return re.sub(r'[<>:"/\\|?*\x00-\x1f]', "_", name)
