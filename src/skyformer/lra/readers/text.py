"""IMDb reviews (LRA Text) from the standard ``aclImdb/{train,test}/{pos,neg}/*.txt`` tree.

Byte-level tokens of the review without the ASCII whitespace around it, as TFDS's
``imdb_reviews``, which LRA reads, keeps each file (``read().strip()`` of its bytes).
IMDb has no validation split: LRA's pipeline (and the PyTorch code the Skyformer paper
used) validates on the test set, which turns "best dev checkpoint" into selection on test.
By default we hold out a seeded ``dev_fraction`` of the training reviews instead;
``dev_fraction=0`` reproduces the LRA behaviour and is recorded as ``dev_is_test`` in the
cache metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...seeds import check_seed
from ..cache import SplitSource
from ..vocab import encode_bytes
from .common import empty_document, locate

LABELS = {"neg": 0, "pos": 1}


def _reviews(folder: Path) -> list[tuple[Path, int]]:
    items = []
    for name, label in LABELS.items():
        sub = folder / name
        if not sub.is_dir():
            raise FileNotFoundError(f"missing folder {sub} (IMDb reviews labelled {name}).")
        # not the hidden "._NAME.txt" files a Mac writes beside each file on other disks
        # (and into its tar archives): each was read as one more review of the label
        files = sorted(f for f in sub.glob("*.txt") if not f.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"{sub} holds no *.txt reviews.")
        items.extend((f, label) for f in files)
    return items


def _examples(items: Sequence[tuple[Path, int]]) -> Iterator[tuple[list[np.ndarray], int]]:
    for path, label in items:
        raw = path.read_bytes()
        tokens = encode_bytes(raw.strip())  # module docstring: as TFDS keeps the review
        if tokens.size == 0:
            what = "is empty (0 bytes)" if not raw else "holds only whitespace"
            raise empty_document(f"{path} {what}", unit="file")
        yield [tokens], label


def read_text(src: str | Path, *, dev_fraction: float = 0.1, split_seed: int = 0
              ) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """Split sources and metadata of IMDb under ``src`` (the ``aclImdb`` folder or its parent)."""
    if not 0.0 <= dev_fraction < 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1), got {dev_fraction}.")
    check_seed("split_seed", split_seed)
    root = locate(src, "train", subfolders=("aclImdb",))
    if not (root / "test").is_dir():
        raise FileNotFoundError(f"missing folder {root / 'test'} (IMDb test reviews).")
    train, test = _reviews(root / "train"), _reviews(root / "test")
    meta: dict[str, Any] = {"source": str(root.resolve()), "dev_fraction": dev_fraction}
    if dev_fraction == 0:
        # the test reviews in a seeded order: they are listed negative first, and a dev
        # check during training reads the split's first batches (eval_batches)
        order = np.random.default_rng(split_seed).permutation(len(test))
        dev = [test[i] for i in order]
        meta["dev_is_test"] = True
        meta["split_seed"] = split_seed
    else:
        order = np.random.default_rng(split_seed).permutation(len(train))
        n_dev = max(1, round(dev_fraction * len(train)))
        dev = [train[i] for i in order[:n_dev]]
        train = [train[i] for i in np.sort(order[n_dev:])]
        meta["split_seed"] = split_seed
    held_out = (f"--dev-fraction {dev_fraction} holds out all {len(dev)} training reviews "
                f"under {root / 'train'} as dev")  # the one split that can be left empty
    splits = {name: SplitSource(len(items), _examples(items), empty=held_out)
              for name, items in (("train", train), ("dev", dev), ("test", test))}
    return splits, meta
