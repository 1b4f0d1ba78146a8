"""Pathfinder from the LRA release layout ``pathfinder32/<difficulty>/{imgs,metadata}``.

``metadata/<k>.npy`` files are, despite their suffix, text: one line per image with
space-separated fields, field 0 the image folder (``imgs/<k>``), field 1 the file name
and field 3 the label (1 = the two dots are connected). Images are 8-bit grey PNGs;
each becomes ``resolution**2`` pixel tokens. The release contains a few empty (0-byte)
images; like LRA's own loader we skip those and count them in the metadata. Anything
else that is not a readable grey image of the common size is an error naming the file.

Splits as in the PyTorch LRA code the Skyformer paper used: a seeded shuffle, then
80 % train, 10 % dev, 10 % test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...seeds import check_seed
from ..cache import SplitSource
from .common import locate, text_lines

DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
DEFAULT_DIFFICULTY = "curv_contour_length_14"
SYNTHETIC_MARKER = "SYNTHETIC.txt"  # written by `skyformer lra generate pathfinder`


def pil_image(needs: str = "reading Pathfinder images") -> Any:
    """Pillow's ``Image`` module; ``needs`` (what the caller does) opens the sentence that
    names the extra to install when Pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(f"{needs} needs Pillow: pip install pillow "
                          "(or pip install 'skyformer[lra]').") from None
    return Image


def _metadata(folder: Path) -> tuple[list[tuple[Path, int]], int]:
    meta_dir = folder / "metadata"
    # not the hidden "._NAME.npy" files a Mac writes beside each file on other disks
    files = sorted((p for p in meta_dir.glob("*.npy") if not p.name.startswith(".")),
                   key=lambda p: (len(p.stem), p.stem))
    if not files:
        raise FileNotFoundError(f"{meta_dir} holds no metadata files (*.npy).")
    samples, empty = [], 0
    for path in files:
        for number, line in text_lines(path):
            fields = line.split()
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise ValueError(
                    f"{path} line {number}: expected 'folder file index label ...' with label "
                    f"0 or 1, got {line[:80]!r}."
                )
            image = folder / fields[0] / fields[1]
            if not image.is_file():
                raise FileNotFoundError(f"missing {image} (listed in {path} line {number}).")
            if image.stat().st_size == 0:
                empty += 1
                continue
            samples.append((image, int(fields[3])))
    if not samples:
        raise ValueError(f"{folder} lists no readable images.")
    return samples, empty


def load_grey(path: Path, size: int | None = None, sized_by: Path | None = None
              ) -> np.ndarray:
    """Pixels of a grey PNG as a flat uint8 array; checks that it is square, and its
    side length if given (that of ``sized_by``, the image named in the sentence)."""
    Image = pil_image()
    try:
        with Image.open(path) as img:
            pixels = np.asarray(img.convert("L"), dtype=np.uint8)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable image ({err}).") from None
    shape = f"{path} is {pixels.shape[1]} x {pixels.shape[0]} pixels"
    if pixels.shape[0] != pixels.shape[1]:
        raise ValueError(f"{shape}; Pathfinder's images are square.")
    if size is not None and pixels.shape[0] != size:
        first = f" ({sized_by}, the first image listed, is)" if sized_by is not None else ""
        raise ValueError(f"{shape}; expected {size} x {size}{first}: the images of one "
                         f"difficulty are all one size.")
    return pixels.reshape(-1)


def _examples(samples: Sequence[tuple[Path, int]], size: int, first: Path
              ) -> Iterator[tuple[list[np.ndarray], int]]:
    for path, label in samples:
        yield [load_grey(path, size, first)], label


def _difficulty_folder(src: str | Path, difficulty: str | None) -> Path:
    """The folder holding ``metadata/``: ``src/<difficulty>``, ``src`` itself or (the
    release's root) ``src/pathfinder32/<difficulty>``, absolute,
    so that its name is the difficulty also for ``.`` or ``..``. A ``difficulty`` given for
    a ``src`` that is itself another difficulty folder is refused rather than ignored."""
    root = Path(src).expanduser()
    if difficulty is not None and (root / difficulty / "metadata").exists():
        return Path(os.path.abspath(root / difficulty))
    # the name as given (a symlink keeps it), the name the metadata records; "." resolved
    name = difficulty or DEFAULT_DIFFICULTY  # also under the release root's pathfinder32/
    folder = Path(os.path.abspath(
        locate(root, "metadata", subfolders=(name, f"pathfinder32/{name}"))))
    if difficulty is not None and folder.name != difficulty:
        raise ValueError(f"{folder} is itself a difficulty folder (it holds metadata/), not "
                         f"{difficulty}; drop --difficulty, or give the folder holding "
                         f"{difficulty}/ as --src.")
    return folder


def read_pathfinder(src: str | Path, *, difficulty: str | None = None,
                    split_seed: int = 0) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """Split sources and metadata of one Pathfinder difficulty.

    ``src`` is the difficulty folder itself (holding ``metadata/``), or the resolution
    folder (e.g. ``pathfinder32``) holding ``<difficulty>/metadata``. ``difficulty``
    (default ``curv_contour_length_14``) picks the sub-folder of a resolution folder;
    given with a difficulty folder, it must be that folder's name.
    """
    check_seed("split_seed", split_seed)
    folder = _difficulty_folder(src, difficulty)
    samples, empty = _metadata(folder)
    side = int(np.sqrt(load_grey(samples[0][0]).size))
    order = np.random.default_rng(split_seed).permutation(len(samples))
    a, b = int(0.8 * len(samples)), int(0.9 * len(samples))
    parts = {"train": order[:a], "dev": order[a:b], "test": order[b:]}
    few = (f"{folder} lists {len(samples)} readable images, too few for its 80/10/10 split "
           "(10 give every split one)")
    splits = {
        name: SplitSource(len(idx), _examples([samples[i] for i in idx], side, samples[0][0]),
                          empty=few)
        for name, idx in parts.items()
    }
    marker = folder / SYNTHETIC_MARKER
    meta: dict[str, Any] = {
        "source": str(folder.resolve()),
        # generated data's folder name is the --out it was given: a moved or renamed
        # copy is the same data (its fingerprint leaves the path out)
        "difficulty": "synthetic" if marker.is_file() else folder.name,
        "resolution": side,
        "empty_images_skipped": empty,
        "split_seed": split_seed,
    }
    if marker.is_file():
        meta["synthetic"] = True
        meta["synthetic_note"] = marker.read_text(encoding="utf-8").strip()
    return splits, meta
