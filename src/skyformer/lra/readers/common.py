"""Helpers shared by the task readers: locating the release files and naming problems."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path


def locate(src: str | Path, marker: str, *, subfolders: tuple[str, ...] = ()) -> Path:
    """The folder holding ``marker``: ``src`` itself or one of ``src/<subfolder>``.

    Fails with a sentence naming what was expected where.
    """
    root = Path(src).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist.")
    if not root.is_dir():  # an archive of the release, or one of its files
        raise FileNotFoundError(
            f"{root} is a file; --src takes the folder holding {marker!r} (unpack an "
            f"archive first, e.g. tar -xzf, and give the folder it makes).")
    for folder in (root, *(root / s for s in subfolders)):
        if (folder / marker).exists():
            return folder
    places = ", ".join(str(root / s / marker) for s in ("", *subfolders))
    raise FileNotFoundError(f"expected {marker!r} in {root}; looked for {places}.")


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path} ({what}).")
    return path


def empty_document(where: str, unit: str = "line") -> ValueError:
    """The error for a document without tokens, named by ``where`` (the file, and the line
    for tab-separated files), with what to do about it."""
    return ValueError(f"{where}; a model cannot attend over no tokens: delete the {unit} or "
                      "give it its text, then prepare again.")


def _content_lines(path: Path, header: str | None) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of the lines that are rows: not blank, not the header.

    A line is blank when it holds only ASCII whitespace; the header is a first line starting
    with ``header``. A UTF-8 byte order mark opening the file is left out: it marks the
    encoding (an editor's "UTF-8 with BOM"), it is not text of the first field.
    ``count_rows`` and ``tsv_rows`` both read through here, so the number of rows counted
    is the number of rows read.
    """
    prefix = None if header is None else header.encode()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
                if prefix is not None and raw.startswith(prefix):
                    continue
            if raw.strip():  # ASCII whitespace only: a line of a non-ASCII blank is a row
                yield number, raw


def no_rows(path: Path) -> str:
    """Why a tab-separated file gives a split no examples (``SplitSource.empty``)."""
    return f"{path} holds no rows (a header and blank lines do not count)"


def count_rows(path: Path, *, header: str | None = None) -> int:
    """Number of non-empty lines of a text file, minus a first line starting with ``header``."""
    return sum(1 for _ in _content_lines(path, header))


def text_lines(path: Path, *, header: str | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the rows of a UTF-8 text file, without the line end.

    Line numbers count from 1, the header included, as an editor shows them. A first
    line starting with ``header`` is skipped; blank lines are ignored. A line that is not
    UTF-8 is named by the file, line and byte.
    """
    for number, raw in _content_lines(path, header):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} line {number}: not UTF-8 (byte {raw[err.start]:#04x} at "
                f"column {err.start + 1}); the release files are UTF-8 text."
            ) from None
        yield number, line.rstrip("\r\n")


def tsv_rows(path: Path, columns: int, *, header: str | None = None
             ) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of a tab-separated UTF-8 file with ``columns`` fields,
    its lines read as ``text_lines`` reads them."""
    for number, line in text_lines(path, header=header):
        fields = line.split("\t")
        if len(fields) != columns:
            raise ValueError(
                f"{path} line {number}: expected {columns} tab-separated columns, got "
                f"{len(fields)}."
            )
        yield number, fields
