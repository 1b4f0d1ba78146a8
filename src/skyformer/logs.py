"""The library's log messages go through ``logging`` (logger ``"skyformer"`` and its
children); it prints nothing by itself. The ``skyformer`` command turns them on with
``enable_console``, which writes them to standard output through ``tqdm.write`` so that
they do not break a progress bar."""

from __future__ import annotations

import logging
import sys

ROOT = "skyformer"


def get_logger(name: str) -> logging.Logger:
    """The library logger ``skyformer.<name>``."""
    return logging.getLogger(f"{ROOT}.{name}")


class _Console(logging.Handler):
    """Writes records to the current ``sys.stdout`` (looked up at each record, so that
    redirections made later, e.g. by pytest's capture, are followed), each flushed as
    ``logging.StreamHandler`` flushes: a log file (``> train.log``, where stdout is
    block-buffered) shows every line when it is logged, not kilobytes later, and keeps
    the last ones when the run is killed. A closed standard output (``None``: the
    command's ``>&-``, ``cli/streams.py``) drops the record, as ``print`` does."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        out = sys.stdout
        if out is None:
            return
        try:
            tqdm.write(self.format(record), file=out)
            out.flush()
        except Exception:  # a logging handler must not raise
            self.handleError(record)


def enable_console(level: int = logging.INFO) -> None:
    """Print the library's messages (``level`` and above) on standard output; idempotent."""
    root = logging.getLogger(ROOT)
    root.setLevel(level)
    if not any(isinstance(h, _Console) for h in root.handlers):
        handler = _Console()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none): the
    reason a one-line sentence or a table row quotes."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
