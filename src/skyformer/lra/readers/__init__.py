"""Readers of the LRA release formats, one per task: ``read_<task>(src, **options)`` returns
``(splits, meta)`` with a ``SplitSource`` per split (train, dev, test)."""

from __future__ import annotations

from .image import read_image
from .listops import read_listops
from .pathfinder import read_pathfinder
from .retrieval import read_retrieval
from .text import read_text

READERS = {
    "listops": read_listops,
    "text": read_text,
    "retrieval": read_retrieval,
    "image": read_image,
    "pathfinder": read_pathfinder,
}

__all__ = ["READERS", "read_image", "read_listops", "read_pathfinder", "read_retrieval",
           "read_text"]
