"""Linformer (Wang et al., 2020): attention over k projected keys and values.

Linformer's linear self-attention head (Wang et al. 2020, Section 4) computes

    softmax( s Q (E K)^T ) (F V),        E, F: [k, N],   s = 1/sqrt(D),

so the attention matrix is ``[N, k]``: O(N k) time; it is applied through fused masked
SDPA and never stored, so memory is O(N D + k N) for the projections. E and F are
learned, by default one pair per head (the paper's unshared setting). Section 4's
sharing: ``share_heads`` is its headwise sharing (one E and one F for all the heads
of a layer), ``share_heads`` with ``share_kv`` its key-value sharing (one E for the
heads, the keys and the values); ``share_kv`` alone keeps E = F per head. E and F
have one column per position up to a fixed
``max_seq_len``: a shorter input uses their first N columns, as if it were padded.

Padding. Padded keys and values are zeroed before projecting, so they enter no
projected key or value. A projected slot whose key row of E has no weight on any real
token holds nothing (its key is the zero vector and carries no token): it is masked
out of the softmax instead of diluting it. With E = F = I (k = N) this makes
Linformer exactly masked softmax attention; for dense projections no slot is empty.
A right-padded input has the output of its truncation (the first N columns of E and F,
zeroed padded rows: the same sums); E and F follow absolute positions, so left padding
or holes do not.

Called directly without ``proj_k``/``proj_v``, E and F are fixed Gaussian
Johnson-Lindenstrauss projections with N(0, 1/k) entries (the distribution of the
paper's Theorems 1-2) drawn from ``generator``, column by column, so that the first N
columns do not depend on the input length. ``MultiHeadAttention`` instead owns learned
E and F (``LinformerProjections``), initialised from the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...linalg.functional_ops import exporting, known_while_exporting
from ...linalg.scores import logit_scale
from ...linalg.tracing import may_read_values
from ...registry import Capabilities, register
from ...sketch.random_features import gaussian_columns
from ...sketch.rng import stream
from ..shared.inputs import (
    check_attention_inputs,
    check_device,
    compute_dtype,
    resolve_key,
    zero_padded_queries,
)
from ..shared.masked import masked_attention
from ..shared.options import (
    check_bool,
    check_finite_scale,
    check_optional_positive_int,
    check_random_features,
)


@dataclass(frozen=True)
class LinformerConfig:
    """Options of Linformer; defaults are the settings of the Skyformer comparisons.

    num_features: projected length k (rows of E and F), 128 as in the Skyformer
        paper's LRA comparison.
    max_seq_len: columns of the learned E and F, i.e. the longest input. Required by
        ``MultiHeadAttention`` (learned projections); optional for direct calls, where
        it only bounds the input length.
    share_kv: one projection for keys and values (E = F); with ``share_heads``, the
        paper's key-value sharing (Section 4: one E per layer).
    share_heads: one E (and one F) for all the heads of a layer, ``[k, L]``: the
        paper's headwise sharing (and its released code's default).
    scale: softmax logit scale s, ``None`` = 1/sqrt(head dim).
    """

    num_features: int = 128
    max_seq_len: int | None = None
    share_kv: bool = False
    share_heads: bool = False
    scale: float | None = None

    def __post_init__(self) -> None:
        check_random_features("linformer", self.num_features)
        check_optional_positive_int("linformer", "max_seq_len", self.max_seq_len)
        check_bool("linformer", "share_kv", self.share_kv)
        check_bool("linformer", "share_heads", self.share_heads)
        check_finite_scale("linformer", self.scale)


class LinformerProjections(nn.Module):
    """Per-layer learned projections E, F: ``[H, k, max_seq_len]`` each, ``[k,
    max_seq_len]`` with ``share_heads`` (one tensor for both with ``share_kv``).

    Initialised with N(0, 1/k) entries: at initialisation the layer computes the
    Johnson-Lindenstrauss projected attention of Linformer's Theorem 2. ``generator``: a
    CPU generator to draw them from (on the CPU, then moved to the default device), else
    torch's global generator of the default device.
    """

    def __init__(self, config: LinformerConfig, num_heads: int, head_dim: int, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if config.max_seq_len is None:
            raise ValueError(
                "linformer needs a fixed max_seq_len, the longest input: its learned "
                "projections have one column per position. Give it with the method's "
                "options: MultiHeadAttention(dim, heads, method='linformer', "
                "max_seq_len=4096), skyformer.hf.set_attention(model, 'linformer', "
                "max_seq_len=4096) for a model without max_position_embeddings, "
                "replace_attention(model, 'linformer', seq_len=4096) for a model built on "
                "torch.nn.MultiheadAttention, or the name 'linformer[max_seq_len=4096]' "
                "wherever a method is named."
            )
        shape = ((config.num_features, config.max_seq_len) if config.share_heads
                 else (num_heads, config.num_features, config.max_seq_len))
        std = 1.0 / math.sqrt(config.num_features)
        device = None if generator is None else generator.device

        def draw() -> nn.Parameter:
            drawn = torch.randn(shape, generator=generator, device=device)
            return nn.Parameter(drawn.to(torch.get_default_device()) * std)

        self.proj_k = draw()
        self.proj_v = None if config.share_kv else draw()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw E and F again (N(0, 1/k)) from torch's global generator of their device,
        as a layer built now would: what a layer built on the meta device needs after
        ``to_empty`` (its parameters hold no values)."""
        for projection in (self.proj_k, self.proj_v):
            if projection is not None:
                drawn = torch.randn(projection.shape, device=projection.device)
                projection.copy_(drawn * (1.0 / math.sqrt(projection.shape[-2])))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any
                              ) -> None:
        """Refuse projections saved with other ``share_heads`` (a ``[k, L]`` E against
        ``[H, k, L]``) or, loading strictly, other ``share_kv`` (F saved or not) in a
        sentence naming the options, not torch's size mismatch or unexpected key alone.
        ``args``: torch's (local_metadata, strict, missing_keys, unexpected_keys,
        error_msgs)."""
        strict, error_msgs = args[1], args[4]
        saved = state_dict.get(prefix + "proj_k")
        if isinstance(saved, Tensor):
            was = (saved.dim() == 2, prefix + "proj_v" not in state_dict)
            now = (self.proj_k.dim() == 2, self.proj_v is None)
            if was[0] != now[0] or (strict and was[1] != now[1]):
                error_msgs.append(
                    f"linformer: the projections were saved with share_heads={was[0]}, "
                    f"share_kv={was[1]} (proj_k {list(saved.shape)}), but this layer has "
                    f"share_heads={now[0]}, share_kv={now[1]} (proj_k "
                    f"{list(self.proj_k.shape)}); build the layer with the options they "
                    f"were saved with.")
                return
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, q: Tensor, k: Tensor) -> dict[str, Tensor]:
        proj_v = self.proj_k if self.proj_v is None else self.proj_v
        return {"proj_k": self.proj_k, "proj_v": proj_v}


def jl_projections(key: Tensor, heads: int, k: int, n: int, share_kv: bool,
                   share_heads: bool = False) -> tuple[Tensor, Tensor]:
    """E and F ``[H, k, n]`` (``[k, n]`` with ``share_heads``) with N(0, 1/k) entries
    (Linformer Theorems 1-2), column j a function of the key and j only, so a shorter
    input gets the first columns."""
    scale = 1.0 / math.sqrt(k)
    rows = (k,) if share_heads else (heads, k)
    e = gaussian_columns(rows, n, stream(key, "linformer/E"), key.device) * scale
    f = e if share_kv else gaussian_columns(rows, n, stream(key, "linformer/F"),
                                            key.device) * scale
    return e, f


def _check_projection(name: str, p: Tensor, heads: int, k: int, n: int,
                      max_seq_len: int | None, device: torch.device,
                      whole: bool = False, share_heads: bool = False) -> Tensor:
    """Validate ``p`` (``[H, k, L]`` or ``[k, L]``, only the latter with ``share_heads``;
    on the inputs' ``device``) and return its first n columns (all of them if ``whole``:
    ``_keep_whole``)."""
    dims = (2,) if share_heads else (2, 3)
    if not isinstance(p, Tensor) or p.dim() not in dims or p.shape[-2] != k or (
        p.dim() == 3 and p.shape[0] != heads
    ):
        shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
        if share_heads:
            per_head = isinstance(p, Tensor) and p.dim() == 3
            raise ValueError(
                f"linformer: share_heads=True shares one projection across the heads, so "
                f"{name} must have shape [num_features, L] = [{k}, L], got {shape}"
                + (f"; pass one head's {name}[h], or share_heads=False for one projection "
                   f"per head." if per_head else "."))
        raise ValueError(
            f"linformer: {name} must have shape [H, num_features, L] = [{heads}, {k}, L] or "
            f"[{k}, L], got {shape}."
        )
    if p.shape[-1] < n:
        raise ValueError(
            f"linformer: {name} has {p.shape[-1]} columns but the input has {n} keys; "
            f"projections need one column per position (max_seq_len >= N)."
        )
    if max_seq_len is not None and p.shape[-1] != max_seq_len:
        raise ValueError(
            f"linformer: {name} has {p.shape[-1]} columns but max_seq_len={max_seq_len}."
        )
    check_device("linformer", name, p, device)
    return p if whole else p[..., :n]


def _keep_whole(p: Tensor, n: int) -> bool:
    """Whether to use the projections whole, against keys padded to their width
    (``_padded_to``): while exporting with a symbolic ``n`` that may fall below the
    width, since the first n columns are contiguous only at the full width, a case
    split export refuses ("N != max_seq_len")."""
    return exporting() and not known_while_exporting(n == p.shape[-1])


def _padded_to(width: int, k: Tensor, v: Tensor, key_valid: Tensor | None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Keys and values ``[B, H, N, D]`` padded to ``width`` positions by zero rows
    marked as padding: the sums over positions are those over the first N columns."""
    extra = width - k.shape[-2]
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (k, v))
    valid = key_valid if key_valid is not None else torch.ones(
        k.shape[0], width - extra, dtype=torch.bool, device=k.device)
    return k, v, torch.nn.functional.pad(valid, (0, extra), value=False)


def _paired_projections(cfg: LinformerConfig, proj_k: Tensor | None, proj_v: Tensor | None
                        ) -> tuple[Tensor | None, Tensor | None]:
    """The caller's E and F as the options share them: ``proj_k`` for both with
    ``share_kv``; both or neither; or a sentence."""
    if cfg.share_kv and proj_k is not None:
        if proj_v is not None and proj_v is not proj_k:
            raise ValueError("linformer: share_kv=True projects the values by proj_k too "
                             "(E = F); pass proj_v=None (or proj_k itself), or share_kv=False "
                             "to project them by proj_v.")
        proj_v = proj_k
    if (proj_k is None) != (proj_v is None):
        raise ValueError("linformer: pass both proj_k and proj_v, or neither"
                         f"{'' if cfg.share_kv else ' (proj_k alone with share_kv=True)'}.")
    return proj_k, proj_v


def _live_slots(e: Tensor, key_valid: Tensor | None) -> Tensor:
    """Which projected slots have weight on a real key: ``[H, k]`` or ``[k]`` without
    padding, else ``[B, H, k]`` or ``[B, 1, k]`` (bool, no float copy of E); ``e: [H, k,
    Nk]`` or ``[k, Nk]``."""
    with torch.no_grad():
        support = e != 0  # [H, k, Nk] or [k, Nk]
        if key_valid is None:
            return support.any(dim=-1)
        real_keys = key_valid[:, None, None, :] if e.dim() == 3 else key_valid[:, None, :]
        slot_live = (support & real_keys).any(dim=-1)  # [B, H, k] or [B, k]
        return slot_live[:, None, :] if e.dim() == 2 else slot_live


@register(
    "linformer",
    LinformerConfig,
    Capabilities(target="softmax", randomized=True, fixed_length=True, learned_parameters=True,
                 independent_queries=True, weights=True),
    summary="Linformer: softmax attention over k projected keys/values (E, F: k x N)",
    state=LinformerProjections,
)
def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: LinformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    proj_k: Tensor | None = None,
    proj_v: Tensor | None = None,
) -> Tensor:
    """Linformer attention (linear self-attention head, Section 4), O(N k).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``LinformerConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws E and F when they are not given (module docstring).
        proj_k, proj_v: E and F, ``[H, k, L]`` (or ``[k, L]`` shared by the heads; that
            alone with ``share_heads``) with L >= Nk; both or neither (with
            ``share_kv``, proj_k alone: F = E).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="linformer",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("linformer", generator, q.device, needed=proj_k is None)
    cfg = config
    n = info.key_len
    if cfg.max_seq_len is not None and n > cfg.max_seq_len:
        raise ValueError(
            f"linformer: the input has {n} keys but max_seq_len={cfg.max_seq_len}; its "
            f"projections have one column per position, so truncate the input or build the "
            f"layer with a larger max_seq_len."
        )
    proj_k, proj_v = _paired_projections(cfg, proj_k, proj_v)
    dtype = q.dtype
    work = compute_dtype(dtype)
    kw, vw, key_valid = k.to(work), v.to(work), info.key_valid
    if proj_k is None:
        e, f = jl_projections(key, info.heads, cfg.num_features, n, cfg.share_kv,
                              cfg.share_heads)
    else:
        whole = _keep_whole(proj_k, n)
        e, f = (_check_projection(name, p, info.heads, cfg.num_features, n, cfg.max_seq_len,
                                  q.device, whole, cfg.share_heads)
                for name, p in (("proj_k", proj_k), ("proj_v", proj_v)))
        if whole:
            kw, vw, key_valid = _padded_to(e.shape[-1], kw, vw, key_valid)
    e, f = e.to(work), f.to(work)  # [H, k, Nk] or [k, Nk]

    slot_live = _live_slots(e, key_valid)
    if key_valid is not None:
        real = key_valid[:, None, :, None].to(work)  # [B, 1, Nk, 1]
        kw, vw = kw * real, vw * real
    k_proj = e @ kw  # [B, H, k, D]
    v_proj = f @ vw  # [B, H, k, Dv]
    s = logit_scale(info.head_dim, cfg.scale)
    # Skip the mask when every slot is live (SDPA is faster without one), unless the
    # data may not be read (torch.compile, torch.func).
    skip = may_read_values(slot_live) and bool(slot_live.all())
    visible = None if skip else slot_live[..., None, :]
    # softmax(s Q K_proj^T) V_proj by fused SDPA: the [Nq, k] matrix is never stored
    out = masked_attention(q.to(work) * s, k_proj, v_proj, visible)  # [B, H, Nq, Dv]
    if proj_k is not None:
        out = out + _projection_marks(e, f)
    return zero_padded_queries(out, info.query_valid).to(dtype)


def _projection_marks(e: Tensor, f: Tensor) -> Tensor:
    """0, or NaN in the heads whose given projection ``[H, k, Nk]`` (``[k, Nk]``: every
    head) holds a non-finite entry, as ``[H, 1, 1]`` (or a scalar), detached. A head whose
    key projection is all NaN has all-NaN logits, which the fused softmax takes for a
    row with no key and answers with zeros: the marks keep such a head NaN, as the
    non-finite values the docs promise never to hide."""
    marks = (e.detach().sum((-2, -1)) + f.detach().sum((-2, -1))) * 0
    return marks[..., None, None] if marks.dim() else marks
