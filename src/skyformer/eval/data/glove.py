"""Word vectors from a GloVe-format text file (KDEformer section 4.1's data).

Format: one vector per line, ``word x_1 ... x_d``, separated by spaces (or tabs); an optional
word2vec-style first line ``count dim`` is skipped. A line's vector is the run of
numbers that ends it, less its first field (the word, which may itself be a number);
the dimension d is that of the first vector line. A word that itself contains spaces
(glove.840B has a few, ``. . .``, ``at name@domain.com``) is allowed, on the first line
too, where the field before the vector is not a number: a line whose run of numbers is
longer than d is refused (a vector of another width, not a spaced word), as are
non-finite values. Only as many lines as needed are read, so multi-gigabyte files cost
nothing extra.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import Tensor


def _is_number(field: str) -> bool:
    """Whether ``field`` reads as a float (``nan`` and ``inf`` included)."""
    try:
        float(field)
    except ValueError:
        return False
    return True


def _numbers_at_end(fields: list[str]) -> int:
    """How many of ``fields`` after the first (the word) are numbers, counted from the end."""
    count = 0
    for field in reversed(fields[1:]):
        if not _is_number(field):
            break
        count += 1
    return count


def _floats(fields: list[str], path: Path, line_no: int) -> list[float]:
    try:
        values = [float(x) for x in fields]
    except ValueError:
        raise ValueError(
            f"{str(path)!r} line {line_no} is not in GloVe format (word followed by numbers): "
            f"{' '.join(fields[:4])!r}..."
        ) from None
    bad = [field for field, x in zip(fields, values, strict=True) if not math.isfinite(x)]
    if bad:
        raise ValueError(
            f"{str(path)!r} line {line_no} holds {bad[0]!r}, not a finite number; GloVe "
            f"vectors must be finite: fix or remove that line."
        )
    return values


def _width(fields: list[str], path: Path, line_no: int) -> int:
    """The dimension d, from the first vector line: its run of numbers at the end."""
    dim = _numbers_at_end(fields)
    if dim < 1:
        raise ValueError(
            f"{str(path)!r} line {line_no} has no numbers after the word; "
            f"expected 'word x_1 ... x_d'."
        )
    return dim


def _vector(fields: list[str], dim: int, path: Path, line_no: int) -> list[float]:
    """The last ``dim`` fields of a line as floats, refusing a line of another width."""
    if len(fields) < dim + 1:
        raise ValueError(
            f"{str(path)!r} line {line_no} has {len(fields) - 1} numbers, the first "
            f"vector has {dim}; the file is not a consistent GloVe file."
        )
    vector = _floats(fields[-dim:], path, line_no)
    if len(fields) > dim + 1 and _is_number(fields[-dim - 1]):
        raise ValueError(
            f"{str(path)!r} line {line_no} has {_numbers_at_end(fields)} numbers after "
            f"the word, the first vector has {dim}; the file is not a consistent GloVe "
            f"file (a word with spaces may not end in a number)."
        )
    return vector


def _fields(line: str) -> list[str]:
    """A line's fields, split where GloVe's tokenizer splits: at spaces and tabs only, so
    a word that is or holds a Unicode space (NBSP, U+3000) stays one field."""
    return [field for field in re.split(r"[ \t]+", line.strip(" \t\r\n")) if field]


def read_glove(path: str | Path, count: int, *, at_most: bool = False) -> Tensor:
    """The first ``count`` vectors of a GloVe-format file: ``[count, d]`` float64 (with
    ``at_most``, all of them where the file holds fewer, instead of the sentence)."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"GloVe file {str(p)!r} is a folder; pass --glove FILE.")
    if not p.is_file():
        raise FileNotFoundError(f"GloVe file {str(p)!r} does not exist (pass --glove FILE).")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}.")
    rows: list[list[float]] = []
    dim: int | None = None
    first = True  # the first non-blank line: it may be a word2vec header
    # utf-8-sig: a byte-order mark before a word2vec header would hide the header
    with p.open("r", encoding="utf-8-sig", errors="replace") as handle:
        for line_no, line in enumerate(handle, start=1):
            fields = _fields(line)
            if not fields:
                continue
            if first:
                first = False
                if len(fields) == 2 and all(f.isdigit() for f in fields):
                    continue  # word2vec header "count dim"
            if dim is None:
                dim = _width(fields, p, line_no)
            rows.append(_vector(fields, dim, p, line_no))
            if len(rows) == count:
                break
    if len(rows) < count and not at_most:
        raise ValueError(
            f"{str(p)!r} holds {len(rows)} vectors, {count} are needed; use a larger file, "
            f"shorter sequences or fewer heads."
        )
    return torch.tensor(rows, dtype=torch.float64)
