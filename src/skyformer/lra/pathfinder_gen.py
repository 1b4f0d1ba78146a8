"""A small synthetic Pathfinder generator (clearly labelled synthetic).

Pathfinder (Linsley et al., 2018; LRA's 32 x 32 version) asks whether two marked
dots are joined by one of several dashed, curved paths. This generator draws images
of the same kind: ``2 + distractors`` dashed paths, each a chain of ``dashes`` short
straight dashes whose heading turns by at most ``max_turn`` radians between dashes.
For label 1 the two dots sit on the two ends of one path; for label 0 on one end each
of two different paths, so both classes show the same number of paths and dots.
Paths keep ``clearance`` pixels between each other (Chebyshev distance, dots
included), which makes the label a property of the picture: growing every lit pixel
by one pixel joins the dashes of a path but never two paths.

Output is the release layout read by ``readers.pathfinder``: ``imgs/<k>/sample_<i>.png``
and text ``metadata/<k>.npy`` lines ``imgs/<k> sample_<i>.png <i> <label>``, plus a
``SYNTHETIC.txt`` marker that the reader copies into the cache metadata, so results
on this data are reported as synthetic.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_positive_int
from ..seeds import check_seed
from .generated import generated_folder
from .readers.pathfinder import SYNTHETIC_MARKER, pil_image

IMAGES_PER_FOLDER = 1000
MAX_RESOLUTION = 1024  # a batch of images is drawn in memory: 1024^2 bytes each


@dataclass(frozen=True)
class PathfinderRules:
    """Geometry of the synthetic images (lengths in pixels)."""

    resolution: int = 32
    dashes: int = 6
    dash_length: float = 2.0
    gap_length: float = 1.5
    max_turn: float = 0.6
    distractors: int = 1
    clearance: int = 4
    dot_radius: int = 1
    margin: int = 1

    def __post_init__(self) -> None:
        if not 8 <= self.resolution <= MAX_RESOLUTION:
            raise ValueError(f"Pathfinder resolution (--resolution) must be in 8.."
                             f"{MAX_RESOLUTION} (LRA's are 32 to 256), got {self.resolution}.")
        if self.dashes < 1 or self.dash_length <= 0 or self.gap_length < 0:
            raise ValueError(f"Pathfinder paths need dashes (--dashes) >= 1, dash_length > 0 "
                             f"and gap_length >= 0, got {self.dashes}, {self.dash_length} and "
                             f"{self.gap_length}.")
        if self.gap_length > 2.0:
            raise ValueError("gap_length must be at most 2 pixels so that growing the lit pixels "
                             "by one pixel joins the dashes of a path.")
        if self.clearance < 4:
            raise ValueError("clearance must be at least 4 pixels so that growing the lit pixels "
                             "by one pixel never joins two paths.")
        if self.distractors < 0:
            raise ValueError(f"distractors must be >= 0, got {self.distractors}.")


@dataclass
class Drawing:
    """One image and how it was drawn: paths as pixel lists, dots as (row, col)."""

    image: np.ndarray  # [resolution, resolution] uint8
    label: int
    paths: list[np.ndarray] = field(default_factory=list)  # each [P, 2] int (row, col)
    dots: list[tuple[int, int]] = field(default_factory=list)


def _disc_offsets(radius: int) -> np.ndarray:
    """Pixel offsets ``[K, 2]`` of a dot of the given radius."""
    span = np.arange(-radius, radius + 1)
    dr, dc = np.meshgrid(span, span, indexing="ij")
    keep = dr**2 + dc**2 <= radius * radius + radius
    return np.stack([dr[keep], dc[keep]], axis=1)


def _path_shape(rng: np.random.Generator, rules: PathfinderRules
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random dashed path at the origin: lit pixels ``[P, 2]`` and end points ``[2]``.

    Pixels are the dash points (sampled every 1/4 pixel) rounded to the grid after a
    random sub-pixel shift; coordinates are (row, col), shifted so the minimum is 0.
    """
    headings = rng.uniform(0, 2 * math.pi) + np.cumsum(
        rng.uniform(-rules.max_turn, rules.max_turn, size=rules.dashes))  # [dashes]
    directions = np.stack([np.sin(headings), np.cos(headings)], axis=1)  # [dashes, 2]
    period = rules.dash_length + rules.gap_length
    starts = np.concatenate([np.zeros((1, 2)), np.cumsum(directions * period, axis=0)[:-1]])
    t = np.arange(0.0, rules.dash_length + 1e-9, 0.25)  # [T]
    points = starts[:, None, :] + t[None, :, None] * directions[:, None, :]  # [dashes, T, 2]
    points = np.rint(points.reshape(-1, 2) + rng.uniform(0, 1, size=2)).astype(np.int64)
    points -= points.min(axis=0)
    return np.unique(points, axis=0), points[0], points[-1]


def _place(rng: np.random.Generator, rules: PathfinderRules, blocked: np.ndarray,
           tries: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]] | None:
    """A path placed uniformly among the positions where its footprint (pixels and both
    end dots) stays inside the margin and off ``blocked``; None after ``tries`` shapes."""
    disc = _disc_offsets(rules.dot_radius)
    lo, hi = rules.margin, rules.resolution - 1 - rules.margin
    for _ in range(tries):
        pixels, start, end = _path_shape(rng, rules)
        footprint = np.unique(np.concatenate([pixels, start + disc, end + disc]), axis=0)
        low, high = footprint.min(axis=0), footprint.max(axis=0)
        rows = np.arange(lo - low[0], hi - high[0] + 1)
        cols = np.arange(lo - low[1], hi - high[1] + 1)
        if rows.size == 0 or cols.size == 0:
            continue
        shift = np.stack(np.meshgrid(rows, cols, indexing="ij"), axis=-1).reshape(-1, 2)  # [S, 2]
        cells = footprint[None, :, :] + shift[:, None, :]  # [S, F, 2]
        free = ~blocked[cells[..., 0], cells[..., 1]].any(axis=1)  # [S]
        if not free.any():
            continue
        offset = shift[rng.choice(np.flatnonzero(free))]
        return (pixels + offset, tuple(int(v) for v in start + offset),
                tuple(int(v) for v in end + offset))
    return None


def _footprint(points: np.ndarray, ends: tuple, rules: PathfinderRules) -> np.ndarray:
    grid = np.zeros((rules.resolution, rules.resolution), dtype=bool)
    grid[points[:, 0], points[:, 1]] = True
    for end in ends:
        disc = np.asarray(end) + _disc_offsets(rules.dot_radius)
        grid[disc[:, 0], disc[:, 1]] = True
    return grid


def _grow(grid: np.ndarray, radius: int) -> np.ndarray:
    """Pixels within Chebyshev distance ``radius`` of a True pixel."""
    padded = np.pad(grid, radius)
    out = np.zeros_like(grid)
    n, m = grid.shape
    for dr in range(2 * radius + 1):
        for dc in range(2 * radius + 1):
            out |= padded[dr:dr + n, dc:dc + m]
    return out


def draw_example(rng: np.random.Generator, rules: PathfinderRules, label: int,
                 attempts: int = 50) -> Drawing:
    """Draw one image with the given label (1 = dots connected)."""
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}.")
    wanted = 2 + rules.distractors
    for _ in range(attempts):
        blocked = np.zeros((rules.resolution, rules.resolution), dtype=bool)
        paths = []
        for _ in range(wanted):
            placed = _place(rng, rules, blocked, tries=20)
            if placed is None:
                break
            points, start, end = placed
            blocked |= _grow(_footprint(points, (start, end), rules), rules.clearance - 1)
            paths.append(placed)
        if len(paths) < wanted:
            continue
        dots = [paths[0][1], paths[0][2]] if label == 1 else [paths[0][1], paths[1][1]]
        image = np.zeros((rules.resolution, rules.resolution), dtype=np.uint8)
        for points, _, _ in paths:
            image[points[:, 0], points[:, 1]] = 255
        disc = _disc_offsets(rules.dot_radius)
        for dot in dots:
            cells = np.asarray(dot) + disc
            image[cells[:, 0], cells[:, 1]] = 255
        return Drawing(image, label, [p[0] for p in paths], dots)
    raise ValueError(f"could not place {wanted} paths (2 for the dots, {rules.distractors} "
                     f"distractors) of {rules.dashes} dashes with clearance {rules.clearance} "
                     f"on a {rules.resolution} x {rules.resolution} canvas; "
                     + ("lower --distractors or --dashes, or raise --resolution."
                        if rules.distractors else "lower --dashes or raise --resolution."))


def write_pathfinder(out: str | os.PathLike[str], count: int, *,
                     rules: PathfinderRules | None = None, seed: int = 0,
                     replace: bool = False) -> Path:
    """Write ``count`` synthetic images (labels balanced at random) in the release layout.

    ``out`` must be new or empty, or ``replace`` given (see ``generated``); it is written
    whole or not at all. Returns the folder to pass to ``skyformer lra prepare pathfinder
    --src``.
    """
    rules = rules or PathfinderRules()
    check_positive_int("count", count)
    check_seed("seed", seed)
    folder = Path(out)
    image = pil_image("writing Pathfinder images")  # before any folder is made
    # Files are written plainly in tmp: renaming tmp to ``folder`` is the one atomic step.
    with generated_folder(folder, "pathfinder", ["imgs", "metadata", SYNTHETIC_MARKER],
                          SYNTHETIC_MARKER, replace=replace) as tmp:
        _write_images(tmp, count, rules, seed, image)
    return folder


def _write_images(folder: Path, count: int, rules: PathfinderRules, seed: int,
                  image: Any) -> None:
    """``image``: Pillow's ``Image`` module."""
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines: dict[int, list[str]] = {}
    for i in range(count):
        k = i // IMAGES_PER_FOLDER
        label = int(rng.integers(2))
        drawing = draw_example(rng, rules, label)
        target = folder / "imgs" / str(k)
        target.mkdir(parents=True, exist_ok=True)
        image.fromarray(drawing.image, mode="L").save(target / f"sample_{i}.png")
        lines.setdefault(k, []).append(f"imgs/{k} sample_{i}.png {i} {label}")
    for k, rows in lines.items():
        (folder / "metadata" / f"{k}.npy").write_text("\n".join(rows) + "\n", encoding="utf-8")
    note = {"synthetic": True, "generator": "skyformer.lra.pathfinder_gen", "seed": seed,
            "count": count, "rules": asdict(rules)}
    (folder / SYNTHETIC_MARKER).write_text(
        "Synthetic Pathfinder-like images, not the LRA release.\n" + json.dumps(note) + "\n",
        encoding="utf-8")
