"""Tiny files in the LRA release formats, written by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from skyformer.lra import ListOpsRules


def write_tsv(path: Path, rows: list[list[str]], header: list[str] | None = None) -> Path:
    lines = (["\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_listops_release(folder: Path) -> dict[str, list[tuple[str, int]]]:
    rows = {
        "basic_train.tsv": [("( ( ( [MAX 2 ) 9 ) ] )", 9), ("( ( ( [MIN 4 ) 7 ) ] )", 4),
                            ("( ( ( ( [SM 5 ) 8 ) ( ( ( [MED 1 ) 3 ) ] ) ) ] )", 5)],
        "basic_val.tsv": [("( ( ( [MED 2 ) 6 ) ] )", 4)],
        "basic_test.tsv": [("7", 7), ("( ( ( [SM 9 ) 9 ) ] )", 8)],
    }
    for name, items in rows.items():
        write_tsv(folder / name, [[s, str(t)] for s, t in items], header=["Source", "Target"])
    return rows


def make_imdb(folder: Path) -> Path:
    root = folder / "aclImdb"
    texts = {
        ("train", "pos"): ["A great film.", "Loved it <br /> truly", "Wonderful", "Superb acting"],
        ("train", "neg"): ["Awful.", "Boring plot", "Terrible", "Waste of time"],
        ("test", "pos"): ["Brilliant caf\u00e9 scene", "Fine"],
        ("test", "neg"): ["Bad", "Dull"],
    }
    for (split, label), items in texts.items():
        sub = root / split / label
        sub.mkdir(parents=True)
        for i, text in enumerate(items):
            (sub / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(text, encoding="utf-8")
    (root / "train" / "unsup").mkdir()  # present in the real tree, not used
    return root


def make_aan(folder: Path) -> dict[str, Path]:
    rows = {
        "new_aan_pairs.train.tsv": [["1", "a1", "b1", "graph parsing", "parsing graphs"],
                                    ["0.0", "a2", "b2", "speech", "vision"],
                                    ["1.0", "a3", "b3", "x" * 50, "y"]],
        "new_aan_pairs.eval.tsv": [["0", "a4", "b4", "alpha", "beta"]],
        "new_aan_pairs.test.tsv": [["1", "a5", "b5", "gamma", "gamma"]],
    }
    return {name: write_tsv(folder / name, r) for name, r in rows.items()}


def make_cifar(folder: Path, records: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Binary batches with ``records`` images each; returns (rgb [6 * records, 3, 1024], labels)."""
    rng = np.random.default_rng(seed)
    root = folder / "cifar-10-batches-bin"
    root.mkdir(parents=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    all_rgb, all_labels = [], []
    for name in names:
        labels = rng.integers(0, 10, size=records).astype(np.uint8)
        rgb = rng.integers(0, 256, size=(records, 3, 1024)).astype(np.uint8)
        data = np.concatenate([labels[:, None], rgb.reshape(records, -1)], axis=1)
        (root / name).write_bytes(data.tobytes())
        all_rgb.append(rgb)
        all_labels.append(labels)
    return np.concatenate(all_rgb), np.concatenate(all_labels)


def make_pathfinder_release(folder: Path, count: int = 20, size: int = 32, seed: int = 0
                            ) -> tuple[Path, dict[str, tuple[np.ndarray, int]]]:
    """``pathfinder32/curv_contour_length_14`` with random grey PNGs, two metadata files
    and one empty image (as in the release). Returns the root and name -> (pixels, label)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = folder / "pathfinder32"
    diff = root / "curv_contour_length_14"
    (diff / "metadata").mkdir(parents=True)
    images = {}
    lines: dict[int, list[str]] = {0: [], 1: []}
    for i in range(count):
        k = i % 2
        sub = diff / "imgs" / str(k)
        sub.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(size, size)).astype(np.uint8)
        label = int(rng.integers(2))
        Image.fromarray(pixels, mode="L").save(sub / f"sample_{i}.png")
        images[f"sample_{i}.png"] = (pixels.reshape(-1), label)
        lines[k].append(f"imgs/{k} sample_{i}.png {i} {label} 7.5 3")
    (diff / "imgs" / "0" / "sample_empty.png").write_bytes(b"")
    lines[0].append("imgs/0 sample_empty.png 99 1 0 0")
    for k, rows in lines.items():
        (diff / "metadata" / f"{k}.npy").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root, images


# Single operators over 2-4 digits: learnable in a few dozen steps.
TINY_RULES = ListOpsRules(max_depth=2, max_args=4, min_length=3, max_length=7)
