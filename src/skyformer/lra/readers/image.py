"""CIFAR-10 (LRA Image) from the official binary batches (``cifar-10-batches-bin``).

Each record is 1 label byte then 3 x 1024 bytes (red, green, blue planes, row-major).
As in LRA the image becomes one grey level per pixel, as ``tf.image.rgb_to_grayscale``
computes it from uint8 channels: in float32, ``g = 0.2989 R' + 0.5870 G' + 0.1140 B'``
with ``C' = C / 255``, then ``trunc(255.5 g)`` (``convert_image_dtype`` back to uint8),
1024 tokens with 256 values. Splits: the first 90 % of the training records (45,000)
train, the last 10 % (5,000) validate, ``test_batch.bin`` tests; LRA takes TFDS's
``train[:90%]`` and ``train[90%:]``, 90/10 as here but of TFDS's record order, which
need not be the release files' (another random 10 % may validate there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import SplitSource
from .common import locate, require_file

RECORD = 1 + 3 * 1024
RECORDS_PER_FILE = 10_000
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
GREY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)


def grey_levels(rgb: np.ndarray) -> np.ndarray:
    """``[N, 3, P]`` uint8 channels -> ``[N, P]`` uint8 grey levels, as
    ``tf.image.rgb_to_grayscale`` on uint8 images (module docstring; float32 throughout,
    the weighted sum in channel order)."""
    unit = rgb.astype(np.float32) * np.float32(1 / 255)
    grey = (unit[:, 0] * GREY_WEIGHTS[0] + unit[:, 1] * GREY_WEIGHTS[1]) \
        + unit[:, 2] * GREY_WEIGHTS[2]
    return np.clip(np.trunc(grey * np.float32(255.5)), 0, 255).astype(np.uint8)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Grey images ``[N, 1024]`` uint8 and labels ``[N]`` of one binary batch file."""
    require_file(path, "CIFAR-10 binary batch")
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % RECORD:
        raise ValueError(
            f"{path} has {raw.size} bytes; a CIFAR-10 binary batch holds records of {RECORD} "
            f"bytes (label + 3072 pixels), {RECORDS_PER_FILE * RECORD} bytes in all."
        )
    records = raw.reshape(-1, RECORD)
    labels = records[:, 0].astype(np.int64)
    if labels.max() > 9:  # a CIFAR-100 file (3074-byte records) fails the size check above
        i = int(np.argmax(labels > 9))
        raise ValueError(f"{path} record {i + 1} (byte offset {i * RECORD}) has label "
                         f"{labels[i]}; CIFAR-10 labels are 0-9: the file is damaged, unpack it "
                         "again from cifar-10-binary.tar.gz.")
    return grey_levels(records[:, 1:].reshape(-1, 3, 1024)), labels


def _examples(images: np.ndarray, labels: np.ndarray) -> Iterator[tuple[list[np.ndarray], int]]:
    for image, label in zip(images, labels, strict=True):
        yield [image], int(label)


def _batches_folder(src: str | Path) -> Path:
    """The folder of the binary batches: ``src`` or ``src/cifar-10-batches-bin``. A folder
    of the python version instead is named as such, with the version to get."""
    try:
        return locate(src, TRAIN_FILES[0], subfolders=("cifar-10-batches-bin",))
    except FileNotFoundError:
        root = Path(src).expanduser()
        for folder in (root, root / "cifar-10-batches-py"):
            if (folder / "data_batch_1").is_file():  # never unpickled: that runs code
                raise FileNotFoundError(
                    f"{folder} holds CIFAR-10's python version (pickled batches, as "
                    "torchvision downloads it); the reader takes the binary version, which "
                    "LRA's TFDS loader reads too: get cifar-10-binary.tar.gz from the "
                    "CIFAR-10 page and give the folder it unpacks to, cifar-10-batches-bin, "
                    "as --src.") from None
        raise


def read_image(src: str | Path) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """Split sources and metadata of the CIFAR-10 binary batches in ``src``."""
    folder = _batches_folder(src)
    parts = [read_batch(folder / name) for name in TRAIN_FILES]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    cut = int(0.9 * len(labels))
    test_images, test_labels = read_batch(folder / TEST_FILE)
    splits = {
        "train": SplitSource(cut, _examples(images[:cut], labels[:cut])),
        "dev": SplitSource(len(labels) - cut, _examples(images[cut:], labels[cut:])),
        "test": SplitSource(len(test_labels), _examples(test_images, test_labels)),
    }
    return splits, {"source": str(folder.resolve()),
                    "grey_weights": [round(float(w), 4) for w in GREY_WEIGHTS],
                    "grey_levels": "tf.image.rgb_to_grayscale of uint8: float32, trunc(255.5 g)"}
