"""The LRA classifier of the Skyformer paper (section 5), after the PyTorch LRA code of
Xiong et al. (2021) it used: learned token and position embeddings, pre-LayerNorm
transformer layers whose attention is any registered method, a final LayerNorm, mean
pooling over the real tokens and a two-layer classifier. Retrieval encodes both
documents with the same encoder and classifies ``[u, v, u * v, u - v]`` (dual encoder).

Defaults: 2 layers, width 64, MLP hidden 128, 2 heads (head dim 32), dropout 0.1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..amp import autocast_enabled, autocast_off
from ..checks import check_positive_int
from ..linalg.tracing import may_read_values
from ..nn import MultiHeadAttention
from ..registry import get_method


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the LRA model; ``attention_options`` go to the method."""

    vocab_size: int
    num_classes: int
    max_len: int
    segments: int = 1
    dim: int = 64
    hidden: int = 128
    heads: int = 2
    layers: int = 2
    dropout: float = 0.1
    attention: str = "skyformer"
    attention_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_classes", "max_len", "dim", "hidden", "heads", "layers"):
            check_positive_int(f"model {name}", getattr(self, name))
        if self.segments not in (1, 2):
            raise ValueError(f"segments must be 1 or 2, got {self.segments!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")


# The paper's setting where a method's registered default differs from it (Skyformer
# section 5: "128 features in all methods (except Big Bird)"): Informer's default is its
# own u = 5 ceil(ln N) attending queries, 40 at ListOps' 2000 tokens.
PAPER_OPTIONS: dict[str, dict[str, Any]] = {"informer": {"num_features": 128}}


def resolve_attention_options(method: str, options: dict[str, Any], max_len: int) -> dict[str, Any]:
    """The method's options for sequences of ``max_len`` tokens, validated.

    Methods whose capabilities say ``fixed_length`` (e.g. Linformer's projections) get
    ``max_seq_len=max_len`` unless it is given; ``PAPER_OPTIONS`` fill in the paper's
    settings that are not the method's defaults, unless given (as an option or in a
    variant's name).
    """
    spec = get_method(method)
    # by the registered name, so a variant gets them too, but for the options it sets
    paper = {k: v for k, v in PAPER_OPTIONS.get(spec.base_name, {}).items()
             if k not in dict(spec.preset)}
    options = {**paper, **options}
    resolved = spec.resolve_options(options, max_len)
    spec.make_config(**resolved)  # unknown or invalid options fail here, early
    return resolved


def lengths_to_mask(lengths: Tensor, max_len: int) -> Tensor | None:
    """``[B, N]`` bool mask (True = real) from ``lengths: [B]``; None when nothing is padded,
    in eager code (compiled and traced code cannot read the lengths, and take the mask,
    whose result is the same)."""
    if may_read_values(lengths) and bool((lengths >= max_len).all()):
        return None
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


class EncoderLayer(nn.Module):
    """Pre-LayerNorm transformer layer: ``x + Drop(Attn(LN(x)))``, then ``x + MLP(LN(x))``."""

    def __init__(self, cfg: ModelConfig, options: dict[str, Any]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = MultiHeadAttention(cfg.dim, cfg.heads, cfg.attention, dropout=cfg.dropout,
                                       **options)
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.dim), nn.Dropout(cfg.dropout),
        )
        caps = self.attn.spec.capabilities
        self._takes_mask = caps.mask
        self._takes_half = caps.half_precision

    def _attend(self, h: Tensor, mask: Tensor | None,
                generator: torch.Generator | Tensor | None) -> Tensor:
        if mask is not None and not self._takes_mask:
            # The method cannot honour a padding mask: zero the padded rows instead, as
            # the reference LRA code does for every method.
            h, mask = h * mask[..., None].to(h.dtype), None
        if not self._takes_half and autocast_enabled(h.device.type):
            with autocast_off(h.device.type):
                return self.attn(h.float(), mask, generator=generator)
        return self.attn(h, mask, generator=generator)

    def forward(self, x: Tensor, mask: Tensor | None = None,
                generator: torch.Generator | Tensor | None = None) -> Tensor:
        """``x: [B, N, dim]``, ``mask: [B, N]`` bool (True = real) -> ``[B, N, dim]``."""
        x = x + self.drop(self._attend(self.norm1(x), mask, generator))
        return x + self.mlp(self.norm2(x))


class _Table(nn.Embedding):
    """An embedding table drawn N(0, 0.02^2), as the reference LRA code draws it, by
    ``reset_parameters`` too: a model built on the meta device gets these values after
    ``to_empty`` and ``reset_parameters()`` of each module, not nn.Embedding's N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Encoder(nn.Module):
    """Token + learned position embeddings and the transformer layers."""

    def __init__(self, cfg: ModelConfig, options: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = _Table(cfg.vocab_size, cfg.dim)
        self.positions = _Table(cfg.max_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg, options) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def hidden_states(self, tokens: Tensor, mask: Tensor | None,
                      generator: torch.Generator | Tensor | None = None) -> Tensor:
        """Output of the last transformer layer, before the final LayerNorm: ``[B, N, dim]``
        (padded rows zeroed). ``tokens: [B, N]`` long."""
        n = tokens.shape[1]
        if n > self.cfg.max_len:
            raise ValueError(f"sequences have {n} tokens; the model was built for at most "
                             f"{self.cfg.max_len}.")
        x = self.tokens(tokens) + self.positions(torch.arange(n, device=tokens.device))[None]
        x = self.drop(x)
        for layer in self.layers:
            x = layer(x, mask, generator)
        return x if mask is None else x * mask[..., None].to(x.dtype)

    def forward(self, tokens: Tensor, mask: Tensor | None,
                generator: torch.Generator | Tensor | None = None) -> Tensor:
        """Mean-pooled final representation ``[B, dim]`` over the real tokens."""
        x = self.norm(self.hidden_states(tokens, mask, generator))  # [B, N, dim]
        if mask is None:
            return x.mean(dim=1)
        weights = mask[..., None].to(x.dtype)
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


class LRAClassifier(nn.Module):
    """The LRA model: ``tokens: [B, S, N]`` long, ``lengths: [B, S]`` -> logits ``[B, C]``.

    S = 1, or 2 for the dual encoder (both documents through the same encoder).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        options = resolve_attention_options(cfg.attention, cfg.attention_options, cfg.max_len)
        self.cfg = dataclasses.replace(cfg, attention_options=options)
        self.encoder = Encoder(self.cfg, options)
        width = cfg.dim * (4 if cfg.segments == 2 else 1)
        self.head = nn.Sequential(nn.Linear(width, cfg.hidden), nn.ReLU(),
                                  nn.Linear(cfg.hidden, cfg.num_classes))

    def _flat(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor | None]:
        if tokens.dim() != 3 or tokens.shape[1] != self.cfg.segments \
                or lengths.shape != tokens.shape[:2]:
            raise ValueError(
                f"expected tokens [B, {self.cfg.segments}, N] and lengths [B, "
                f"{self.cfg.segments}], got {tuple(tokens.shape)} and {tuple(lengths.shape)}."
            )
        b, s, n = tokens.shape
        # Segments are encoded independently: stack them along the batch.
        flat = tokens.transpose(0, 1).reshape(s * b, n)
        return flat, lengths_to_mask(lengths.transpose(0, 1).reshape(s * b), n)

    def embed(self, tokens: Tensor, lengths: Tensor,
              generator: torch.Generator | Tensor | None = None, *, normed: bool = True
              ) -> Tensor:
        """The encoder's output for every token, ``[S * B, N, dim]`` (segment-major), padded
        rows zero: after the final LayerNorm (``normed``, what the encoder hands to pooling)
        or the raw output of the last transformer layer. f(x, W) of the instability score
        (Skyformer Appendix F)."""
        flat, mask = self._flat(tokens, lengths)
        x = self.encoder.hidden_states(flat, mask, generator)
        if normed:
            x = self.encoder.norm(x)
            if mask is not None:
                x = x * mask[..., None].to(x.dtype)
        return x

    def forward(self, tokens: Tensor, lengths: Tensor,
                generator: torch.Generator | Tensor | None = None) -> Tensor:
        flat, mask = self._flat(tokens, lengths)
        pooled = self.encoder(flat, mask, generator)  # [S * B, dim]
        if self.cfg.segments == 2:
            u, v = pooled.chunk(2, dim=0)
            pooled = torch.cat([u, v, u * v, u - v], dim=-1)  # [B, 4 dim]
        return self.head(pooled)
