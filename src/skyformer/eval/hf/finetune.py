"""A short fine-tune that adapts MiniLM-L6 to a method that is not a drop-in.

Gaussian kernelized attention (``kernelized``, ``skyformer``) computes a different
function from the softmax attention MiniLM-L6 was trained with, so swapping it in loses
most of the embedding (``skyformer hf-eval``). The small task here: distil the exact
model's sentence embeddings into the model with the new attention, on the sentences of
the text, and measure on held-out sentences (every ``holdout``-th one) how much of the
exact model's embedding (cosine similarity) and retrieval (recall@1 of the exact model's
nearest neighbours) comes back. The word-embedding table is frozen: it is most of the
parameters (11.7M of 22.7M) and attention does not touch it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...checks import check_positive_int
from ...hf import set_attention
from ...registry import get_method
from ...seeds import check_seed
from ..data.qkv import load_model
from ..data.text import read_text
from .run import (
    Inputs,
    build_inputs,
    check_seq_len,
    embed,
    embed_all,
    pad_batch,
    quality,
)


@dataclass(frozen=True)
class FinetuneConfig:
    """One distillation run; ``num_features=None`` = the method's default."""

    method: str = "kernelized"
    num_features: int | None = None
    steps: int = 100
    lr: float = 1e-4
    batch_size: int = 16
    seq_len: int = 128
    holdout: int = 5  # every holdout-th sentence is held out for evaluation
    seed: int = 0
    text: str | None = None
    model: str | None = None

    def validate(self) -> None:
        get_method(self.method)
        for name in ("steps", "batch_size", "seq_len"):
            check_positive_int(name, getattr(self, name))
        check_seed("seed", self.seed)
        if not isinstance(self.holdout, int) or self.holdout < 2:
            raise ValueError(f"holdout must be an integer >= 2, got {self.holdout!r}.")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}.")


def split(inputs: Inputs, holdout: int) -> tuple[Inputs, Inputs]:
    """(train, held-out): every ``holdout``-th text is held out."""
    train = [x for i, x in enumerate(inputs.ids) if i % holdout]
    test = [x for i, x in enumerate(inputs.ids) if not i % holdout]
    return Inputs(inputs.setting, train), Inputs(inputs.setting, test)


def distill(config: FinetuneConfig = FinetuneConfig(),
            progress: Callable[[str], None] | None = None,
            save_to: str | Path | None = None) -> dict[str, Any]:
    """Fine-tune MiniLM-L6 (or ``config.model``) with ``config.method`` to reproduce the
    exact embeddings. ``save_to``: a folder for the fine-tuned model and its tokenizer
    (``save_pretrained``, which records each layer's attention:
    ``skyformer.hf.from_pretrained(save_to)`` loads it with its method).

    Returns:
        ``{"config", "train_texts", "test_texts", "before", "after", "loss", "seconds"}``;
        ``before``/``after`` are ``quality`` dicts on the held-out sentences, ``loss`` the
        training loss (mean 1 - cosine) per step.
    """
    config.validate()
    teacher, tokenizer, _ = load_model(config.model)
    check_seq_len(teacher, config.seq_len)
    inputs = build_inputs(tokenizer, read_text(config.text), "short", seq_len=config.seq_len,
                          max_texts=10**9, too_few="pass a longer text (--text FILE)")
    train, test = split(inputs, config.holdout)
    if len(test.ids) < 2:  # recall@1 of one text finds that text itself
        raise ValueError(
            f"holdout={config.holdout} holds out {len(test.ids)} of the text's "
            f"{len(inputs.ids)} sentences; recall@1 needs at least 2: pass a longer text "
            f"(--text FILE) or a smaller holdout.")
    exact_train = embed_all(teacher, train, config.batch_size)
    exact_test = embed_all(teacher, test, config.batch_size)

    student = copy.deepcopy(teacher)
    options = {} if config.num_features is None else {"num_features": config.num_features}
    # the per-layer state's draws (Linformer's projections, Performer's features), then
    # the randomised methods' and dropout's during training
    torch.manual_seed(config.seed)
    set_attention(student, config.method, seed=None, **options)
    before = quality(embed_all(student, test, config.batch_size), exact_test)
    student.get_input_embeddings().weight.requires_grad_(False)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr)
    order = torch.Generator().manual_seed(config.seed)
    losses = []
    start = time.perf_counter()
    student.train()
    for step in range(config.steps):
        picked = torch.randperm(len(train.ids), generator=order)[: config.batch_size].tolist()
        embeddings = embed(student, pad_batch([train.ids[i] for i in picked]))
        loss = (1 - (embeddings * exact_train[picked]).sum(-1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress and (step % 10 == 0 or step == config.steps - 1):
            progress(f"{config.method} step {step + 1}/{config.steps}: loss {loss.item():.4f}")
    seconds = time.perf_counter() - start
    student.eval()
    after = quality(embed_all(student, test, config.batch_size), exact_test)
    if save_to is not None:
        student.save_pretrained(save_to)
        tokenizer.save_pretrained(save_to)
    return {
        "config": dataclasses.asdict(config),
        "train_texts": len(train.ids),
        "test_texts": len(test.ids),
        "before": before,
        "after": after,
        "loss": losses,
        "seconds": seconds,
    }
