"""Processes named in the temporary folders and locks that runs leave: ``HOST-PID``, and
whether such a process still runs."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def builder_tag() -> str:
    """``HOST-PID`` of this process, as it names its temporary folders: on a file system
    shared between machines, a process id means something only on its own host."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def process_alive(pid: int) -> bool:
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
    return not zombie(pid)


def zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended and waits for its parent to collect it (its
    state in ``/proc/PID/stat`` is Z; False where there is no such file to read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses
    return stat[stat.rfind(")") + 1:].split()[:1] == ["Z"]
