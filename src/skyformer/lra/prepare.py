"""``skyformer lra prepare``: read a task's release files once into the array cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .cache import default_cache_root, write_cache
from .readers import READERS
from .tasks import get_task


def prepare(task: str, src: str | os.PathLike[str],
            cache_root: str | os.PathLike[str] | None = None, *, max_len: int | None = None,
            **options: Any) -> Path:
    """Convert the files of ``task`` under ``src`` into ``<cache_root>/<task>``.

    max_len: tokens kept per document (default: the task's LRA length; for Pathfinder
        the number of pixels of its images). Longer documents are truncated.
    options: reader options (Text: ``dev_fraction``, ``split_seed``; Pathfinder:
        ``difficulty``, ``split_seed``; ListOps: ``tokens``, ``"lra"`` or ``"reference"``).
    Returns the cache folder.
    """
    spec = get_task(task)
    splits, meta = READERS[task](src, **options)
    if max_len is None:
        max_len = meta["resolution"] ** 2 if "resolution" in meta else spec.max_len
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    return write_cache(root, spec, splits, max_len=max_len, meta=meta)
