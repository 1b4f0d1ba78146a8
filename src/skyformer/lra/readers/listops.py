"""ListOps from the LRA release: ``basic_{train,val,test}.tsv`` with columns Source, Target.

Source is the nested expression as the LRA generator writes it, e.g.
``( ( ( [MAX 2 ) 9 ) ] )``; Target its value 0-9. Tokens as LRA's pipeline keeps
them, or as the earlier pipeline the Skyformer code used did (``tokens="reference"``; see
``vocab.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import SplitSource
from ..vocab import check_listops_tokenizer, encode_listops
from .common import count_rows, empty_document, locate, no_rows, require_file, tsv_rows

FILES = {"train": "basic_train.tsv", "dev": "basic_val.tsv", "test": "basic_test.tsv"}
GENERATOR_RECORD = "generator.json"  # written by `skyformer lra generate listops`


def _target(text: str, path: Path, number: int) -> int:
    """The label 0-9 of a Target field, or a sentence naming the file and line."""
    try:
        label = int(text)
    except ValueError:
        label = -1  # not an integer ("9.0", empty): refused below with the field as given
    if not 0 <= label <= 9:
        raise ValueError(f"{path} line {number}: Target (column 2) must be a digit 0-9, got "
                         f"{text!r}.")
    return label


def _examples(path: Path, tokens: str) -> Iterator[tuple[list[np.ndarray], int]]:
    dropped = "parentheses" if tokens == "lra" else "parentheses and ']'"
    for number, (source, target) in tsv_rows(path, 2, header="Source"):
        try:
            ids = encode_listops(source, tokens)
        except ValueError as err:
            raise ValueError(f"{path} line {number}: {err}") from None
        label = _target(target, path, number)
        if ids.size == 0:
            raise empty_document(f"{path} line {number}: Source (column 1) holds no ListOps "
                                 f"token ({dropped} do not count)")
        yield [ids], label


def read_listops(src: str | Path, tokens: str = "lra"
                 ) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """Split sources and metadata of the ListOps files in ``src`` (or ``src/listops-1000``).

    tokens: ``"lra"`` (operators, digits and ``]``) or ``"reference"`` (operators and
    digits: the pipeline of the Skyformer code). The metadata records a ``"reference"``
    tokenization, so a run started on one cannot resume on the other.
    """
    check_listops_tokenizer(tokens)
    folder = locate(src, FILES["train"], subfolders=("listops-1000", "listops"))
    splits = {}
    for split, name in FILES.items():
        path = require_file(folder / name, f"ListOps {split} split, tab-separated Source, Target")
        splits[split] = SplitSource(count_rows(path, header="Source"), _examples(path, tokens),
                                    empty=no_rows(path))
    meta: dict[str, Any] = {"source": str(folder.resolve())}
    if tokens != "lra":  # absent for LRA's tokens, as in caches made before the option
        meta["tokens"] = tokens
    record = folder / GENERATOR_RECORD
    if record.is_file():
        meta["generated"] = _generator_record(record)
    return splits, meta


def _generator_record(record: Path) -> Any:
    """The settings `lra generate listops` wrote beside its files (they name the data in
    the cache's record), or a sentence naming the damaged file."""
    try:
        return json.loads(record.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{record} is damaged ({err}): it records how `skyformer lra generate "
                         "listops` made the files beside it; generate them again, or remove "
                         "it if they are not generated.") from None
