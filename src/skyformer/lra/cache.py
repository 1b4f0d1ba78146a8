"""The prepared-data cache: one folder per task of plain ``.npy`` arrays plus ``meta.json``.

Layout of ``<cache root>/<task>/``::

    meta.json                 task, lengths, counts, label counts, digests, source, notes
    <split>.tokens.npy        [N, S, L] uint8/uint16  token ids, right padded with 0
    <split>.lengths.npy       [N, S] int32            real tokens per document
    <split>.labels.npy        [N] int64

S is 1, or 2 for Retrieval's document pairs. Arrays are written through
``numpy.lib.format.open_memmap`` (streaming, no pickle) and opened memory-mapped
with ``allow_pickle=False``. The folder is built under a temporary name and renamed
into place only when complete, so an interrupted ``prepare`` never leaves a cache
that looks usable.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_positive_int
from ..io import building_folder
from .tasks import SPLITS, TaskSpec, get_task

CACHE_FORMAT = 1
CACHE_ENV = "SKYFORMER_LRA_CACHE"
# The tasks ``skyformer lra generate`` writes data for, in the release's format.
GENERATED_TASKS = {"listops": "ListOps by LRA's rules",
                   "pathfinder": "synthetic Pathfinder-like images"}


def default_cache_root() -> Path:
    """``$SKYFORMER_LRA_CACHE`` (a leading ``~`` is the home folder) or
    ``~/.cache/skyformer/lra``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skyformer" / "lra"


@dataclass
class SplitSource:
    """What a reader hands to the cache writer for one split.

    count: number of examples ``examples`` yields.
    examples: ``(segments, label)`` pairs; ``segments`` holds S 1-D integer arrays
        (any length: longer ones are truncated to the cache's max length).
    empty: why there are none when ``count`` is 0, naming the file or folder at fault
        (``data/basic_val.tsv holds no rows``), for the sentence refusing the split.
    """

    count: int
    examples: Iterable[tuple[Sequence[np.ndarray], int]]
    empty: str = ""


@dataclass(frozen=True)
class SplitData:
    """One split of a prepared task (memory-mapped arrays)."""

    tokens: np.ndarray  # [N, S, L]
    lengths: np.ndarray  # [N, S]
    labels: np.ndarray  # [N]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class TaskData:
    """A prepared task: its spec, cache folder, metadata and splits."""

    task: TaskSpec
    root: Path
    meta: dict[str, Any]
    splits: dict[str, SplitData]

    @property
    def max_len(self) -> int:
        return int(self.meta["max_len"])

    @property
    def synthetic(self) -> bool:
        return bool(self.meta.get("synthetic", False))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16)


def cache_dir(cache_root: str | os.PathLike[str], task: str) -> Path:
    return Path(cache_root).expanduser() / task


def split_digest(tokens: np.ndarray, lengths: np.ndarray, labels: np.ndarray,
                 rows: int = 4096) -> str:
    """SHA-256 of a split's arrays (``tokens: [N, S, L]``, ``lengths: [N, S]``, ``labels:
    [N]``, their bytes in that order), read ``rows`` examples at a time so that a
    memory-mapped split is never loaded whole. It tells apart prepared data that its
    counts, label counts and mean lengths do not: other examples, or the same in another
    order (another data order in training)."""
    digest = hashlib.sha256()
    for array in (tokens, lengths, labels):
        for start in range(0, array.shape[0], rows):
            digest.update(np.ascontiguousarray(array[start:start + rows]).tobytes())
    return digest.hexdigest()


def _write_split(folder: Path, name: str, task: TaskSpec, source: SplitSource,
                 max_len: int) -> dict[str, Any]:
    if source.count <= 0:
        why = f": {source.empty}" if source.empty else ""
        raise ValueError(f"the {name} split of {task.name} has no examples{why}; a model "
                         "needs examples to train on, select with and test on: add them, "
                         "then prepare again.")
    n, s = source.count, task.segments
    dtype = token_dtype(task.vocab_size)
    tokens = np.lib.format.open_memmap(folder / f"{name}.tokens.npy", "w+", dtype, (n, s, max_len))
    lengths = np.lib.format.open_memmap(folder / f"{name}.lengths.npy", "w+", np.int32, (n, s))
    labels = np.lib.format.open_memmap(folder / f"{name}.labels.npy", "w+", np.int64, (n,))
    i, truncated = -1, 0
    for i, (segments, label) in enumerate(source.examples):
        if i >= n:
            raise ValueError(f"the {name} split of {task.name} yields more than the {n} "
                             "examples announced.")
        if len(segments) != s:
            raise ValueError(f"{task.name} examples have {s} document(s), got {len(segments)}.")
        if not 0 <= int(label) < task.num_classes:
            raise ValueError(f"{task.name} {name} example {i}: label {label} is outside "
                             f"0..{task.num_classes - 1}.")
        for j, seg in enumerate(segments):
            seg = np.asarray(seg)
            truncated += seg.size > max_len
            seg = seg[:max_len]
            if seg.size == 0:
                raise ValueError(f"{task.name} {name} example {i}: document {j} is empty; a "
                                 f"model cannot attend over no tokens.")
            if seg.min() < 0 or seg.max() >= task.vocab_size:
                raise ValueError(f"{task.name} {name} example {i}: token ids must lie in "
                                 f"0..{task.vocab_size - 1}.")
            tokens[i, j, : seg.size] = seg
            lengths[i, j] = seg.size
        labels[i] = int(label)
    if i + 1 != n:
        raise ValueError(f"the {name} split of {task.name} announced {n} examples but "
                         f"yielded {i + 1}.")
    for array in (tokens, lengths, labels):
        array.flush()
    counts = np.bincount(np.asarray(labels), minlength=task.num_classes)
    info = {
        "count": n,
        "label_counts": counts.tolist(),
        "mean_length": float(np.asarray(lengths).mean()),
        "truncated": int(truncated),  # documents longer than max_len
        "sha256": split_digest(tokens, lengths, labels),
    }
    del tokens, lengths, labels
    return info


def write_cache(
    cache_root: str | os.PathLike[str],
    task: TaskSpec,
    splits: dict[str, SplitSource],
    *,
    max_len: int,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``splits`` (train, dev, test) to ``<cache_root>/<task>``, atomically.

    Returns the cache folder. An existing cache of the task is replaced only once the
    new one is complete.
    """
    if sorted(splits) != sorted(SPLITS):
        raise ValueError(f"a cache needs the splits {', '.join(SPLITS)}, got {', '.join(splits)}.")
    check_positive_int("max_len", max_len)
    _refuse_other_files(cache_dir(cache_root, task.name))
    # Files are written plainly in tmp: renaming tmp to the cache folder is the one atomic step.
    with building_folder(cache_dir(cache_root, task.name)) as tmp:
        infos = {name: _write_split(tmp, name, task, splits[name], max_len) for name in SPLITS}
        record = {
            "format": CACHE_FORMAT,
            "task": task.name,
            "max_len": max_len,
            "segments": task.segments,
            "vocab_size": task.vocab_size,
            "num_classes": task.num_classes,
            "token_dtype": token_dtype(task.vocab_size).name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(meta or {}),
            "splits": infos,
        }
        (tmp / "meta.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return cache_dir(cache_root, task.name)


def _refuse_other_files(folder: Path) -> None:
    """Refuse to replace ``folder`` (a task's cache folder) where it holds anything but
    a cache's files: the source data themselves, where ``--cache`` names the folder that
    holds them (the readers look for a ``listops/`` or ``retrieval/`` folder)."""
    if not folder.is_dir():
        return
    cache_files = {"meta.json", *(f"{split}.{part}.npy" for split in SPLITS
                                  for part in ("tokens", "lengths", "labels"))}
    present = [p.name for p in folder.iterdir()]
    # a cache's hidden extras (a file manager's .DS_Store) go with it
    other = sorted(name for name in present if name not in cache_files
                   and not ("meta.json" in present and name.startswith(".")))
    if other:
        raise FileExistsError(
            f"{folder} holds {', '.join(other[:5])}, which a prepared cache does not: "
            f"preparing would replace the folder whole; pass another --cache (the cache's "
            f"task folder must not be, or hold, the source files).")


def data_fingerprint(meta: dict[str, Any]) -> dict[str, Any]:
    """What identifies prepared data: its ``meta.json`` (length, counts, label counts, mean
    lengths, the arrays' digests, reader and generator records) without the time of
    preparation and the source path, so that preparing the same files again, or a moved
    copy, gives the same one."""
    return {k: v for k, v in meta.items() if k not in ("created", "source")}


def load_cache(cache_root: str | os.PathLike[str], task: str) -> TaskData:
    """Open the prepared cache of ``task`` (arrays memory-mapped, read-only)."""
    spec = get_task(task)
    folder = cache_dir(cache_root, task)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        given = Path(cache_root).expanduser()
        if (given / "meta.json").is_file():  # a task's own folder was given
            raise FileNotFoundError(
                f"{given} is a task's folder (it holds meta.json), not the cache root: "
                f"pass its parent, --cache {given.parent}"
                + ("." if given.name == task else
                   f" (it holds {given.name}; {task} is prepared into {task}/ there)."))
        generated = (f", or a folder `skyformer lra generate {task} --out PATH` writes "
                     f"({GENERATED_TASKS[task]})" if task in GENERATED_TASKS else "")
        raise FileNotFoundError(
            f"no prepared {task} data in {folder} (missing {meta_path.name}); run "
            f"`skyformer lra prepare {task} --src PATH --cache {Path(cache_root)}` first, "
            f"PATH being the task's files of the public LRA release (docs/lra.md){generated}."
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}); prepare the task "
                         "again.") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} holds a {type(meta).__name__}, not a cache description; "
                         "prepare the task again.")
    if meta.get("format") != CACHE_FORMAT or meta.get("task") != task:
        raise ValueError(
            f"{folder} holds a cache of format {meta.get('format')!r} for task "
            f"{meta.get('task')!r}; this version reads format {CACHE_FORMAT} for {task!r}: "
            "prepare the task again."
        )
    _check_meta(meta, meta_path)
    splits = {}
    for name in SPLITS:
        arrays = []
        for part in ("tokens", "lengths", "labels"):
            path = folder / f"{name}.{part}.npy"
            try:
                arrays.append(np.load(path, mmap_mode="r", allow_pickle=False))
            except (OSError, ValueError, EOFError) as err:
                raise ValueError(f"cannot read {path} ({err}); prepare the task again.") from None
        tokens, lengths, labels = arrays
        n = meta["splits"][name]["count"]
        if tokens.shape != (n, spec.segments, meta["max_len"]) or lengths.shape != (
            n, spec.segments
        ) or labels.shape != (n,):
            raise ValueError(
                f"{folder}: the {name} arrays have shapes {tokens.shape}, {lengths.shape}, "
                f"{labels.shape}, which do not match meta.json; prepare the task again."
            )
        _check_values(folder, name, spec, meta["max_len"], tokens, lengths, labels)
        recorded = meta["splits"][name].get("sha256")
        if isinstance(recorded, str) and split_digest(tokens, lengths, labels) != recorded:
            raise ValueError(
                f"{folder}: the {name} arrays are not those meta.json recorded when they were "
                f"prepared (their SHA-256 differs): a file was changed or replaced since; "
                f"prepare the task again.")
        splits[name] = SplitData(tokens, lengths, labels)
    return TaskData(spec, folder, meta, splits)


def _check_meta(meta: dict, meta_path: Path) -> None:
    """meta.json has what the reader uses: ``max_len`` and a count per split."""
    max_len, splits = meta.get("max_len"), meta.get("splits")
    counts_ok = isinstance(splits, dict) and all(
        isinstance(splits.get(name), dict) and isinstance(splits[name].get("count"), int)
        and splits[name]["count"] > 0 for name in SPLITS)
    if not isinstance(max_len, int) or max_len <= 0 or not counts_ok:
        raise ValueError(f"{meta_path} lacks a positive max_len or an example count for each "
                         f"of the splits {', '.join(SPLITS)}; prepare the task again.")


def _check_values(folder: Path, name: str, spec: TaskSpec, max_len: int, tokens: np.ndarray,
                  lengths: np.ndarray, labels: np.ndarray) -> None:
    """Integer arrays whose values a model can take: token ids in [0, vocab), lengths in
    [1, max_len], labels in [0, classes). One pass over the memory-mapped arrays."""
    problems = []
    for part, array in (("tokens", tokens), ("lengths", lengths), ("labels", labels)):
        if not np.issubdtype(array.dtype, np.integer):
            problems.append(f"{part} are {array.dtype}, not integers")
    if not problems:
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= spec.vocab_size):
            problems.append(f"token ids lie outside [0, {spec.vocab_size})")
        if int(lengths.min()) < 1 or int(lengths.max()) > max_len:
            problems.append(f"lengths lie outside [1, {max_len}]")
        if int(labels.min()) < 0 or int(labels.max()) >= spec.num_classes:
            problems.append(f"labels lie outside [0, {spec.num_classes})")
    if problems:
        raise ValueError(f"{folder}: in the {name} split, {'; '.join(problems)}; the cache is "
                         f"damaged: prepare the task again.")
