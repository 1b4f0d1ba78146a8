"""One run at a time in a folder, or on a result file: a lock file naming its process,
taken over from a dead one."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .atomic import FILE_MODE
from .processes import builder_tag, process_alive

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
                if _lock_holder(Path(held)) == builder_tag():  # not one taken over since
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
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
        except FileExistsError:
            with _one_takeover_at_a_time(lock.parent):
                found = _file_identity(lock)  # before its text: which file was judged
                if found is None:  # given back meanwhile: take it
                    continue
                holder = _lock_holder(lock) if lock.is_file() else ""
                if _left_by_dead_process(lock, holder):
                    _remove_dead_lock(lock, found)  # left by a killed process
                    continue
            host, _, pid = holder.rpartition("-")
            who = f"process {pid} on {host}" if host and pid.isdigit() else "another process"
            raise ValueError(f"{in_use} ({who} holds {lock}); wait for it to end, or choose "
                             f"another {flag}; if no run uses it (one killed on another "
                             f"machine), remove {lock}.") from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(builder_tag() + "\n")
        except OSError as err:  # a full disk: an empty lock would refuse every later run
            lock.unlink(missing_ok=True)
            raise OSError(err.errno, f"cannot write the lock {lock} ({err.strerror}): free "
                          f"space on its disk, or choose another {flag}.") from None
        return
    raise ValueError(f"cannot take {lock}: three tries found it held and then gone (runs "
                     f"starting at once); try again, or remove it if no run uses "
                     f"{lock.parent}.")


# How long a run waits for another to finish judging a lock (microseconds of work)
# before it judges unguarded
TAKEOVER_WAIT_SECONDS = 5.0


@contextmanager
def _one_takeover_at_a_time(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` while a lock in it is judged and, if
    dead, removed: processes finding one dead lock take it over one at a time, so none
    removes a lock another made after the dead one went (the kernel releases a flock
    when its process dies: nothing is left to clean). Where there is no flock (Windows,
    a file system refusing it) or another process holds it past
    ``TAKEOVER_WAIT_SECONDS`` (stopped), the block runs unguarded and the identity check
    of ``_remove_dead_lock`` is all that guards."""
    try:
        import fcntl
    except ImportError:  # Windows
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            fd = None
    try:
        if fd is not None:
            deadline = time.monotonic() + TAKEOVER_WAIT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                except OSError:  # no flock on this file system
                    break
        yield
    finally:
        if fd is not None:
            os.close(fd)  # gives the flock back


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
    the dead one's went, is put back. Called under ``_one_takeover_at_a_time``, so that
    of three processes at one dead lock, none moves aside the lock another has just made
    in its place while a third makes its own."""
    aside = lock.with_name(f"{lock.name}.{builder_tag()}.stale")
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
    if host != builder_tag().rsplit("-", 1)[0] or not pid.isdigit():
        return False
    if holder == builder_tag():
        return os.path.realpath(lock) not in _HELD_LOCKS
    return not process_alive(int(pid))
