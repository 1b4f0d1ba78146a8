from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch

from skyformer.io import atomic_write_text, write_csv, write_json
from skyformer.lra.checkpoint import load_checkpoint, save_checkpoint


def test_atomic_writes_are_readable_and_leave_no_temporary(tmp_path):
    path = atomic_write_text(tmp_path / "sub" / "a.txt", "hello")
    assert path.read_text() == "hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]


def _checkpoint(path, payload):
    save_checkpoint(path, {"format": payload})


@pytest.mark.parametrize("write, read", [
    (atomic_write_text, lambda path: path.read_text()),
    (_checkpoint, lambda path: load_checkpoint(path)["format"]),
])
@pytest.mark.parametrize("failing", ["fdopen", "fsync", "chmod", "replace"])
def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch, failing, write,
                                                      read):
    """An error (or an interruption) at any step of a write, of a result or an LRA
    checkpoint, leaves the earlier file as it was and no temporary beside it: never a
    truncated or half-written file."""
    path = tmp_path / "a.txt"
    write(path, "old")

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(KeyboardInterrupt):
        write(path, "new and longer")
    monkeypatch.undo()
    assert read(path) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_checkpoint_that_does_not_fit_says_so_and_keeps_the_old_one(tmp_path,
                                                                     monkeypatch):
    """A full disk made torch's zip writer say "[enforce fail at inline_container.cc]
    unexpected pos ...", naming neither the file nor the disk."""
    import io as stdlib_io
    import shutil

    path = tmp_path / "last.pt"
    save_checkpoint(path, {"format": "old"})

    class Full(stdlib_io.BufferedWriter):
        def write(self, data):
            raise OSError(28, "No space left on device")

    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode, *a, **k: Full(real_fdopen(fd, mode,
                                                                                 buffering=0)))
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(
        100 * 2**20, 100 * 2**20, 0))
    with pytest.raises(OSError, match=rf"cannot write checkpoint {path} \(.+\); 0\.0 MiB "
                                      r"are free there\. Free some space, or give --out on "
                                      r"another disk, and continue with --resume"):
        save_checkpoint(path, {"format": torch.zeros(1000)})
    monkeypatch.undo()
    assert load_checkpoint(path)["format"] == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("signal_error", [KeyboardInterrupt, "Terminated"])
def test_a_signal_during_a_checkpoint_write_is_the_interrupt_it_is(tmp_path, monkeypatch,
                                                                   signal_error):
    """Ctrl-C or SIGTERM while torch.save writes: its handler raises inside torch's write
    callback, which torch reports as a failed write ("unexpected pos"); that was called
    a full disk (exit status 2) instead of the interruption it is (130, 143)."""
    import io as stdlib_io

    from skyformer.cli.signals import Terminated

    interrupt = Terminated if signal_error == "Terminated" else signal_error
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"format": "old"})
    writes = []

    class Signalled(stdlib_io.BufferedWriter):
        def write(self, data):
            writes.append(len(data))
            if len(writes) == 3:  # the signal arrives in the middle of the write
                raise interrupt
            return super().write(data)

    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode, *a, **k: Signalled(
        real_fdopen(fd, mode, buffering=0)))
    with pytest.raises(interrupt) as raised:
        save_checkpoint(path, {"format": torch.zeros(1000)})
    monkeypatch.undo()
    assert type(raised.value) is interrupt
    assert load_checkpoint(path)["format"] == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_an_interrupt_as_torch_closes_its_writer_does_not_end_the_process(tmp_path):
    """An interrupt raised as torch.save's zip writer is closed left the writer alive in
    the error's frames; freed after the file was closed, it wrote to the closed file and
    the process ended in a C++ terminate (exit status 134) instead of reporting it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import gc, torch, torch.serialization as serialization
        from skyformer.lra.checkpoint import save_checkpoint

        def interrupted_exit(self, *args):  # the signal's handler runs at its first line
            raise KeyboardInterrupt

        serialization._open_zipfile_writer_buffer.__exit__ = interrupted_exit
        try:
            save_checkpoint({str(tmp_path / "last.pt")!r}, {{"w": torch.zeros(10)}})
        except KeyboardInterrupt:
            print("interrupted")
        gc.collect()
        print("alive")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.split()) == (0, ["interrupted", "alive"]), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_json_and_csv(tmp_path):
    write_json(tmp_path / "a.json", {"x": [1, 2]}, indent=None)
    assert (tmp_path / "a.json").read_text() == '{"x":[1,2]}\n'
    assert json.loads(write_json(tmp_path / "b.json", {"x": 1}).read_text()) == {"x": 1}
    rows = [{"a": 1, "b": None}, {"a": 2, "c": "z"}]
    text = write_csv(tmp_path / "r.csv", rows, metadata={"config": {"n": 3}}).read_text()
    assert text == '# config: {"n": 3}\na,b,c\n1,,\n2,,z\n'


def _strict(text):
    """``json.loads`` that refuses the NaN and Infinity tokens, as strict JSON readers do."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path):
    nan, inf = float("nan"), float("inf")
    data = {"a": nan, "b": [1.5, inf, {"c": -inf}], "d": (nan, 2), "e": {"f": {"g": [nan]}}}
    for indent in (2, None):
        text = write_json(tmp_path / "a.json", data, indent=indent).read_text()
        assert _strict(text) == {"a": None, "b": [1.5, None, {"c": None}], "d": [None, 2],
                                 "e": {"f": {"g": [None]}}}
    text = write_csv(tmp_path / "r.csv", [{"x": 1}], metadata={"config": {"max": inf}}).read_text()
    assert text.startswith('# config: {"max": null}\n')
    # what cannot be made finite (here a NaN key) is refused, and nothing is written
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_json(tmp_path / "bad.json", {nan: 1})
    assert not (tmp_path / "bad.json").exists()


def test_a_built_folder_is_flushed_to_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """Its files are written plainly: flushing each of them (and the folders) before the
    rename is what keeps a power cut from leaving a renamed folder of empty files."""
    import os

    from skyformer.io import building_folder

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace",)),
                                                     real_replace(a, b)))
    with building_folder(tmp_path / "data") as tmp:
        (tmp / "rows.tsv").write_text("a\tb\n")
        (tmp / "imgs").mkdir()
        (tmp / "imgs" / "0.png").write_bytes(b"png")
    flushed = [name for kind, *name in events if kind == "fsync" for name in name]
    assert events[-1] == ("replace",) and len(events) == 5
    assert {"rows.tsv", "0.png", "imgs"} <= set(flushed)
    assert flushed.index("0.png") < flushed.index("imgs")  # a folder after its files
    assert (tmp_path / "data" / "rows.tsv").read_text() == "a\tb\n"
    events.clear()
    with pytest.raises(RuntimeError), building_folder(tmp_path / "other") as tmp:
        raise RuntimeError("interrupted")
    assert events == [] and not (tmp_path / "other").exists()



def test_a_built_folder_keeps_a_link_and_refuses_a_file_at_its_name(tmp_path):
    """A file at the folder's name was set aside as a hidden .old entry that no later
    build removed; a link to a folder elsewhere (a bigger disk) was replaced by a folder
    here."""
    from skyformer.io import building_folder

    notes = tmp_path / "listops"
    notes.write_text("my notes")
    with pytest.raises(NotADirectoryError, match=r"listops is a file, where a folder is to "
                                                 r"be written"), building_folder(notes):
        pass
    assert notes.read_text() == "my notes" and sorted(tmp_path.iterdir()) == [notes]
    elsewhere = tmp_path / "big" / "listops"
    elsewhere.mkdir(parents=True)
    (elsewhere / "old.txt").write_text("old")
    link = tmp_path / "cache" / "listops"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    with building_folder(link) as tmp:
        (tmp / "new.txt").write_text("new")
    assert link.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["listops"]
    assert sorted(p.name for p in elsewhere.parent.iterdir()) == ["listops"]
    unmounted = tmp_path / "cache" / "pathfinder"
    unmounted.symlink_to(tmp_path / "mnt" / "disk" / "pathfinder")
    with pytest.raises(FileNotFoundError, match=r"pathfinder is a link to .*which does not "
                                                r"exist"), building_folder(unmounted):
        pass
    assert not (tmp_path / "mnt").exists()


def test_a_figure_is_flushed_to_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """save_figure renamed the file matplotlib wrote without flushing it, unlike every
    other atomic write: a power cut could leave an empty plot under the name."""
    import os

    from matplotlib.figure import Figure

    from skyformer.io import save_figure

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"),
                                                     real_replace(a, b)))
    save_figure(Figure(), tmp_path / "plot.png")
    assert events == ["fsync", "replace"] and (tmp_path / "plot.png").stat().st_size > 0


def test_a_built_folder_is_flushed_as_windows_allows(tmp_path, monkeypatch):
    """Windows flushes a file only through a handle open for writing (FlushFileBuffers;
    ``os.fsync`` of a read-only one fails with EBADF), where POSIX takes any: every
    ``lra prepare`` and ``lra generate`` failed there. This ``fsync`` refuses files as
    Windows does."""
    import errno

    fcntl = pytest.importorskip("fcntl")
    from skyformer.io import building_folder

    real_fsync = os.fsync

    def fsync(fd):
        read_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        if stat.S_ISREG(os.fstat(fd).st_mode) and read_only:
            raise OSError(errno.EBADF, "Bad file descriptor")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with building_folder(tmp_path / "data") as tmp:
        (tmp / "imgs").mkdir()
        (tmp / "imgs" / "0.png").write_bytes(b"png")
    assert (tmp_path / "data" / "imgs" / "0.png").read_bytes() == b"png"


def test_a_built_folder_has_the_modes_of_results_whatever_the_umask(tmp_path):
    """Generated LRA data and caches are written plainly inside the folder: under
    ``umask 077`` they would be 0600 / 0700 while the run's own results are 0644."""
    import os

    from skyformer.io import building_folder

    before = os.umask(0o077)
    try:
        with building_folder(tmp_path / "data") as tmp:
            (tmp / "rows.tsv").write_text("a\tb\n")
            (tmp / "imgs").mkdir()
            (tmp / "imgs" / "0.png").write_bytes(b"png")
    finally:
        os.umask(before)
    data = tmp_path / "data"
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (data, data / "imgs")} == \
        {"data": 0o755, "imgs": 0o755}
    assert {p.name: stat.S_IMODE(p.stat().st_mode)
            for p in (data / "rows.tsv", data / "imgs" / "0.png")} == \
        {"rows.tsv": 0o644, "0.png": 0o644}


@pytest.mark.skipif(os.name == "nt", reason="no process check on Windows")
def test_the_previous_folder_a_killed_build_set_aside_is_removed_once_replaced(tmp_path):
    """A build killed while removing the folder it replaced (seconds, for a generated
    data set of gigabytes) left it hidden beside the new one as ``.NAME.old-PID``
    forever. The next build removes such a folder where the new one is in place, and
    leaves it where the folder is gone (killed between the renames: the data, whole,
    for the user to rename back); this process's own id names an earlier process's
    folder (a restarted container) unless it builds it now."""
    import subprocess
    import sys

    from skyformer.io import building_folder
    from skyformer.io.processes import builder_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = builder_tag().rsplit("-", 1)[0]
    cut_short = tmp_path / f".data.{host}-{dead.pid}.abcd1234.old"
    (cut_short / "rows.tsv").parent.mkdir()
    (cut_short / "rows.tsv").write_text("previous\n")
    with pytest.raises(RuntimeError), building_folder(tmp_path / "data"):
        raise RuntimeError("this build fails")
    assert sorted(os.listdir(tmp_path)) == [cut_short.name]  # the data, left whole

    cut_short.rename(tmp_path / "data")  # put back by the user
    left = [tmp_path / f".data.{host}-{dead.pid}.abcd1234.old",
            tmp_path / f".data.{builder_tag()}.efgh5678.old"]  # an earlier process's
    for folder in left:
        folder.mkdir()
    with building_folder(tmp_path / "data") as tmp:
        assert sorted(os.listdir(tmp_path)) == sorted(["data", tmp.name])
        (tmp / "rows.tsv").write_text("new\n")
    assert sorted(os.listdir(tmp_path)) == ["data"]
    assert (tmp_path / "data" / "rows.tsv").read_text() == "new\n"


def test_numpy_scalars_and_0d_tensors_are_written_as_numbers(tmp_path):
    """They were written as their str ("0.5", "tensor(2.)"), which readers take for text."""
    import numpy as np
    import torch

    data = {"a": np.float32(0.5), "b": [np.int64(3), torch.tensor(2.0)], "c": np.bool_(True),
            "d": np.float32("nan"), "e": torch.tensor(float("inf"))}
    written = json.loads(write_json(tmp_path / "a.json", data).read_text())
    assert written == {"a": 0.5, "b": [3, 2.0], "c": True, "d": None, "e": None}


def test_the_environment_records_the_triton_version_without_importing_triton():
    """The GPU benchmarks run Triton kernels: their results depend on its version, which
    the environment left out. Read from its metadata: importing Triton costs 0.15 s."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("import sys; from skyformer.io import environment; env = environment(); "
            "print(env['triton'], 'triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ | {"TRITON_INTERPRET": "0"}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    version, imported = done.stdout.split()
    import triton

    assert (version, imported) == (triton.__version__, "False")


def test_the_environment_leaves_out_triton_where_it_cannot_be_imported(monkeypatch):
    import importlib.util

    from skyformer.io import environment

    real = importlib.util.find_spec
    monkeypatch.delitem(__import__("sys").modules, "triton", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else real(name, *args))
    assert "triton" not in environment()


def test_the_environment_records_the_version_of_the_code_that_ran(monkeypatch):
    """Code run from another source tree (PYTHONPATH) beside an installed copy: the
    version is the running package's, not the installed distribution's metadata."""
    import importlib.metadata

    import skyformer
    from skyformer.io import environment

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.0-installed")
    monkeypatch.setattr(skyformer, "__version__", "9.9.9-running")
    assert environment()["skyformer"] == "9.9.9-running"


def _windows_text_mode(monkeypatch):
    """Text files opened without ``newline=`` write each "\\n" as "\\r\\n", as on Windows
    (``os.fdopen`` and ``Path.open`` open through ``io.open``)."""
    import io

    real_open = io.open

    def io_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
                *args, **kwargs):
        if "b" not in mode and newline is None:
            newline = "\r\n"
        return real_open(file, mode, buffering, encoding, errors, newline, *args, **kwargs)

    monkeypatch.setattr(io, "open", io_open)


def _run_log_files(folder):
    from skyformer.eval.hf.report import write_csv as write_hf_csv
    from skyformer.lra.runlog import RunLog

    log = RunLog(folder, enabled=True, tensorboard=False)
    for step in (1, 2):
        log.record("train", step=step, loss=0.5)
    log.record("dev", step=2, accuracy=0.25)
    write_csv(folder / "rows.csv", [{"a": 1, "b": "x"}], metadata={"note": "n"})
    write_hf_csv(folder / "hf_eval.csv", [{"setting": "short", "method": "softmax"}])
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_result_files_are_the_same_bytes_on_windows(tmp_path, monkeypatch):
    """A CSV is built with its own line ends ("\\r\\n" from ``csv.DictWriter``): written
    through a text file that turns "\\n" into "\\r\\n", as Windows' are, every row of
    train.csv, dev.csv and hf_eval.csv ended in "\\r\\r\\n", which spreadsheets and
    ``csv`` readers take as an empty row after each one."""
    import csv

    expected = _run_log_files(tmp_path / "linux")
    _windows_text_mode(monkeypatch)
    written = _run_log_files(tmp_path / "windows")
    assert written == expected
    # one line end in every CSV: LRA's run logs ended theirs in "\r\n", the others in "\n"
    assert not any(b"\r" in content for name, content in written.items()
                   if name.endswith(".csv"))
    with open(tmp_path / "windows" / "train.csv", newline="", encoding="utf-8") as handle:
        assert len(list(csv.reader(handle))) == 3  # the header and two rows


def test_a_lock_left_by_an_earlier_process_of_this_id_is_taken_over(tmp_path):
    """A container restarted after a kill (same host name, the run again process 1, say)
    found its own ``HOST-PID`` in the lock the killed run left and refused itself as the
    run in use; a lock this process does not hold is a dead one's, while one it holds is
    still refused."""
    from skyformer.io import LOCK_FILE, folder_lock
    from skyformer.io.processes import builder_tag

    (tmp_path / LOCK_FILE).write_text(builder_tag() + "\n")  # the killed run's
    with folder_lock(tmp_path) as lock:
        assert lock.read_text() == builder_tag() + "\n"
        with pytest.raises(ValueError, match="is in use by another run"), \
                folder_lock(tmp_path):
            pass
        assert lock.exists()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_that_cannot_be_written_is_removed_and_an_empty_old_one_taken_over(
        tmp_path, monkeypatch):
    """On a full disk the lock was created but its name never written: the run failed
    with "[Errno 28] No space left on device" alone, and the empty lock it left refused
    every later run as "in use by another run" once space was freed."""
    import errno
    import time

    import skyformer.io.locks as locks
    from skyformer.io import EMPTY_LOCK_SECONDS, LOCK_FILE, folder_lock

    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):
        real_fdopen(fd).close()
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(locks.os, "fdopen", full_disk)
        with pytest.raises(OSError, match=r"cannot write the lock .*\.skyformer\.lock \(No "
                                          r"space left on device\): free space on its disk, "
                                          r"or choose another --out\."), \
                folder_lock(tmp_path):
            pass
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text("")  # a process that died before writing its name
    with pytest.raises(ValueError, match="is in use by another run"), folder_lock(tmp_path):
        pass  # just made: maybe being written now
    old = time.time() - EMPTY_LOCK_SECONDS - 1
    os.utime(tmp_path / LOCK_FILE, (old, old))
    with folder_lock(tmp_path) as lock:
        assert lock.read_text().strip()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_that_cannot_be_removed_hides_no_error_of_the_run(tmp_path, monkeypatch):
    """A folder turned read-only during the run: giving the lock back raised
    PermissionError over the run's own error (the write that failed). The run's error
    goes on; a run that ended well warns that the lock stays."""
    import pathlib

    from skyformer.io import folder_lock

    real_unlink = pathlib.Path.unlink

    def read_only(path, missing_ok=False):
        if path.name == ".skyformer.lock":
            raise PermissionError(13, "Permission denied")
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    with pytest.raises(RuntimeError, match="the run's own error"), folder_lock(tmp_path):
        raise RuntimeError("the run's own error")
    with pytest.warns(RuntimeWarning, match=r"could not remove the lock .* \(Permission "
                                            r"denied\); the next run on this host takes it "
                                            r"over"), folder_lock(tmp_path / "other"):
        pass


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_lock_of_a_killed_process_not_yet_collected_is_taken_over(tmp_path):
    """A run killed by a job driver that does not wait for it stays a zombie, which
    ``os.kill(pid, 0)`` still finds: its lock refused the --resume ("in use by another
    run") until the driver collected it."""
    import signal
    import subprocess
    import sys
    import time

    from skyformer.io import LOCK_FILE, folder_lock
    from skyformer.io.processes import builder_tag, process_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)  # not waited for: a zombie
        for _ in range(200):  # until the kernel has ended it
            with open(f"/proc/{child.pid}/stat") as stat_file:
                stat_line = stat_file.read()
            if stat_line[stat_line.rfind(")") + 2] == "Z":
                break
            time.sleep(0.01)
        assert not process_alive(child.pid)
        host = builder_tag().rsplit("-", 1)[0]
        (tmp_path / LOCK_FILE).write_text(f"{host}-{child.pid}\n")
        with folder_lock(tmp_path) as lock:  # taken over, not "in use by another run"
            assert lock.exists()
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid) and process_alive(os.getpid())


def test_a_folder_the_lock_made_is_removed_when_nothing_was_written_in_it(tmp_path):
    """A run refused once it held the lock (a missing model or cache) left the empty
    --out folder, and its parents, that only the lock had made."""
    from skyformer.io import folder_lock

    with pytest.raises(ValueError, match="refused"), folder_lock(tmp_path / "new" / "run"):
        raise ValueError("refused")
    assert os.listdir(tmp_path) == []
    with folder_lock(tmp_path / "new" / "run") as lock:
        (lock.parent / "result.json").write_text("{}")
    assert os.listdir(tmp_path / "new" / "run") == ["result.json"]
    (tmp_path / "kept").mkdir()
    with folder_lock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir()  # there before the run: left as it was


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(tmp_path):
    """A run killed while it wrote its results (SIGKILL: no finally) left its staging
    folder beside them, and no later run removed it; one of a live process stays."""
    import subprocess
    import sys

    from skyformer.io import replacing_together
    from skyformer.io.processes import builder_tag

    host = builder_tag().rsplit("-", 1)[0]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead = tmp_path / f".staging.{host}-{gone}.abcdefgh.tmp"
    alive = tmp_path / f".staging.{host}-{os.getppid()}.ijklmnop.tmp"  # a live process's
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "approx.png").write_bytes(b"")
    with replacing_together(tmp_path) as stage:
        (stage / "approx.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "approx.json"]


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path):
    """skyformer compare --qkv q.pt --json q.pt replaced the tensors with its results."""
    from skyformer.io import refuse_overwriting_inputs

    read = tmp_path / "q.pt"
    read.write_bytes(b"tensors")
    (tmp_path / "link.pt").symlink_to(read)
    for written in (read, tmp_path / "link.pt", tmp_path / "sub" / ".." / "q.pt"):
        with pytest.raises(ValueError, match=rf"^--json {re.escape(str(written))} is the "
                                             r"--qkv file: writing it would replace what the "
                                             r"run reads; choose another name\.$"):
            refuse_overwriting_inputs({"--json": written}, {"the --qkv file": read})
    with pytest.raises(ValueError, match=r"--maps .*new.png is the file --json writes too"):
        refuse_overwriting_inputs({"--json": tmp_path / "new.png", "--maps": tmp_path / "new.png"},
                                  {"the --qkv file": read})
    refuse_overwriting_inputs({"--json": "-", "--maps": None, "--out": tmp_path / "r.json"},
                              {"the --qkv file": read, "the --text file": None})


def test_a_dead_lock_taken_over_meanwhile_by_another_process_is_left_to_it(tmp_path,
                                                                          monkeypatch):
    """Two runs finding one dead lock: the second removed the lock the first had just
    made in its place, and both ran; the first to end then removed the other's lock."""
    import skyformer.io.locks as locks
    from skyformer.io import LOCK_FILE, folder_lock
    from skyformer.io.processes import builder_tag

    host = builder_tag().rsplit("-", 1)[0]
    lock = tmp_path / LOCK_FILE
    lock.write_text(f"{host}-999999999\n")  # a killed run's
    live = f"{host}-{os.getppid()}"  # a process that runs
    decide = locks._left_by_dead_process

    def another_run_takes_it_first(path, holder):
        dead = decide(path, holder)
        if dead:
            path.unlink()
            path.write_text(live + "\n")  # removed, and made anew, by the other run
        return dead

    monkeypatch.setattr(locks, "_left_by_dead_process", another_run_takes_it_first)
    in_use = rf"in use by another run \(process {os.getppid()} on {re.escape(host)} holds"
    with pytest.raises(ValueError, match=in_use), folder_lock(tmp_path):
        pass
    assert lock.read_text() == live + "\n" and sorted(os.listdir(tmp_path)) == [LOCK_FILE]
    monkeypatch.undo()
    lock.unlink()
    with folder_lock(tmp_path):
        lock.write_text(live + "\n")  # taken over by another run meanwhile
    assert lock.read_text() == live + "\n"  # its lock, left in place


def test_a_dead_lock_is_judged_by_one_run_at_a_time(tmp_path):
    """Three runs at one dead lock: the first removed it and made its own; the second,
    which had judged the dead one before, moved the first's aside to compare it; the
    third made its lock meanwhile, and the first's was not put back: two runs wrote one
    folder. Judging is now done under an flock of the folder, one run at a time."""
    fcntl = pytest.importorskip("fcntl")
    import threading

    from skyformer.io import LOCK_FILE, folder_lock
    from skyformer.io.processes import builder_tag

    host = builder_tag().rsplit("-", 1)[0]
    lock = tmp_path / LOCK_FILE
    lock.write_text(f"{host}-999999999\n")  # a killed run's
    outcome = []

    def second_run():
        try:
            with folder_lock(tmp_path):
                outcome.append("ran")
        except ValueError as err:
            outcome.append(str(err))

    judging = os.open(tmp_path, os.O_RDONLY)  # another run judging the dead lock now
    fcntl.flock(judging, fcntl.LOCK_EX)
    thread = threading.Thread(target=second_run)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and outcome == []  # waits for the judging to end
    live = f"{host}-{os.getppid()}"
    lock.write_text(live + "\n")  # that run removed the dead lock and took it
    os.close(judging)
    thread.join(10)
    assert len(outcome) == 1 and "in use by another run" in outcome[0]
    assert lock.read_text() == live + "\n"


def test_a_full_disk_names_the_file_and_the_cli_says_what_to_do(tmp_path, monkeypatch,
                                                                  capsys):
    """bench --out on a full disk said "[Errno 28] No space left on device" alone: no
    file, no way on; its plot failing after the JSON was marked complete left --resume
    nothing to do, and the plot could only be had by measuring again."""
    import errno

    import skyformer.io.atomic as atomic
    from skyformer.cli import main

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "r.json"
    target.write_text("before")
    with monkeypatch.context() as patched:
        patched.setattr(atomic.os, "fsync", full_disk)
        with pytest.raises(OSError, match=rf"^\[Errno 28\] No space left on device: "
                                          rf"'{re.escape(str(target))}'$"):
            atomic_write_text(target, "after")
    assert target.read_text() == "before" and os.listdir(tmp_path) == ["r.json"]

    pytest.importorskip("matplotlib")
    out = tmp_path / "p"
    argv = ["bench", "--methods", "softmax", "--seq-lens", "16", "--shapes", "1,1,4",
            "--repeats", "1", "--warmup", "0", "--no-memory", "--out", str(out)]

    def no_room(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr("matplotlib.figure.Figure.savefig", no_room)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"No space left on device: '{out}.png'" in err and "free space on that disk" in err
    assert not (tmp_path / "p.png").exists()
    assert main([*argv, "--resume"]) == 0  # not marked complete: written now
    assert (tmp_path / "p.png").exists()


def test_bench_and_approx_remove_the_temporary_files_a_killed_write_left(tmp_path, capsys):
    """Only lra train removed them: a kill -9 during a bench or approx write left
    ``.NAME.XXXXXXXX.tmp`` (a progress file's size) beside the results for good."""
    from skyformer.cli import main

    bench = tmp_path / "bench"
    bench.mkdir()
    left = [".p.json.abcdefgh.tmp", ".p.csv.a_c1efgh.tmp", ".p.png.abcdefgh.tmp.png"]
    for name in [*left, ".p.json.abc.tmp", ".q.json.abcdefgh.tmp"]:  # not ours: kept
        (bench / name).write_text("cut short")
    assert main(["bench", "--methods", "softmax", "--seq-lens", "16", "--shapes", "1,1,4",
                 "--repeats", "1", "--warmup", "0", "--no-memory", "--no-plot", "--out",
                 str(bench / "p")]) == 0
    assert sorted(p.name for p in bench.iterdir()) == [
        ".p.json.abc.tmp", ".q.json.abcdefgh.tmp", "p.csv", "p.json"]
    assert "removed 3 temporary file(s) of writes an interruption cut short" in \
        capsys.readouterr().err

    approx = tmp_path / "approx"
    approx.mkdir()
    (approx / "approx.progress.json").write_text("{}")  # refused without --resume
    (approx / ".approx.progress.json.abcdefgh.tmp").write_text("cut short")
    assert main(["approx", "--quick", "--no-plots", "--out", str(approx)]) == 2
    assert sorted(p.name for p in approx.iterdir()) == ["approx.progress.json"]


def test_a_dead_empty_lock_replaced_by_a_new_empty_one_is_left_to_its_maker(tmp_path,
                                                                           monkeypatch):
    """A lock left empty by a crash, judged dead; meanwhile another run removed it and
    made its own, not yet written: the two read alike, and the new one was removed as
    the dead one, so both runs went on."""
    import time

    import skyformer.io.locks as locks
    from skyformer.io import EMPTY_LOCK_SECONDS, LOCK_FILE, folder_lock

    lock = tmp_path / LOCK_FILE
    lock.write_text("")
    old = time.time() - EMPTY_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    decide = locks._left_by_dead_process

    def another_run_makes_its_own(path, holder):
        dead = decide(path, holder)
        if dead and holder == "":
            path.unlink()
            path.write_text("")  # made by the other run, its name not yet written
        return dead

    monkeypatch.setattr(locks, "_left_by_dead_process", another_run_makes_its_own)
    with pytest.raises(ValueError, match=r"in use by another run \(another process holds"), \
            folder_lock(tmp_path):
        pass
    assert lock.exists() and sorted(os.listdir(tmp_path)) == [LOCK_FILE]
