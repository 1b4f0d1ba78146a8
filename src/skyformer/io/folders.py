"""Folders written whole: built aside and renamed into place (``building_folder``), or
their files replaced together (``replacing_together``); what a killed build left is
removed by the next (``remove_dead_builds``)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .atomic import DIR_MODE, FILE_MODE, fsync_path
from .processes import builder_tag, process_alive

# The temporary and set-aside folders of builds this process has going (real paths):
# a name with this process's own id is an earlier process's (a container restarted after
# a kill keeps its host name and often its process ids) unless listed here
_BUILDING: set[str] = set()
_BUILDING_GUARD = threading.Lock()


def remove_dead_builds(final: Path) -> list[Path]:
    """Remove what ``building_folder`` left next to ``final`` in a process of this host
    that no longer runs (killed: no ``finally`` ran), and return it: its temporary
    folders ``.NAME.HOST-PID.XXXXXXXX.tmp``, and the previous ``final`` it had set aside
    as ``.NAME.HOST-PID.XXXXXXXX.old`` where ``final`` is there (killed while removing
    it). Where ``final`` is gone (killed between the two renames) the set-aside folder,
    whole, is left for the user to rename back. A folder of another host, of a live
    process (a build going on now, or a reused process id) or named otherwise is left
    alone. Not on Windows, where ``os.kill`` would end the process instead of checking
    it. Hosts are told apart by name: containers sharing one host name and a volume,
    but not their process ids, should build in separate folders."""
    if os.name == "nt" or not final.parent.is_dir():
        return []
    tag = builder_tag()
    host = tag.rsplit("-", 1)[0]
    pattern = re.compile(
        rf"\.{re.escape(final.name)}\.{re.escape(host)}-(\d+)\.\w{{8}}\.(tmp|old)")
    removed = []
    for entry in sorted(final.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() \
                or (match.group(2) == "old" and not final.exists()) \
                or not _left_by_dead_build(entry, f"{host}-{match.group(1)}", tag):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _left_by_dead_build(entry: Path, owner: str, tag: str) -> bool:
    """Whether ``entry``, named by process ``owner`` (``HOST-PID``) of this host, was
    left by a process that no longer runs: this process's own id means an earlier
    process's unless this process builds it now."""
    if owner == tag:
        with _BUILDING_GUARD:
            return os.path.realpath(entry) not in _BUILDING
    return not process_alive(int(owner.rsplit("-", 1)[1]))


@contextmanager
def building_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new temporary folder next to ``path`` to fill in the ``with`` block. When the
    block ends without error it is renamed to ``path`` (a folder already there is
    replaced only then); otherwise it is removed and ``path`` is left as it was. Before
    the rename every file and folder in it is flushed to disk (``_flush_tree``), so that
    after a power cut the folder is either absent or whole; files inside need no atomic
    writes of their own. Its files get ``FILE_MODE`` and its folders ``DIR_MODE``, as
    atomically written results do, whatever the umask. The temporary folder is named
    ``.NAME.HOST-PID.XXXXXXXX.tmp``, and the folder it replaces is set aside as
    ``.NAME.HOST-PID.XXXXXXXX.old`` until the rename: what a killed process left is
    cleaned up by the next build of ``path`` on that host (``remove_dead_builds``).
    A symbolic link at ``path`` is kept: the folder is built where it points, beside its
    target (a link to a mount point itself cannot be replaced, and fails at the rename);
    a link to nothing (a disk not mounted) and a file there are refused."""
    # "." and ".." resolved (the folder has a name), and a link followed: replacing it
    # with a folder would move the data off the disk it points to
    final = Path(os.path.realpath(path))
    if os.path.islink(path) and not final.exists():
        raise FileNotFoundError(f"{path} is a link to {final}, which does not exist (a disk "
                                f"not mounted?); make the folder it points to, or remove "
                                f"the link.")
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(f"{path} is a file, where a folder is to be written; move "
                                 f"it away or choose another folder.")
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_builds(final)
    with _BUILDING_GUARD:  # listed before another thread's remove_dead_builds can see it
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{builder_tag()}.", suffix=".tmp",
                                    dir=final.parent))
        aside = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")  # unique as tmp is
        building = [os.path.realpath(tmp), os.path.realpath(aside)]
        _BUILDING.update(building)
    os.chmod(tmp, DIR_MODE)  # mkdtemp creates 0700; outputs are readable as results are
    old = None
    try:
        yield tmp
        _readable_tree(tmp)
        _flush_tree(tmp)
        if final.exists():
            old = aside
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
        with _BUILDING_GUARD:
            _BUILDING.difference_update(building)


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
    with _BUILDING_GUARD:  # listed before another thread's remove_dead_builds can see it
        stage = Path(tempfile.mkdtemp(prefix=f".staging.{builder_tag()}.", suffix=".tmp",
                                      dir=target))
        building = os.path.realpath(stage)
        _BUILDING.add(building)
    try:
        yield stage
        for path in sorted(stage.iterdir()):
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        with _BUILDING_GUARD:
            _BUILDING.discard(building)


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
            fsync_path(os.path.join(root, name), os.O_RDWR)
        if hasattr(os, "O_DIRECTORY"):
            fsync_path(root, os.O_RDONLY | os.O_DIRECTORY)

