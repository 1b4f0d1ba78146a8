"""Real English text for the experiments, available offline."""

from __future__ import annotations

import re
import unicodedata
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
        raise ValueError(f"text file {str(p)!r} is empty (or only whitespace); pass a UTF-8 "
                         f"text file with the text to measure on.")
    return text


# a break after . ! ? and whitespace, before an optional opening quote or bracket and the
# next sentence's first character (group 1: split there unless it is lowercase); or after a
# CJK full stop, exclamation or question mark, with or without whitespace
_CJK_END = "\u3002\uff01\uff1f"  # full stop, exclamation and question marks
_CJK_CLOSE = "\u300d\u300f\uff09"  # closing corner brackets and parenthesis
_SENTENCE_END = re.compile(rf"(?<=[.!?])\s+(?=[\"'(\[]?(\w))"
                           rf"|(?<=[{_CJK_END}])(?![{_CJK_END}{_CJK_CLOSE}])\s*(?=\S)")


# a word before a full stop that does not end a sentence, after an optional opening
# quote: a title, or letters each followed by a full stop ("U.S.", "e.g."); not one
# letter alone, which is as often a numeral ("Article I. Section 1.") as an initial
_ABBREVIATION = re.compile(r"[\"'(\[]?(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|Mt|Rev|Gen|Gov|Sen"
                           r"|Rep|vs|(?:[^\W\d_]\.)+[^\W\d_])\.")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace collapsed, empty ones dropped."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _split_sentences(paragraph: str) -> list[str]:
    """``paragraph`` cut at every ``_SENTENCE_END`` not followed by a lowercase letter nor
    preceded by an ``_ABBREVIATION`` (a cut after "Mr." or "U.S." left a piece too short
    to keep, and the sentence lost its start)."""
    out, start = [], 0
    for end in _SENTENCE_END.finditer(paragraph):
        first = end.group(1)
        if first is not None and (first.islower() or first == "_"):  # "e.g. the", "a. _x"
            continue
        last_word = paragraph[start : end.start()].rsplit(None, 1)[-1]
        if first is not None and _ABBREVIATION.fullmatch(last_word):
            continue
        out.append(paragraph[start : end.start()])
        start = end.end()
    out.append(paragraph[start:])
    return out


def _words(sentence: str) -> int:
    """Whitespace-separated words, each wide (CJK) letter counted as one."""
    wide = sum(1 for c in sentence if c.isalpha() and unicodedata.east_asian_width(c) == "W")
    return len(sentence.split()) + wide


def sentences(text: str, *, min_words: int = 4) -> list[str]:
    """Sentences of ``text``: paragraphs split after ``.``, ``!`` or ``?`` followed by a
    letter that is not lowercase (a capital in any script, or a letter of a script without
    case) or a digit, and after the CJK full stop, exclamation and question marks (U+3002,
    U+FF01, U+FF1F), but not after a title ("Mr.", "Dr.") or a dotted abbreviation ("U.S.":
    a sentence ending with one runs on into the next); sentences of fewer than ``min_words``
    words (headings such as "Section. 2."; a CJK character counts as a word) are dropped."""
    out = []
    for paragraph in paragraphs(text):
        out.extend(s for s in _split_sentences(paragraph) if _words(s) >= min_words)
    return out
