"""The output folder of ``skyformer lra generate``: one data set at a time, whole.

A generator fills a temporary folder next to ``--out`` and renames it into place when
done, so an interrupted run leaves the folder as it was, never new files next to old
ones (images under old labels, a new train split with an old test split). A folder
that already holds files is refused unless ``replace`` is given, and even then only
when it holds nothing but what the generator writes, its record (``marker``) included:
the public release's folders hold files of the same names, and no generator record.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..io import building_folder


@contextmanager
def generated_folder(out: str | os.PathLike[str], kind: str, written: Iterable[str],
                     marker: str, *, replace: bool = False) -> Iterator[Path]:
    """A temporary folder to write ``kind``'s files (``written``: the names it creates
    at the top, ``marker`` among them, the record only a generator writes) that becomes
    ``out`` when the block ends without error."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file; choose a folder for --out.")
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if present and not replace:
        raise FileExistsError(
            f"{folder} already holds files ({', '.join(present[:5])}); generate into a new or "
            f"empty folder, or pass --replace to replace the {kind} data generated there.")
    here = Path.cwd().resolve()  # (an empty one too: the rename replaces it as well)
    if folder.is_dir() and (folder.resolve() == here or folder.resolve() in here.parents):
        raise ValueError(
            f"--out {out} is the folder this process works in (or holds it): replacing "
            f"it would leave the shell in a deleted folder; cd to the folder above "
            f"{folder.resolve()} and pass its name as --out.")
    foreign = sorted(set(present) - set(written))
    if foreign:
        raise FileExistsError(
            f"{folder} holds {', '.join(foreign[:5])}, which `generate {kind}` does not write; "
            "--replace only replaces generated data: choose another --out.")
    if present and marker not in present:
        raise FileExistsError(
            f"{folder} holds no {marker}, which `generate {kind}` writes beside its data: "
            f"its files ({', '.join(present[:5])}) are not generated data (the public "
            f"release's?); --replace only replaces generated data: choose another --out.")
    with building_folder(folder) as tmp:
        yield tmp
