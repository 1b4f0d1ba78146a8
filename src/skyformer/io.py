"""Result files and the folders that hold them.

- Writes: atomic (a crash never leaves a half-written file: ``atomic_writer``,
  ``atomic_write_text``, ``write_json``, ``write_csv``, ``save_figure``), strict JSON (a
  non-finite number is ``null``), the run's ``environment``, and checks of an output path
  before any work (``check_output_path``).
- Folders: one run at a time in a folder (``folder_lock``, ``results_lock``: a lock file
  naming its process, taken over from a dead one), a folder built aside and renamed into
  place (``building_folder``), files replaced together (``replacing_together``), and what
  an interrupted run left (``remove_interrupted_writes``, ``remove_dead_builds``).
- Resume: ``read_to_resume`` reads an earlier result with a sentence where it is damaged.
"""

from __future__ import annotations

import errno
import json
import math
import os
import platform
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .versions import triton_version

FILE_MODE = 0o644
DIR_MODE = 0o755


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


def _builder_tag() -> str:
    """``HOST-PID`` of this process, as it names its temporary folders: on a file system
    shared between machines, a process id means something only on its own host."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (one of another user's counts) and
    has not ended: a process killed but not yet collected by its parent (a zombie, which
    ``os.kill`` still finds: a job driver that kills without waiting) runs no more and
    holds nothing."""
    try:
        os.kill(pid, 0)  # signal 0: a check, nothing is sent
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # PermissionError: it exists; anything
        return True  # else (a pid no process can have): do not guess, leave it alone
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended and waits for its parent to collect it (its
    state in ``/proc/PID/stat`` is Z; False where there is no such file to read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses
    return stat[stat.rfind(")") + 1:].split()[:1] == ["Z"]


def remove_dead_builds(final: Path) -> list[Path]:
    """Remove the temporary folders ``.NAME.HOST-PID.XXXXXXXX.tmp`` that ``building_folder``
    left next to ``final`` in a process of this host that no longer runs (killed: no
    ``finally`` ran), and return them. A folder of another host, of a live process (a
    build going on now, or a reused process id) or named otherwise is left alone. Not on
    Windows, where ``os.kill`` would end the process instead of checking it. Hosts are
    told apart by name: containers sharing one host name and a volume, but not their
    process ids, should build in separate folders."""
    if os.name == "nt" or not final.parent.is_dir():
        return []
    host = _builder_tag().rsplit("-", 1)[0]
    pattern = re.compile(rf"\.{re.escape(final.name)}\.{re.escape(host)}-(\d+)\.\w{{8}}\.tmp")
    removed = []
    for entry in final.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() \
                and not _process_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


LOCK_FILE = ".skyformer.lock"
# An empty lock older than this was left by a process that died between creating it and
# writing its name in it (a write takes microseconds)
EMPTY_LOCK_SECONDS = 10.0
_HELD_LOCKS: set[str] = set()  # the locks this process holds (real paths)
_HELD_GUARD = threading.Lock()  # one thread at a time takes or gives back a lock


@contextmanager
def folder_lock(folder: str | os.PathLike[str], flag: str = "--out") -> Iterator[Path]:
    """Hold ``folder/.skyformer.lock`` while the ``with`` block runs: a file created
    exclusively, naming this process (``HOST-PID``), removed at the end. Another process
    that takes the lock of the same folder meanwhile is refused with a sentence (naming
    ``flag``, the option that chose the folder) instead of mixing its files with this
    one's. A lock that a killed process of this host left is taken over (its process no
    longer runs); one of another host is left for the user to remove, as the sentence says.
    The folders made for the lock are removed with it when the block wrote nothing in them
    (a run refused after taking it)."""
    target = Path(folder)
    made = [p for p in (target.absolute(), *target.absolute().parents) if not p.exists()]
    target.mkdir(parents=True, exist_ok=True)
    with _holding(target / LOCK_FILE, f"{target} is in use by another run", flag, made) as lock:
        yield lock


@contextmanager
def results_lock(path: str | os.PathLike[str], flag: str = "--out") -> Iterator[Path]:
    """Hold ``.NAME.skyformer.lock`` next to the result file ``path`` while the ``with``
    block runs, as ``folder_lock`` holds a folder's: a second run writing the same
    results (``bench --out``, ``lra stability --json``: rewritten as they go, each run's
    rows over the other's) is refused with a sentence naming the process; runs writing
    other files of the folder are not. The folders made for it are removed with it when
    nothing was written in them."""
    target = Path(path)
    made = [p for p in target.absolute().parents if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}{LOCK_FILE}"
    with _holding(lock, f"{target} is being written by another run", flag, made) as held:
        yield held


@contextmanager
def _holding(lock: Path, in_use: str, flag: str, made: list[Path]) -> Iterator[Path]:
    """Take ``lock`` (refused with ``in_use``, a sentence's start, where another process
    holds it), yield it, give it back and remove the empty folders of ``made``."""
    held = os.path.realpath(lock)  # the same file if the working folder changes meanwhile
    with _HELD_GUARD:
        try:
            _take_lock(lock, in_use, flag)
        except BaseException:
            _remove_empty(made)
            raise
        _HELD_LOCKS.add(held)
    finished = False
    try:
        yield lock
        finished = True
    finally:
        with _HELD_GUARD:
            try:
                if _lock_holder(Path(held)) == _builder_tag():  # not one taken over since
                    Path(held).unlink(missing_ok=True)
            except OSError as err:  # the folder turned read-only: the run's own error first
                if finished:
                    warnings.warn(f"could not remove the lock {held} ({err.strerror}); the "
                                  f"next run on this host takes it over.", RuntimeWarning,
                                  stacklevel=3)
            _HELD_LOCKS.discard(held)
            _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty."""
    for path in folders:
        try:
            path.rmdir()
        except OSError:  # written in (or gone): kept, and so are the folders above it
            return


def _take_lock(lock: Path, in_use: str, flag: str) -> None:
    """Create ``lock`` holding this process's ``HOST-PID``, or raise a sentence (starting
    with ``in_use``) naming the process that holds it; a lock of a dead process of this
    host is removed first."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
        except FileExistsError:
            found = _file_identity(lock)  # before its text: which file was judged
            holder = _lock_holder(lock) if lock.is_file() else ""
            host, _, pid = holder.rpartition("-")
            if _left_by_dead_process(lock, holder):
                _remove_dead_lock(lock, found)  # left by a killed process
                continue
            who = f"process {pid} on {host}" if host and pid.isdigit() else "another process"
            raise ValueError(f"{in_use} ({who} holds {lock}); wait for it to end, or choose "
                             f"another {flag}; if no run uses it (one killed on another "
                             f"machine), remove {lock}.") from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(_builder_tag() + "\n")
        except OSError as err:  # a full disk: an empty lock would refuse every later run
            lock.unlink(missing_ok=True)
            raise OSError(err.errno, f"cannot write the lock {lock} ({err.strerror}): free "
                          f"space on its disk, or choose another {flag}.") from None
        return
    raise ValueError(f"cannot take {lock} (it came back after a dead process's was removed); "
                     f"remove it if no run uses {lock.parent}.")


def _file_identity(path: Path) -> tuple[int, ...] | None:
    """The device, inode and modification time of ``path`` (None where it is gone): the
    one file, as its text is not (a dead empty lock and one just made read alike)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns


def _remove_dead_lock(lock: Path, dead: tuple[int, ...] | None) -> None:
    """Remove ``lock``, the file ``dead`` (``_file_identity``) judged a dead process's,
    unless another process took it over first: it is moved aside in one step (of two
    processes at it, one moves it) and compared there; a live process's lock, made after
    the dead one's went, is put back. (Three processes at one dead lock can still meet:
    a lock made while the live one is aside stays, and both run.)"""
    aside = lock.with_name(f"{lock.name}.{_builder_tag()}.stale")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:  # another process removed it first
        return
    if dead is None or _file_identity(aside) != dead:  # not the dead one: put it back
        try:
            os.link(aside, lock)  # only where no lock was made meanwhile
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not lock.exists():
                os.rename(aside, lock)
                return
    aside.unlink(missing_ok=True)


def _lock_holder(lock: Path) -> str:
    """The ``HOST-PID`` that ``lock`` names (``""`` where it is empty or gone)."""
    try:
        return lock.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def _left_by_dead_process(lock: Path, holder: str) -> bool:
    """Whether ``lock``, naming ``holder`` (``HOST-PID``), was left by a process of this
    host that no longer runs. A holder with this process's own id is a dead one unless
    this process holds the lock: an earlier process had the id (a container restarted
    after a kill keeps its host name and often its process ids)."""
    if not holder:  # created, never written: its process died at once (or its disk was full)
        try:
            return time.time() - lock.stat().st_mtime > EMPTY_LOCK_SECONDS
        except OSError:
            return False
    host, _, pid = holder.rpartition("-")
    if host != _builder_tag().rsplit("-", 1)[0] or not pid.isdigit():
        return False
    if holder == _builder_tag():
        return os.path.realpath(lock) not in _HELD_LOCKS
    return not _process_alive(int(pid))


@contextmanager
def building_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new temporary folder next to ``path`` to fill in the ``with`` block. When the
    block ends without error it is renamed to ``path`` (a folder already there is
    replaced only then); otherwise it is removed and ``path`` is left as it was. Before
    the rename every file and folder in it is flushed to disk (``_flush_tree``), so that
    after a power cut the folder is either absent or whole; files inside need no atomic
    writes of their own. Its files get ``FILE_MODE`` and its folders ``DIR_MODE``, as
    atomically written results do, whatever the umask. The temporary folder is named
    ``.NAME.HOST-PID.XXXXXXXX.tmp``: one that a killed process left is removed by the
    next build of ``path`` on that host (``remove_dead_builds``)."""
    final = Path(os.path.abspath(path))  # "." and ".." resolved: the folder has a name
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_builds(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{_builder_tag()}.", suffix=".tmp",
                                dir=final.parent))
    os.chmod(tmp, DIR_MODE)  # mkdtemp creates 0700; outputs are readable as results are
    old = None
    try:
        yield tmp
        _readable_tree(tmp)
        _flush_tree(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextmanager
def replacing_together(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder inside ``folder`` to write one run's result files into. When
    the block ends without error each file is moved into ``folder`` (one rename each, in
    quick succession, replacing files of the same name); otherwise the temporary folder
    is removed and ``folder`` keeps the previous run's files, none of them replaced (an
    interruption while a plot is drawn no longer leaves a new JSON beside an old
    report). Other files in ``folder`` are left alone, and so are the temporary folders
    of runs going on; those of killed runs (``.staging.HOST-PID.XXXXXXXX.tmp``, the
    process gone) are removed (``remove_dead_builds``)."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    remove_dead_builds(target / "staging")
    stage = Path(tempfile.mkdtemp(prefix=f".staging.{_builder_tag()}.", suffix=".tmp",
                                  dir=target))
    try:
        yield stage
        for path in sorted(stage.iterdir()):
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _readable_tree(folder: Path) -> None:
    """Modes of results for everything under ``folder``: files written plainly inside
    it follow the umask (0600 under ``umask 077``)."""
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE)
        for name in files:
            os.chmod(os.path.join(root, name), FILE_MODE)


def _flush_tree(folder: Path) -> None:
    """``fsync`` every file under ``folder``, then every folder (its entries), deepest
    first: only what was written here, where a global ``os.sync`` would wait on every
    file system of the machine (a busy shared one on a cluster). A file is opened for
    writing (it is ours, given ``FILE_MODE``): Windows flushes only through such a
    handle, where POSIX takes any. Folders cannot be opened for a flush on Windows:
    there only the files are flushed."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name), os.O_RDWR)
        if hasattr(os, "O_DIRECTORY"):
            _fsync(root, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, target)
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")  # not imported here: it would pick
        if pyplot is not None:  # a backend; a Figure made without it needs no closing
            pyplot.close(fig)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return target


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


def json_ready(data: Any) -> Any:
    """``data`` as the result files store it: every non-finite float (NaN, +-inf), in
    dicts, lists and tuples too, as None (JSON ``null``), tuples as lists, a NumPy scalar
    or a 0-d tensor as the Python value it holds (not its ``str``)."""
    if isinstance(data, (np.generic, torch.Tensor)) and data.ndim == 0:
        data = data.item()
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_ready(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_ready(value) for value in data]
    return data


def json_text(data: Any, *, indent: int | None = None,
              separators: tuple[str, str] | None = None) -> str:
    """``data`` as strict JSON: non-finite numbers as ``null`` (``json_ready``), never
    the ``NaN``/``Infinity`` tokens that strict readers (jq, JavaScript) refuse; anything
    else that is not JSON raises ``ValueError``. Objects JSON has no type for (paths,
    dtypes) are written as their ``str``."""
    return json.dumps(json_ready(data), indent=indent, separators=separators,
                      sort_keys=False, default=str, allow_nan=False)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    """Atomically write ``data`` as strict JSON (``indent=None``: compact, for long
    arrays). A NaN or infinite number, nested or not, is written as ``null``: readers of
    the result files take ``null`` where a number is expected as "no value"."""
    separators = (",", ":") if indent is None else None
    return atomic_write_text(path, json_text(data, indent=indent, separators=separators) + "\n")


def read_to_resume(path: Path, kind: str, flag: str) -> Any:
    """The JSON a ``--resume`` continues, read (None, said on stderr, where ``path`` does
    not exist yet); ``kind`` names what it should be ("a bench result file") and ``flag``
    the option that names it, for the sentence an unreadable file gets."""
    if not path.exists():
        print(f"nothing to resume: {path} does not exist; measuring everything",
              file=sys.stderr)
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot resume from {path}: not {kind}, or one cut short or "
                         f"damaged ({err}); remove it to start over there, or write to "
                         f"another {flag}.") from None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a result depends on besides its config: versions (Triton's where it can be
    imported), threads, device name."""
    device = torch.device(device or "cpu")
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    triton = triton_version()  # the Triton kernels' results and speed depend on it
    if triton is not None:
        info["triton"] = triton
    import skyformer  # the code that ran, not an installed copy's metadata

    info["skyformer"] = skyformer.__version__
    return info


def write_csv(
    path: str | os.PathLike[str], rows: list[dict[str, Any]], *,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Atomically write ``rows`` (dicts; columns = union of their keys, first-seen order)
    as CSV. ``metadata`` (e.g. the resolved config and environment) goes first, one
    ``# key: <json>`` comment line per key (``pandas.read_csv(path, comment="#")``;
    strict JSON, see ``json_text``)."""
    import csv
    import io

    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    for key, value in (metadata or {}).items():
        buffer.write(f"# {key}: {json_text(value)}\n")
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return atomic_write_text(path, buffer.getvalue())
