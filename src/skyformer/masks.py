"""SDPA-style attention masks turned into what the approximate methods take.

``scaled_dot_product_attention`` (torch's, and skyformer's) and Hugging Face models pass
``attn_mask`` as ``None``, a 4-D boolean mask ``[B or 1, 1 or H, Nq or 1, Nk]`` (True =
may attend), a 4-D additive float mask (0 = attend, a large negative = blocked), or,
in older transformers code, a 2-D ``[B, Nk]`` padding mask (1 = real token). The exact
methods take any of these as they are (capability ``attn_mask``); the approximate
methods take only ``key_padding_mask [B, Nk]`` (True = real) and, where the
capabilities allow, ``causal``. So for them a mask is accepted only if it is exactly one
of

- key padding: every real query sees the same set of keys;
- causal with key padding (``Nq == Nk``): query i sees the real keys j <= i;

anything else (sliding windows, packed sequences, per-head masks, additive biases such
as ALiBi) is refused with a sentence: a mask ignored is a wrong answer.

Rows of padded queries are not checked. In self-attention (``Nq == Nk``) a key that no
query may see is padding, and by skyformer's convention the output row of that
position is zero; transformers models never read the outputs at padded positions
(the next layer does not attend to them and pooling skips them), and some mask builders
block those rows entirely while others leave them as the pattern makes them, so both
forms are accepted. A padded row opened to every key (as transformers before 5 did for
left padding under SDPA) cannot be told from a real one: such a mask is refused unless
``query_padding_mask`` names the padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Additive entries at or below this are blocked positions: exp(-1e4) is exactly 0 in
# float32 and float64, so treating them as masked changes nothing; transformers uses
# finfo(dtype).min (or -inf), legacy BERT code -10000.
BLOCKED_LOGIT = -1e4

# How a caller names padded queries, said where a refused mask looks like one that
# hides them or opens them to every key (the Hugging Face route passes its own).
NAME_PADDED_QUERIES = ("pass them as query_padding_mask [B, Nq] (True = real query) too, "
                       "and their rows come out 0")

# What to do instead, named in the error sentences; callers pass their own.
USE_EXACT = "use an exact method (softmax or kernelized), which takes any attn_mask"


# A decoding step that is a new prompt over a used cache (generate feeds the positions past
# the cache's length) meets the decoding steps' mask refusals first.
NEW_PROMPT = ("if this step starts a new prompt over a used cache, make a new cache "
              "(DecodingCache(model)) or call cache.reset()")


class UnsupportedMaskError(ValueError):
    """An attention mask that is neither key padding nor causal with key padding."""


@dataclass(frozen=True)
class ResolvedMask:
    """What a transformers attention mask asks for, in skyformer's terms.

    key_padding_mask: ``[B, Nk]`` bool, True = real token; ``None`` = every key is real.
    causal: query i sees keys j <= i (``Nq == Nk``).
    """

    key_padding_mask: Tensor | None
    causal: bool


def allowed_entries(mask: Tensor) -> Tensor:
    """True where a mask of an accepted form lets a query attend, read without checks
    (``_allowed`` checks too): a boolean one as it is, a 2-D ``[B, Nk]`` one where it
    is nonzero (1 = real token), an additive float one above ``BLOCKED_LOGIT``."""
    if mask.dtype == torch.bool:
        return mask
    if mask.dim() == 2 or not mask.is_floating_point():
        return mask != 0
    return mask > BLOCKED_LOGIT


def _allowed(mask: Tensor, batch: int, query_len: int, key_len: int, advice: str) -> Tensor:
    """``[B, Hm, Qm, Nk]`` bool (True = may attend) from any accepted mask form."""
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, key_len):
            raise UnsupportedMaskError(
                f"a 2-D attention mask must have shape [B, Nk] = [{batch}, {key_len}], got "
                f"{tuple(mask.shape)}."
            )
        # 1 = real token; an additive float mask (0 = real) would be read inverted
        if mask.is_floating_point() and not _holds(
                (mask == 0) | (mask == 1), "a 2-D attention mask holds values besides 0 and 1"):
            raise UnsupportedMaskError(
                "a 2-D attention mask [B, Nk] holds 1 for real tokens and 0 for padding; "
                "this one holds other values: an additive mask (0 = real token, a large "
                "negative = padding) converts with (mask == 0)."
            )
        return allowed_entries(mask)[:, None, None, :]
    if mask.dim() != 4:
        raise UnsupportedMaskError(
            f"the attention mask has {mask.dim()} dimensions (shape {tuple(mask.shape)}); "
            f"expected [B, 1, Nq, Nk] (4-D, boolean or additive) or [B, Nk]."
        )
    b, _, q, k = mask.shape
    if b not in (1, batch) or q not in (1, query_len) or k != key_len:
        raise UnsupportedMaskError(
            f"the attention mask has shape {tuple(mask.shape)} but the attention is "
            f"[B={batch}, Nq={query_len}, Nk={key_len}]; a 4-D mask must broadcast to "
            f"[B, 1, Nq, Nk]."
        )
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise UnsupportedMaskError(
            f"a 4-D attention mask must be boolean (True = attend) or additive float "
            f"(0 = attend, large negative = blocked), got dtype {mask.dtype}."
        )
    blocked = mask <= BLOCKED_LOGIT
    if not _holds((mask == 0) | blocked, "the additive attention mask carries a bias"):
        raise UnsupportedMaskError(
            "the additive attention mask carries a bias (entries other than 0 and large "
            "negatives, e.g. ALiBi or relative-position terms), which methods without "
            f"attn_mask (the approximate ones) cannot add to their attention; {advice}."
        )
    return ~blocked


def resolve_mask(
    attention_mask: Tensor | None,
    *,
    batch: int,
    query_len: int,
    key_len: int,
    is_causal: bool,
    query_valid: Tensor | str | None = "auto",
    advice: str = USE_EXACT,
    all_real_as_none: bool = True,
    name_padded_queries: str = NAME_PADDED_QUERIES,
) -> ResolvedMask:
    """Turn a transformers attention mask into ``key_padding_mask`` and ``causal``.

    Args:
        attention_mask: ``None``, ``[B|1, 1|H, Nq|1, Nk]`` bool or additive float, or
            ``[B, Nk]`` (nonzero = real token; a float one holds 1 and 0 only).
        batch, query_len, key_len: B, Nq, Nk of the attention call.
        is_causal: the model's causal flag; as in transformers' SDPA path it applies only
            when no mask is given (a given mask already holds the causal pattern), and
            then as ``causal_without_mask`` says; with a mask, causal with key padding
            is the pattern checked first (one read in eager code where it holds).
        query_valid: which queries are real, whose rows must follow the pattern:
            ``"auto"`` (self-attention's convention when Nq == Nk: a position whose key
            the mask hides from every query is padding, its row unchecked), ``None``
            (every query is real: every row is checked) or ``[B, Nq]`` bool.
        advice: what the caller can do instead, ending every error sentence.
        all_real_as_none: return ``key_padding_mask=None`` where every key is real (so
            that a method without key padding runs), which reads the mask on the host
            (on a GPU a wait for the queue, once a layer); ``False`` for a method that
            takes key padding, whose result with a mask of real keys is the same up to
            rounding (``registry.binding.all_real_padding_as_none``).
        name_padded_queries: how the caller names padded queries, said where a refused
            mask looks like one that hides them, or opens them to every key.
    Returns:
        ``ResolvedMask``; its ``key_padding_mask`` is ``None`` when every key is real
        and ``all_real_as_none``.
    Raises:
        UnsupportedMaskError: for any other mask pattern, with the reason.
    """
    if attention_mask is None:
        causal = causal_without_mask(is_causal, query_len, key_len)
        if causal and query_len != key_len:
            raise UnsupportedMaskError(
                f"causal attention over a cached prefix, or over the slots of a static cache "
                f"(Nq={query_len} queries, Nk={key_len} keys), is not supported by skyformer "
                f"methods, whose causal option needs Nq == Nk; run the prompt without a cache "
                f"(and without cache_implementation='static'), or {advice}."
            )
        return ResolvedMask(None, causal)
    if not isinstance(attention_mask, Tensor):
        raise UnsupportedMaskError(
            f"the attention mask is a {type(attention_mask).__name__}, not a tensor (e.g. a "
            f"flex-attention BlockMask); {advice}."
        )
    _refuse_learned(attention_mask, advice)
    allowed = _allowed(attention_mask, batch, query_len, key_len, advice)
    _refuse_per_head(allowed, "the attention mask", advice)
    rows = allowed[:, 0].expand(batch, -1, -1)  # [B, Qm, Nk]
    if rows.shape[1] == 1 or rows.stride(1) == 0:  # one row for every query: key padding
        return ResolvedMask(_normalise(rows[:, 0], all_real_as_none), False)

    # [B, Nk]: keys some (real) query may see; the others are padding. Rows of padded
    # queries are not checked (module docstring).
    if isinstance(query_valid, Tensor):
        if query_valid.dtype != torch.bool:  # ~ of 0/1 integers is -1/-2: every row unchecked
            raise TypeError(f"query_valid must be a bool tensor [B, Nq] (True = real query), "
                            f"got {query_valid.dtype}; pass query_valid.bool().")
        real_rows = query_valid.to(rows.device).expand(batch, query_len)
        visible = (rows & real_rows[:, :, None]).any(dim=1)
    else:
        visible = rows.any(dim=1)
        real_rows = visible if query_valid is not None and query_len == key_len \
            else torch.ones_like(rows[:, :, 0])
    unchecked = ~real_rows[:, :, None]  # [B, Nq, 1]

    def padding() -> bool:
        return _holds((rows == visible[:, None, :]) | unchecked,
                      "the attention mask is not key padding")

    def causal_padding() -> bool:
        tril = torch.ones(query_len, key_len, dtype=torch.bool, device=rows.device).tril()
        return _holds((rows == (tril & visible[:, None, :])) | unchecked,
                      "the attention mask is not causal with key padding")

    # The pattern the model declares first (causal with key padding where is_causal and
    # Nq == Nk, else key padding): in eager code one read where it holds (each check is
    # a read: on a GPU a wait for the queue, once a layer); a traced call cannot branch
    # on the mask's values, so it takes that pattern and checks it on the device
    if is_causal and query_len == key_len:
        if causal_padding():
            return ResolvedMask(_normalise(visible, all_real_as_none), True)
        if padding():
            return ResolvedMask(_normalise(visible, all_real_as_none), False)
    elif padding():
        return ResolvedMask(_normalise(visible, all_real_as_none), False)
    elif query_len == key_len and causal_padding():
        return ResolvedMask(_normalise(visible, all_real_as_none), True)
    if _is_causal_complement(rows):
        if attention_mask.dtype == torch.bool:
            raise UnsupportedMaskError(
                "the attention mask is the complement of a causal mask (True above the "
                "diagonal): a mask of the other convention? scaled_dot_product_attention's "
                "attn_mask holds True where attention is allowed, "
                "torch.nn.MultiheadAttention's where it is not; pass ~mask.")
        raise UnsupportedMaskError(  # a float mask has one convention: added to the logits
            "the additive attention mask blocks the diagonal and below and allows only the "
            "keys above it: the blocked half swapped? A causal mask blocks the entries "
            "above the diagonal: torch.zeros(N, N).masked_fill(~tril, float('-inf')) with "
            "tril = torch.ones(N, N, dtype=torch.bool).tril().")
    lengths = "" if query_len == key_len else (
        f" with as many queries as keys (here Nq={query_len} queries, Nk={key_len} keys: a "
        f"cached prefix, or the slots of a static cache, cache_implementation='static')")
    raise UnsupportedMaskError(
        "the attention mask is neither key padding nor causal with key padding (e.g. a "
        "sliding window, packed sequences, a cached prefix or a custom pattern); the "
        f"methods without attn_mask (the approximate ones) take only a key padding mask and, "
        f"those with a causal form, "
        f"causal masking{lengths}; {advice}."
        f"{_padded_queries_hint(rows, query_valid, name_padded_queries)}"
    )


def _padded_queries_hint(rows: Tensor, query_valid: Tensor | str | None, fix: str) -> str:
    """A sentence where the refused mask ``rows`` ``[B, Nq, Nk]`` would be key padding,
    or causal with key padding, but for queries that look padded: hidden from every key,
    or (where no row is hidden) opened to every key as transformers before 5 masked left
    padding under SDPA; ``fix`` says how the caller names them. Else ``""``. Eager code
    only, on the way to a refusal."""
    if isinstance(query_valid, Tensor) or torch.compiler.is_compiling():
        return ""
    seen = rows.any(dim=-1)  # [B, Nq]: queries that see some key
    if not bool(seen.all()):
        padded, how = ~seen, "hides from every key"
    else:
        padded, how = rows.all(dim=-1), "opens to every key"
    real = ~padded
    # an element whose every query sees every key has no padding (opened rows only)
    unpadded = padded.all(dim=1, keepdim=True) & seen.all(dim=1, keepdim=True)
    if not bool(padded.any()) or not bool((real.any(dim=1, keepdim=True) | unpadded).all()):
        return ""
    visible = (rows & real[:, :, None]).any(dim=1) | unpadded  # [B, Nk]
    patterns = [visible[:, None, :]]
    query_len, key_len = rows.shape[-2:]
    if query_len == key_len:
        tril = torch.ones(query_len, key_len, dtype=torch.bool, device=rows.device).tril()
        patterns.append(tril & visible[:, None, :])
    if not any(bool(((rows == p) | padded[:, :, None]).all()) for p in patterns):
        return ""
    return f" The queries it {how} look like padded queries: {fix}."


def _is_causal_complement(rows: Tensor) -> bool:
    """Whether ``rows`` ``[B, Nq, Nk]`` (True = attend) is True exactly above the
    diagonal: a causal mask of the other convention (read in eager code only, on the
    way to a refusal)."""
    query_len, key_len = rows.shape[-2:]
    if query_len != key_len or torch.compiler.is_compiling():
        return False
    above = torch.ones(query_len, key_len, dtype=torch.bool, device=rows.device).triu(1)
    return bool((rows == above).all())


def _refuse_learned(attention_mask: Tensor, advice: str) -> None:
    """A float mask that requires grad (while autograd records) is a bias being learned:
    the approximate methods read only which keys it hides, so its gradient would be left
    out (``None``) in silence; refused in a sentence."""
    if attention_mask.is_floating_point() and attention_mask.requires_grad \
            and torch.is_grad_enabled():
        raise UnsupportedMaskError(
            "the attention mask is a float tensor that requires grad (a learned bias?), "
            "and the approximate methods read only which keys it hides, so it would get no "
            f"gradient; {advice}, or pass the mask's .detach() if it is a fixed mask.")


def _refuse_per_head(allowed: Tensor, what: str, advice: str) -> None:
    """A sentence for a mask ``[B, H, Q, K]`` whose heads differ (``_holds``)."""
    if allowed.shape[1] > 1 and not _holds(allowed == allowed[:, :1],
                                           f"{what} differs between heads"):
        raise UnsupportedMaskError(
            f"{what} differs between heads; methods without attn_mask (the approximate "
            f"ones) take one key padding mask for all heads; {advice}.")


def causal_without_mask(is_causal: bool, query_len: int, key_len: int) -> bool:
    """Whether a call given no mask is causal: ``is_causal`` and ``Nq > 1``, as in
    transformers' SDPA path (one query of a cached prefix is the last position and sees
    every key), or ``Nq == Nk == 1``, where the mask hides nothing but a causal method
    computes its causal form, as for a longer prompt's first row and a decoding state's
    first step."""
    return bool(is_causal) and (query_len > 1 or query_len == key_len == 1)


def _normalise(key_valid: Tensor, all_real_as_none: bool = True) -> Tensor | None:
    """``None`` when every key is real and ``all_real_as_none`` (lets methods without
    mask support run); a traced call keeps the mask (no branch on its values)."""
    key_valid = key_valid.to(torch.bool).contiguous()
    if torch.compiler.is_compiling() or not all_real_as_none:
        return key_valid
    return None if bool(key_valid.all()) else key_valid


def _holds(condition: Tensor, what: str) -> bool:
    """Whether every entry of ``condition`` is True: read on the host in eager code;
    while traced (``torch.compile``), assumed and checked on the device instead
    (``torch._assert_async`` raises at run time, naming ``what``; on CUDA a device-side
    assert, fatal to the process's CUDA context: docs/pytorch2.md)."""
    if torch.compiler.is_compiling():
        torch._assert_async(condition.all(), f"skyformer: {what} (checked at run time "
                            "in a compiled model; use the exact attention for this mask)")
        return True
    return bool(condition.all())


def decoding_key_valid(
    attention_mask: Tensor | None,
    *,
    batch: int,
    new: int,
    total: int,
    past_valid: Tensor | None = None,
    advice: str = USE_EXACT,
) -> Tensor | None:
    """Which of the ``new`` positions a decoding step adds are real tokens.

    A decoding step attends from its ``new`` queries to all ``total`` positions (the
    cached ones first): its mask must be causal with key padding, the causal pattern
    shifted by ``total - new``, and show the cached positions as the state took them
    (``past_valid`` ``[B, total - new]``, True = real; ``None``: all real), since a
    state attends to every real position it took. Returns ``[B, new]`` bool (``None``
    when all are real). Raises ``UnsupportedMaskError`` for any other pattern (a
    sliding window hiding cached tokens, a mask that differs between heads).
    """
    if past_valid is not None and tuple(past_valid.shape) != (batch, total - new):
        raise ValueError(
            f"a decoding step of {batch} sequences over a cache of {past_valid.shape[0]} "
            f"sequences and {past_valid.shape[1]} positions (the step expects "
            f"{total - new}): reorder or repeat the cache for the step's batch first "
            f"(batch_select_indices, batch_repeat_interleave).")
    if attention_mask is None:
        if past_valid is not None and not bool(past_valid.all()):
            raise UnsupportedMaskError(
                "a decoding step without an attention mask over a cache that holds padding: "
                "exact attention would attend to the padded positions, the state does not; "
                f"pass the step's attention mask (generate does); {NEW_PROMPT}.")
        return None
    if not isinstance(attention_mask, Tensor):
        raise UnsupportedMaskError(
            f"the attention mask is a {type(attention_mask).__name__}, not a tensor; {advice}.")
    allowed = _allowed(attention_mask, batch, new, total, advice)
    _refuse_per_head(allowed, "a decoding step's attention mask", advice)
    rows = allowed[:, 0].expand(batch, new, total)  # [B, new, total]
    new_real = rows.any(dim=1)[:, total - new:]  # [B, new]: seen by no query: padding
    past = (past_valid.to(rows.device) if past_valid is not None
            else torch.ones(batch, total - new, dtype=torch.bool, device=rows.device))
    real = torch.cat([past.expand(batch, -1), new_real], dim=1)  # [B, total]
    position = torch.arange(total, device=rows.device)
    causal = position[None, :] <= position[total - new:, None]  # [new, total]
    query_real = new_real[:, :, None]  # rows of padded queries are not checked
    if not bool(((rows == (causal & real[:, None, :])) | ~query_real).all()):
        raise UnsupportedMaskError(
            "a decoding step's attention mask is not causal with key padding over the "
            "positions the cache took (e.g. a sliding window, a mask hiding cached tokens "
            f"or a custom pattern); the approximate methods cannot follow it; {advice}; "
            f"{NEW_PROMPT}.")
    return None if bool(new_real.all()) else new_real.contiguous()
