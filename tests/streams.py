"""A standard stream for tests of what reaches a log file when."""

from __future__ import annotations

import io


class FlushRecorder(io.StringIO):
    """A stdout that tells what was flushed (what a log file holds by then) from what a
    block-buffered stream would still hold back."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed = ""

    def flush(self) -> None:
        self.flushed = self.getvalue()
