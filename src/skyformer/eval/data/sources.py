"""Where the approximation study's queries, keys and values come from.

- ``pretrained``: a BERT-type Hugging Face model (default the pretrained MiniLM-L6) on
  real text, one layer, chosen heads (``eval.qkv``);
- ``init``: the same architecture randomly initialised (Skyformer Figure 1's
  "initialized" setting);
- ``glove``: word vectors from a GloVe-format file, KDEformer section 4.1's setup:
  keys equal queries, values another slice of the file;
- ``gaussian``: synthetic i.i.d. Gaussian rows with a chosen expected norm;
- ``qkv``: one's own Q/K/V from a file (``load_qkv_file``: ``[B, H, N, D]`` each), the
  first N tokens of every sequence, its B x H heads numbered b * H + h.

Every source returns ``[1, H, N, D]`` float32 tensors, H = the number of chosen heads
(for ``glove`` and ``gaussian`` the heads are independent slices or draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .glove import read_glove
from .qkv import (
    MaskedQKV,
    extract_qkv,
    layer_projections,
    load_model,
    load_qkv_file,
    position_limit,
    text_tokens,
    tokens_needed,
)
from .text import read_text

SOURCES = ("pretrained", "init", "glove", "gaussian", "qkv")
DEFAULT_HEADS = (0, 3, 6, 9)  # spread over MiniLM-L6's 12 heads


@dataclass(frozen=True)
class SourceData:
    """Q/K/V of one source at one length, ``[1, H, N, D]`` each, and what they are.

    ``heads``: the model's index of each of the H heads (``None``: the synthetic
    sources' independent slices or draws, numbered 0..H-1)."""

    source: str
    q: Tensor
    k: Tensor
    v: Tensor
    description: str
    windows: int = 1
    heads: tuple[int, ...] | None = None

    def head_indices(self) -> tuple[int, ...]:
        """What each of the H heads is called in results: ``heads`` or 0..H-1."""
        return self.heads if self.heads is not None else tuple(range(self.q.shape[1]))


@dataclass(frozen=True)
class SourceOptions:
    """What the sources need; see ``ApproxConfig`` for the meaning of each field."""

    model: str | None = None
    text: str | None = None
    layer: int = 0
    heads: tuple[int, ...] | None = None
    glove: str | None = None
    gaussian_norm: float = 6.0
    gaussian_dim: int = 32
    data_seed: int = 0
    qkv: str | None = None


def check_source(source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose from: {', '.join(SOURCES)}.")


class SourceLoader:
    """Loads each source's data, keeping models and text between sequence lengths."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._models: dict[bool, tuple[Any, Any, str]] = {}
        self._text: str | None = None
        self._saved: MaskedQKV | None = None

    def num_heads(self) -> int:
        """H for the synthetic sources (the BERT sources use the model's own count)."""
        return len(self.options.heads) if self.options.heads else 12

    def load(self, source: str, seq_len: int) -> SourceData:
        check_source(source)
        if source in ("pretrained", "init"):
            return self._bert(source == "pretrained", seq_len)
        if source == "glove":
            return self._glove(seq_len)
        if source == "qkv":
            return self._own(seq_len)
        return self._gaussian(seq_len)

    def check(self, source: str, seq_len: int, setting: str) -> None:
        """Fail in a sentence where ``source`` cannot give ``seq_len`` tokens (a text too
        short, a GloVe file with too few vectors) or lacks the chosen layer or heads,
        before any measurement; ``setting`` names the option that asks for that length
        (``--seq-lens``)."""
        check_source(source)
        if source in ("pretrained", "init"):
            model, tokenizer, _ = self._model(source == "pretrained")
            layer_projections(model, self.options.layer)
            self._heads(model.config.num_attention_heads)
            have = len(text_tokens(tokenizer, self._read_text()))
            need = tokens_needed(seq_len, position_limit(model))
            if have < need:
                raise ValueError(
                    f"{source}: the text has {have} tokens; N={seq_len} ({setting}) needs "
                    f"{need}: pass a longer text (--text FILE) or a shorter {setting}.")
        elif source == "glove" and self.options.glove is not None:
            h = self.num_heads()
            need = 2 * h * seq_len
            have = len(read_glove(self.options.glove, need, at_most=True))
            if have < need:
                raise ValueError(
                    f"{str(self.options.glove)!r} holds {have} vectors; N={seq_len} ({setting}) "
                    f"with {h} heads needs {need}: pass a larger --glove FILE, a shorter "
                    f"{setting} or fewer --heads.")
        elif source == "qkv":
            self._check_own(seq_len, setting)

    def _model(self, pretrained: bool) -> tuple[Any, Any, str]:
        """(model, tokenizer, name), loaded once."""
        o = self.options
        if pretrained not in self._models:
            self._models[pretrained] = load_model(o.model, pretrained=pretrained, seed=o.data_seed)
        return self._models[pretrained]

    def _read_text(self) -> str:
        if self._text is None:
            self._text = read_text(self.options.text)
        return self._text

    def _heads(self, total: int) -> list[int]:
        """The chosen heads of a model with ``total`` heads (default all of them)."""
        heads = list(self.options.heads) if self.options.heads else list(range(total))
        bad = [h for h in heads if not 0 <= h < total]
        if bad:
            default = (f" (the default heads {' '.join(map(str, DEFAULT_HEADS))} are spread "
                       f"over MiniLM-L6's 12)" if tuple(heads) == DEFAULT_HEADS else "")
            raise ValueError(f"heads must be in 0..{total - 1} for this model, got {bad}"
                             f"{default}; pass --heads with indices below {total}, or "
                             f"--heads all.")
        return heads

    def _bert(self, pretrained: bool, seq_len: int) -> SourceData:
        o = self.options
        model, tokenizer, name = self._model(pretrained)
        qkv = extract_qkv(
            model, tokenizer, self._read_text(), seq_len=seq_len, layer=o.layer, name=name,
            pretrained=pretrained,
        )
        heads = self._heads(qkv.q.shape[1])
        q, k, v = (t[:, heads].contiguous() for t in (qkv.q, qkv.k, qkv.v))
        text = qkv.describe() + f", heads {','.join(map(str, heads))}"
        return SourceData("pretrained" if pretrained else "init", q, k, v, text, qkv.windows,
                          tuple(heads))

    def _glove(self, seq_len: int) -> SourceData:
        o = self.options
        if o.glove is None:
            raise ValueError("the glove source needs a GloVe-format file: pass --glove FILE.")
        h = self.num_heads()
        # Q = K = vectors [0, H N), V = the next H N vectors. Methods scale logits by
        # 1/sqrt(d), so softmax(q k^T / sqrt(d)) is KDEformer's softmax(Q K^T) with
        # Q = K = vectors / d^(1/4).
        x = read_glove(o.glove, 2 * h * seq_len).float()
        d = x.shape[1]
        q = x[: h * seq_len].reshape(1, h, seq_len, d)
        v = x[h * seq_len :].reshape(1, h, seq_len, d)
        text = (
            f"GloVe vectors from {Path(o.glove).name} (d={d}), {h} slice{'s' * (h != 1)} of "
            f"N={seq_len}, "
            f"K = Q, V = the next {h * seq_len} vectors"
        )
        return SourceData("glove", q, q.clone(), v.contiguous(), text)

    def _saved_qkv(self) -> MaskedQKV:
        """The ``--qkv`` file's tensors, read once."""
        if self.options.qkv is None:
            raise ValueError("the qkv source needs your Q/K/V: pass --qkv FILE (a torch.save "
                             "of {'q': q, 'k': k, 'v': v}, each [B, H, N, D]).")
        if self._saved is None:
            self._saved = load_qkv_file(self.options.qkv, label="--qkv")
        return self._saved

    def _check_own(self, seq_len: int, setting: str) -> None:
        """Sentences for a ``--qkv`` file that cannot give ``seq_len`` tokens of
        self-attention with no padding, lacks the chosen heads, or holds NaN or inf in
        them (every error would be NaN, and the notes would blame the methods)."""
        q, k, v, mask = self._saved_qkv()
        where = f"--qkv {str(self.options.qkv)!r}"
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"{where} holds {q.shape[2]} queries and {k.shape[2]} keys; the "
                             f"study measures self-attention, one length for both: save "
                             f"queries and keys of the same tokens.")
        if seq_len > k.shape[2]:
            raise ValueError(f"{where} holds N={k.shape[2]} tokens; N={seq_len} ({setting}) "
                             f"needs more: pass a shorter {setting}.")
        heads = self._own_heads(q.shape[0] * q.shape[1])
        sequences = sorted({head // q.shape[1] for head in heads})  # head b * H + h
        if mask is not None and not bool(mask[sequences, :seq_len].all()):
            padded = (~mask[sequences, :seq_len]).any(dim=1).nonzero()
            first = sequences[int(padded[0])]
            raise ValueError(f"{where}: sequence {first} has padding among its first "
                             f"{seq_len} tokens ({setting}); the study takes the first N "
                             f"tokens of each chosen head's sequence, all real: pass a "
                             f"shorter {setting}, leave its heads out with --heads, or save "
                             f"the sequences with enough real tokens.")
        for name, t in (("Q", q), ("K", k), ("V", v)):
            finite = t[:, :, :seq_len].flatten(0, 1)[heads].isfinite().flatten(1).all(1)
            if not bool(finite.all()):
                bad = [heads[i] for i in (~finite).nonzero().flatten().tolist()]
                raise ValueError(
                    f"{where}: {name} holds NaN or inf among the first {seq_len} tokens of "
                    f"head{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} (head b * H + h), "
                    f"where every error would be NaN; the study needs finite Q/K/V: fix the "
                    f"file, or leave those heads out with --heads.")

    def _own_heads(self, total: int) -> list[int]:
        """The chosen heads of a file's ``total`` = B x H heads: the default heads (0, 3,
        6, 9) where the file has them all, else every head; or those given."""
        heads = self.options.heads
        if heads is None or (tuple(heads) == DEFAULT_HEADS and total <= max(DEFAULT_HEADS)):
            return list(range(total))
        bad = [h for h in heads if not 0 <= h < total]
        if bad:
            raise ValueError(f"heads must be in 0..{total - 1} for the --qkv file's B x H = "
                             f"{total} heads (head b * H + h), got {bad}; pass --heads with "
                             f"indices below {total}, or --heads all.")
        return list(heads)

    def _own(self, seq_len: int) -> SourceData:
        q, k, v, _ = self._saved_qkv()
        self._check_own(seq_len, "--seq-lens")
        b, h = q.shape[:2]
        heads = self._own_heads(b * h)

        def first_tokens(t: Tensor) -> Tensor:  # [B, H, N', D] -> [1, heads, N, D] float32
            flat = t[:, :, :seq_len].reshape(1, b * h, seq_len, t.shape[-1])
            return flat[:, heads].float().contiguous()

        text = (f"your Q/K/V from {Path(str(self.options.qkv)).name} ({q.dtype}): the first "
                f"{seq_len} of {k.shape[2]} tokens, heads b * H + h of B={b}, H={h}: "
                f"{','.join(map(str, heads))}")
        return SourceData("qkv", first_tokens(q), first_tokens(k), first_tokens(v), text,
                          heads=tuple(heads))

    def _gaussian(self, seq_len: int) -> SourceData:
        o = self.options
        if not (o.gaussian_norm > 0 and math.isfinite(o.gaussian_norm)):
            raise ValueError(f"gaussian_norm (--gaussian-norm) must be a positive number, got "
                             f"{o.gaussian_norm}.")
        if o.gaussian_dim < 1:
            raise ValueError(f"gaussian_dim (--gaussian-dim) must be at least 1, got "
                             f"{o.gaussian_dim}.")
        h, d = self.num_heads(), o.gaussian_dim
        g = torch.Generator().manual_seed(o.data_seed)
        sigma = o.gaussian_norm / math.sqrt(d)  # E|q|^2 = d sigma^2 = norm^2
        q, k, v = (torch.randn(1, h, seq_len, d, generator=g) for _ in range(3))
        text = (
            f"synthetic Gaussian Q, K with root-mean-square row norm {o.gaussian_norm:g} "
            f"(entries N(0, {sigma:.3g}^2)), V ~ N(0, 1), d={d}, {h} draw{'s' * (h != 1)} of "
            f"N={seq_len}"
        )
        return SourceData("gaussian", q * sigma, k * sigma, v, text)
