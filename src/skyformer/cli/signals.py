"""A termination request ends a command as Ctrl-C does.

SIGTERM is how a batch scheduler pre-empts or cancels a job (SLURM, then SIGKILL after a
grace period), and what ``kill``, ``timeout`` and ``docker stop`` send. Python's default
ends the process at once: no ``finally`` runs, so a run's ``.skyformer.lock`` stays (a job
requeued on another host is then refused), temporary files stay, and nothing says what
was kept. Inside ``terminating_as_interrupt`` it raises ``Terminated`` instead, which the
command's clean-ups see as the ``KeyboardInterrupt`` it is a kind of.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where the signal is handled."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    """Raise ``Terminated`` once; a second SIGTERM while the clean-ups run is ignored
    (they are short: files removed, a lock given back; SIGKILL still ends the process)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextmanager
def terminating_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` inside the block; the handler that was there is put
    back after it. Left as it is outside the main thread (Python handles signals there
    only) and where a handler other than the default is set (the caller's own)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
