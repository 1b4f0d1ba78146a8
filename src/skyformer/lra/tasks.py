"""The five Long Range Arena tasks: classes, vocabulary, sequence length, encoder layout.

Defaults are the truncation lengths of the LRA release and of the PyTorch LRA code the
Skyformer paper used (Xiong et al., 2021): ListOps 2000 tokens, byte-level Text and
Retrieval 4000 bytes per document (LRA's own pipeline uses 4096 for Text; ``--max-len``
changes it), Image and Pathfinder 32 x 32 = 1024 pixels. That code then appends 48
(ListOps) or 96 masked zeros, so its model runs 2048 or 4096 positions; the model here
runs the truncation length (docs/lra.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    """What the model needs to know about a task.

    name: command-line name; title: the papers' column name.
    num_classes: classifier outputs. vocab_size: token ids are ``0 .. vocab_size - 1``.
    max_len: default tokens per document. segments: 1, or 2 for Retrieval's pair of
    documents, encoded separately by the same encoder (dual encoder).
    """

    name: str
    title: str
    num_classes: int
    vocab_size: int
    max_len: int
    segments: int = 1


# Paper order of Tables 1-3: Text, ListOps, Retrieval, Pathfinder, Image.
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("text", "Text", num_classes=2, vocab_size=257, max_len=4000),
        TaskSpec("listops", "ListOps", num_classes=10, vocab_size=16, max_len=2000),
        TaskSpec("retrieval", "Retrieval", num_classes=2, vocab_size=257, max_len=4000,
                 segments=2),
        TaskSpec("pathfinder", "Pathfinder", num_classes=2, vocab_size=256, max_len=1024),
        TaskSpec("image", "Image", num_classes=10, vocab_size=256, max_len=1024),
    )
}

SPLITS = ("train", "dev", "test")


def get_task(name: str) -> TaskSpec:
    """The task ``name``; unknown names fail with the list of tasks."""
    if name not in TASKS:
        raise ValueError(f"unknown LRA task {name!r}; tasks: {', '.join(TASKS)}.")
    return TASKS[name]
