"""A ListOps generator following the rules of the LRA release (Tay et al., 2020; after
Nangia & Bowman, 2018), writing the release's ``basic_{train,val,test}.tsv`` format.

A tree is a digit 0-9, or an operator applied to 2..``max_args`` sub-trees:
MIN, MAX, MED (median; the mean of the two middle values rounded down when the count
is even) and SM (sum modulo 10). Above ``max_depth`` a node is an operator with
probability ``value_p`` (0.25), otherwise a digit; at ``max_depth`` it is a digit.
A tree's length counts operators, closing brackets and digits (the tokens the model
sees); LRA keeps trees with ``min_length < length < max_length`` (500 and 2000) and
drops duplicates. The string form nests each argument in parentheses the way the
release does: ``[MAX 2 9 ]`` is written ``( ( ( [MAX 2 ) 9 ) ] )``.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..checks import check_positive_int
from ..seeds import check_seed
from .generated import generated_folder
from .readers.listops import FILES, GENERATOR_RECORD
from .vocab import LISTOPS_CLOSE, LISTOPS_OPERATORS

Tree = int | tuple[str, list["Tree"]]

MAX_DEPTH_LIMIT = 100  # trees are built recursively


@dataclass(frozen=True)
class ListOpsRules:
    """Generation rules; defaults are LRA's."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    value_p: float = 0.25

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_args", "min_length", "max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ListOps {name} must be an integer >= 0, got {value!r}.")
        if not 1 <= self.max_depth <= MAX_DEPTH_LIMIT:
            raise ValueError(f"ListOps max_depth must be in 1..{MAX_DEPTH_LIMIT}, got "
                             f"{self.max_depth}.")
        if self.max_args < 2:
            raise ValueError(f"ListOps max_args must be at least 2, got {self.max_args}.")
        if not 0.0 < self.value_p <= 1.0:
            raise ValueError(f"ListOps value_p must be in (0, 1], got {self.value_p}.")
        if self.min_length + 1 >= self.max_length:
            raise ValueError(
                f"no length lies strictly between min_length={self.min_length} and "
                f"max_length={self.max_length}."
            )
        if self.longest() <= self.min_length:
            raise ValueError(
                f"trees of depth <= {self.max_depth} with <= {self.max_args} arguments have at "
                f"most {self.longest()} tokens, not more than min_length={self.min_length}; "
                "raise max_depth or max_args, or lower min_length."
            )
        lengths = self.lengths()
        if not any(self.min_length < n < self.max_length for n in lengths):
            below = max((n for n in lengths if n <= self.min_length), default=None)
            above = min((n for n in lengths if n >= self.max_length), default=None)
            raise ValueError(
                f"no tree of depth <= {self.max_depth} with <= {self.max_args} arguments has "
                f"a length strictly between min_length={self.min_length} and max_length="
                f"{self.max_length} (the nearest lengths are {below} and {above}); widen the "
                f"window."
            )

    def lengths(self) -> list[int]:
        """The tree lengths the rules can make, up to ``max_length + 1``: a tree is a
        digit (1) or an operator, its bracket and 2..max_args subtrees one level
        deeper (above the deepest level, a digit only where ``value_p < 1``)."""
        size = self.max_length + 2  # lengths 0 .. max_length + 1
        level = np.zeros(size, dtype=bool)
        level[1] = True  # the deepest trees are digits
        for _ in range(self.max_depth - 1):
            sums = np.zeros(size, dtype=bool)
            sums[0] = True  # the sums of 0, 1, 2, ... subtrees' lengths
            totals = np.zeros(size, dtype=bool)
            for count in range(1, self.max_args + 1):
                sums = _sums(sums, level)
                if count >= 2:
                    totals |= sums
            level = np.zeros(size, dtype=bool)
            level[1] = self.value_p < 1  # value_p = 1: digits at the deepest level only
            level[2:] = totals[:-2]
        return np.flatnonzero(level).tolist()

    def longest(self) -> int:
        """Length of the largest tree the rules allow."""
        length = 1
        for _ in range(self.max_depth - 1):
            length = 2 + self.max_args * length
        return length


def _sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Which totals ``i + j`` (``a[i]`` and ``b[j]`` set) occur, below ``len(a)``: a
    convolution by FFT (counts far from 0.5 either way)."""
    n = 2 * len(a)
    product = np.fft.irfft(np.fft.rfft(a, n) * np.fft.rfft(b, n), n)[: len(a)]
    return product > 0.5


def random_tree(rng: random.Random, rules: ListOpsRules, depth: int = 1) -> tuple[Tree, int]:
    """A random tree and its length (operators + closing brackets + digits)."""
    if depth < rules.max_depth and rng.random() < rules.value_p:
        args, length = [], 2
        for _ in range(rng.randint(2, rules.max_args)):
            sub, sub_length = random_tree(rng, rules, depth + 1)
            args.append(sub)
            length += sub_length
        return (rng.choice(LISTOPS_OPERATORS), args), length
    return rng.randrange(10), 1


def tree_value(tree: Tree) -> int:
    """The value 0-9 of a tree."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = sorted(tree_value(a) for a in args)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[MED":
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) // 2
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}.")


def tree_source(tree: Tree) -> str:
    """The release's string form of a tree (binary nesting in parentheses)."""
    if isinstance(tree, int):
        return str(tree)
    op, args = tree
    parts = ["("] * (len(args) + 1) + [op]
    for arg in args:
        parts += [tree_source(arg), ")"]
    parts += [LISTOPS_CLOSE, ")"]
    return " ".join(parts)


# Draws between checks that the rate of trees kept so far can reach the count asked for
RATE_CHECK_DRAWS = 50_000


def generate_examples(count: int, rules: ListOpsRules, seed: int) -> list[tuple[str, int]]:
    """``count`` distinct ``(source, value)`` pairs whose length satisfies the rules.

    Refused once the rate of trees kept so far shows the count would take more than
    ``2000 * count + 100_000`` draws (checked every ``RATE_CHECK_DRAWS`` draws: rules
    whose window is rare fail in seconds, not after hours of drawing)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    examples: list[tuple[str, int]] = []
    budget = 2000 * count + 100_000  # draws before we call the rules too restrictive
    for draws in range(budget):
        if len(examples) == count:
            break
        if draws and draws % RATE_CHECK_DRAWS == 0:
            _refuse_slow_rate(draws, len(examples), count, budget, rules)
        tree, length = random_tree(rng, rules)
        if not rules.min_length < length < rules.max_length:
            continue
        source = tree_source(tree)
        if source in seen:
            continue
        seen.add(source)
        examples.append((source, tree_value(tree)))
    if len(examples) < count:
        raise ValueError(
            f"found only {len(examples)} of {count} distinct trees with "
            f"{rules.min_length} < length < {rules.max_length} after {budget} draws; widen the "
            "length bounds or raise max_depth / max_args."
        )
    return examples


def _refuse_slow_rate(draws: int, kept: int, count: int, budget: int,
                      rules: ListOpsRules) -> None:
    """A sentence where ``kept`` trees of ``draws`` project past ``budget`` draws."""
    window = f"{rules.min_length} < length < {rules.max_length}"
    if kept == 0:
        raise ValueError(f"none of the first {draws} trees drawn has {window}; widen the "
                         f"length bounds or raise max_depth / max_args.")
    # from a rate two standard deviations above the one found (a count of kept trees
    # is about Poisson): rules the budget would let finish are refused 2% of the time
    projected = int(draws * count / (kept + 2 * math.sqrt(kept) + 1))
    if projected > budget:
        raise ValueError(f"{kept} of the first {draws} trees drawn are distinct with "
                         f"{window}: the {count} asked for would take about {projected:,} "
                         f"draws, more than the {budget:,} allowed; widen the length "
                         f"bounds, raise max_depth / max_args, or ask for fewer examples.")


def _write_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        handle.write("Source\tTarget\n")
        for source, value in rows:
            handle.write(f"{source}\t{value}\n")


def write_listops(out: str | os.PathLike[str], *, train: int = 96_000, dev: int = 2_000,
                  test: int = 2_000, rules: ListOpsRules | None = None, seed: int = 0,
                  replace: bool = False) -> dict[str, Path]:
    """Generate ListOps and write ``basic_{train,val,test}.tsv`` plus ``generator.json``.

    Defaults are the LRA release's sizes and rules. ``out`` must be new or empty, or
    ``replace`` given (see ``generated``); it is written whole or not at all. Returns
    split -> file.
    """
    rules = rules or ListOpsRules()
    counts = {"train": train, "dev": dev, "test": test}
    for name, n in counts.items():
        check_positive_int(f"the number of {name} examples", n)
    check_seed("seed", seed)
    folder = Path(out)
    # Files are written plainly in tmp: renaming tmp to ``folder`` is the one atomic step.
    with generated_folder(folder, "listops", [*FILES.values(), GENERATOR_RECORD],
                          GENERATOR_RECORD, replace=replace) as tmp:
        examples = generate_examples(train + dev + test, rules, seed)
        start = 0
        for name, n in counts.items():
            _write_tsv(tmp / FILES[name], examples[start:start + n])
            start += n
        record = {"generator": "skyformer.lra.listops_gen", "seed": seed, "counts": counts,
                  "rules": asdict(rules)}
        (tmp / GENERATOR_RECORD).write_text(json.dumps(record, indent=2) + "\n",
                                            encoding="utf-8")
    return {name: folder / FILES[name] for name in counts}
