"""Word vectors from a GloVe-format text file (KDEformer section 4.1's data).

Format: one vector per line, ``word x_1 ... x_d``, separated by spaces; an optional
word2vec-style first line ``count dim`` is skipped. The dimension d is read from the
first vector line; a word that itself contains spaces (glove.840B has a few) is
allowed, since the last d fields are taken as the vector. Only as many lines as needed
are read, so multi-gigabyte files cost nothing extra.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor


def _floats(fields: list[str], path: Path, line_no: int) -> list[float]:
    try:
        return [float(x) for x in fields]
    except ValueError:
        raise ValueError(
            f"{str(path)!r} line {line_no} is not in GloVe format (word followed by numbers): "
            f"{' '.join(fields[:4])!r}..."
        ) from None


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
    with p.open("r", encoding="utf-8", errors="replace") as handle:
        for line_no, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            if dim is None:
                if line_no == 1 and len(fields) == 2 and all(f.isdigit() for f in fields):
                    continue  # word2vec header "count dim"
                dim = len(fields) - 1
                if dim < 1:
                    raise ValueError(
                        f"{str(p)!r} line {line_no} has no numbers after the word; "
                        f"expected 'word x_1 ... x_d'."
                    )
            if len(fields) < dim + 1:
                raise ValueError(
                    f"{str(p)!r} line {line_no} has {len(fields) - 1} numbers, the first "
                    f"vector has {dim}; the file is not a consistent GloVe file."
                )
            rows.append(_floats(fields[-dim:], p, line_no))
            if len(rows) == count:
                break
    if len(rows) < count and not at_most:
        raise ValueError(
            f"{str(p)!r} holds {len(rows)} vectors, {count} are needed; use a larger file, "
            f"shorter sequences or fewer heads."
        )
    return torch.tensor(rows, dtype=torch.float64)
