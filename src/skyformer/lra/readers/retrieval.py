"""AAN document retrieval (LRA Retrieval) from ``new_aan_pairs.{train,eval,test}.tsv``.

Rows: label, id1, id2, text1, text2 (no header; labels are written ``0``/``1`` or
``0.0``/``1.0``). Each document becomes byte-level tokens; the pair is one example
with two segments for the dual encoder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import SplitSource
from ..vocab import encode_bytes
from .common import count_rows, empty_document, locate, no_rows, require_file, tsv_rows

FILES = {"train": "new_aan_pairs.train.tsv", "dev": "new_aan_pairs.eval.tsv",
         "test": "new_aan_pairs.test.tsv"}


def _label(text: str, path: Path, number: int) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{path} line {number}: the label column holds {text!r}, expected 0 "
                         "or 1.") from None
    if value not in (0.0, 1.0):
        raise ValueError(f"{path} line {number}: label must be 0 or 1, got {text!r}.")
    return int(value)


def _examples(path: Path) -> Iterator[tuple[list[np.ndarray], int]]:
    for number, fields in tsv_rows(path, 5, header="label\t"):
        label = _label(fields[0], path, number)
        documents = [encode_bytes(text.encode("utf-8")) for text in fields[3:5]]
        for column, tokens in enumerate(documents, start=4):
            if tokens.size == 0:
                raise empty_document(f"{path} line {number}: text{column - 3} (column {column}) "
                                     "is empty")
        yield documents, label


def read_retrieval(src: str | Path) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """Split sources and metadata of the AAN pair files in ``src`` (or ``src/tsv_data``)."""
    folder = locate(src, FILES["train"], subfolders=("tsv_data", "retrieval"))
    splits = {}
    for split, name in FILES.items():
        path = require_file(folder / name, f"AAN {split} pairs: label, id1, id2, text1, text2")
        splits[split] = SplitSource(count_rows(path, header="label\t"), _examples(path),
                                    empty=no_rows(path))
    return splits, {"source": str(folder.resolve())}
