"""Real English text for the experiments, available offline."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

DEFAULT_TEXT_NAME = "public_domain_en.txt"


def default_text() -> str:
    """Public-domain English text shipped with the package (about 4,700 MiniLM tokens):
    the Declaration of Independence, the Gettysburg Address, Lincoln's Second Inaugural
    Address and the Preamble and Article I of the U.S. Constitution."""
    return resources.files("skyformer.data").joinpath(DEFAULT_TEXT_NAME).read_text("utf-8")


def read_text(path: str | Path | None) -> str:
    """The text of ``path`` (UTF-8), or the default text for ``None``."""
    if path is None:
        return default_text()
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"text file {str(p)!r} is a folder; pass a UTF-8 text file.")
    if not p.is_file():
        raise FileNotFoundError(f"text file {str(p)!r} does not exist (pass a UTF-8 text file).")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {str(p)!r} is not valid UTF-8: {err}.") from None
    if not text.strip():
        raise ValueError(f"text file {str(p)!r} is empty.")
    return text


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace collapsed, empty ones dropped."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def sentences(text: str, *, min_words: int = 4) -> list[str]:
    """Sentences of ``text``: paragraphs split after ``.``, ``!`` or ``?`` followed by a
    capital or a digit; sentences of fewer than ``min_words`` words (headings such as
    "Section. 2.") are dropped."""
    out = []
    for paragraph in paragraphs(text):
        out.extend(s for s in _SENTENCE_END.split(paragraph) if len(s.split()) >= min_words)
    return out
