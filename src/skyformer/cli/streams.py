"""Standard streams that outlive their reader: ``skyformer approx | head -3`` shows three
lines and still writes every result file, as the same run with no pipe does."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class ReaderGoneStream:
    """``stream`` (``sys.stdout`` or ``sys.stderr``) whose writes stop failing once its
    reader has gone (``BrokenPipeError``: ``| head`` read what it wanted): from then on
    the stream's file descriptor points at ``os.devnull``, so what follows, the
    interpreter's final flush included, is dropped quietly and the run goes on to its
    end (its result files). Anything else is ``stream``'s own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        """Point the stream's descriptor at the null device (what its buffer still holds
        goes there too)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _surviving(stream: TextIO | None) -> ReaderGoneStream | None:
    """``stream`` as a ``ReaderGoneStream``; None (a stream closed when Python started,
    ``skyformer list >&-``) stays None, which ``print`` skips."""
    return None if stream is None else ReaderGoneStream(stream)


@contextmanager
def surviving_closed_pipes() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as ``ReaderGoneStream`` inside the block, the
    streams given back after it."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _surviving(saved[0]), _surviving(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
