"""``skyformer.scaled_dot_product_attention``: every method behind the signature of
``torch.nn.functional.scaled_dot_product_attention``.

Same layout (``[B, H, L, E]``, or ``[H, L, E]``; a batch of one, or an unbatched
tensor beside batched ones, broadcast over the others' batch as SDPA does) and the same
arguments, with the method chosen by ``method=`` and its options as keyword arguments.
Each argument is honoured where the method can honour it and refused with a sentence
naming the method where it cannot:

- ``attn_mask``: the exact methods (capability ``attn_mask``) take any bool or additive
  mask broadcastable to ``[B, H, L, S]``; the approximate methods take masks that are
  key padding, or causal with key padding (``skyformer.masks.resolve_mask``), which
  reads the mask's values: under ``torch.compile``, or a ``torch.func`` transform of the
  mask itself (``vmap`` over it, its gradient), they take bool masks that broadcast
  over the queries (``[B, 1, 1, S]``; a float mask could hold a bias that cannot be
  checked there), or pass ``key_padding_mask`` and ``is_causal``; a mask the transform
  does not act on (a constant of ``grad`` over the queries) is read as in eager code. For
  them, as for ``key_padding_mask``, self-attention's convention holds when L == S
  (``query_padding_mask="auto"``): a position whose key the mask hides from every
  query is padding, its query too (output row 0, in no landmark pool, so that padding
  equals truncation); pass ``query_padding_mask=None`` where every query is real
  (cross-attention of equal lengths): every row must then follow the pattern, as SDPA
  gives each row the attention of its mask's row, or the mask is refused.
- ``is_causal``: the methods with capability ``causal``; with L != S aligned top left
  as SDPA (query i sees keys j <= i) for ``softmax`` and ``kernelized``, which take it
  as a mask, while the approximate methods' causal forms need L == S. With ``attn_mask``
  as well, both apply (torch's fused kernels do the same; its math path and its
  docstring refuse the pair).
- ``scale``: the methods with a ``scale`` option (every method but ``linear``).
- ``dropout_p``: applied, as by SDPA, whenever it is positive (pass 0 in evaluation):
  on the attention probabilities for the methods declaring ``weight_dropout``
  (``softmax``), on the output for the others, ``kernelized`` included (the same
  expectation, per entry of the output rather than per weight). The dropout draws from
  torch's global generator, as SDPA's, not from ``generator``: seed torch as well for a
  call with dropout to repeat.
- ``enable_gqa``: fewer key/value heads than query heads (H a multiple of Hkv), each
  group of H / Hkv query heads sharing one key/value head, as SDPA; the key/value heads
  are repeated for the methods, so every method runs grouped-query attention.
- Variable-length batches: packed sequences ``[1, H, T, E]`` with cumulative lengths
  ``cu_seqlens`` ``[B + 1]`` (and ``cu_seqlens_k`` for keys of other lengths), as in
  FlashAttention's varlen API and transformers' packed-sequence path; PyTorch's nested
  jagged tensors were the alternative. Cumulative lengths are plain tensors, so they
  pass through ``torch.compile`` and ``torch.export`` and come straight from the
  packed batches transformers builds; they are unpacked here into a padded batch with
  a key padding mask (``max_seqlen`` spares reading the lengths on the host under
  ``torch.compile``; eager calls read them to check them, and that no sequence is
  longer than ``max_seqlen``). The lengths say which tokens are real: a padding mask
  beside them, or ``cu_seqlens_k`` / ``max_seqlen`` without ``cu_seqlens``, is refused.

Beyond SDPA: ``key_padding_mask`` ``[B, S]`` (True = real token) and
``query_padding_mask`` (see ``skyformer.attention``), ``generator`` (a torch.Generator
or a random key, ``skyformer.random_key``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .linalg.tracing import may_read_values, values_to_check
from .masks import ResolvedMask, UnsupportedMaskError, allowed_entries, resolve_mask
from .ops.shared.inputs import check_attention_inputs
from .ops.shared.masked import mask_broadcasts
from .ops.shared.options import check_probability
from .registry import CapabilityError, check_capabilities, get_method, methods_taking
from .registry.binding import all_real_padding_as_none
from .registry.capabilities import masks_taken
from .registry.guard import warn_if_no_real_key
from .registry.methods import Method, refuse_misnamed_arguments
from .varlen import check_longest, length_argument, pack, unpack


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, *, method: str = "softmax",
    key_padding_mask: Tensor | None = None, query_padding_mask: Tensor | str | None = "auto",
    cu_seqlens: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
    max_seqlen: int | None = None, max_seqlen_k: int | None = None,
    generator: torch.Generator | Tensor | None = None, **options: Any,
) -> Tensor:
    """Attention of ``query: [B, H, L, E]`` to ``key: [B, Hkv, S, E]``,
    ``value: [B, Hkv, S, Ev]`` by ``method``; returns ``[B, H, L, Ev]`` (module doc)."""
    spec = get_method(method)
    refuse_misnamed_arguments(spec, options, "skyformer.scaled_dot_product_attention",
                              scaled_dot_product_attention)
    check_probability(spec.name, "dropout_p", dropout_p)
    for flag, given in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(given, bool):  # as torch's: truthiness would read "no" as True
            raise TypeError(f"{spec.name}: {flag} must be True or False, got "
                            f"{type(given).__name__} {given!r}.")
    if is_causal and options.get("causal") is False:
        raise ValueError(f"{spec.name}: is_causal=True and causal=False disagree; pass "
                         f"is_causal=True alone (or the method's causal=True).")
    _refuse_nested(spec.name, query, key, value)
    if isinstance(attn_mask, str):  # (q, k, v, "skyformer"): the fourth is torch's attn_mask
        raise TypeError(f"scaled_dot_product_attention takes the method by keyword: "
                        f"method={attn_mask!r}; its fourth positional argument is attn_mask, "
                        f"as in torch.nn.functional.scaled_dot_product_attention.")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"{spec.name}: attn_mask must be a torch.Tensor (bool, True = attend, "
                        f"or float, added to the scores) or None, got "
                        f"{type(attn_mask).__name__}.")
    if isinstance(scale, Tensor) and scale.dim() == 0 and may_read_values(scale):
        scale = float(scale)  # torch takes a 0-dim tensor where a float is meant
    layouts = {t.dim() for t in (query, key, value) if isinstance(t, Tensor)}
    if layouts == {3, 4}:  # an unbatched tensor beside batched ones: SDPA broadcasts it
        query, key, value = (_batched(t) for t in (query, key, value))
    if isinstance(query, Tensor) and query.dim() == 3:  # unbatched [H, L, E]
        return scaled_dot_product_attention(
            query[None], _batched(key), _batched(value), attn_mask,
            dropout_p, is_causal, scale, enable_gqa, method=method,
            key_padding_mask=_batched(key_padding_mask, 1),
            query_padding_mask=_batched(query_padding_mask, 1), cu_seqlens=cu_seqlens,
            cu_seqlens_k=cu_seqlens_k, max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k,
            generator=generator, **options)[0]
    if cu_seqlens is not None:
        _refuse_padding_masks(spec.name, key_padding_mask, query_padding_mask)
        return _varlen(spec, query, key, value, attn_mask, dropout_p, is_causal, scale,
                       enable_gqa, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                       generator, options)
    packed = " and ".join(name for name, given in (
        ("cu_seqlens_k", cu_seqlens_k), ("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)
    ) if given is not None)
    if packed:
        verbs = ("belong", "need") if " and " in packed else ("belongs", "needs")
        raise ValueError(f"{spec.name}: {packed} {verbs[0]} to packed sequences and "
                         f"{verbs[1]} cu_seqlens, the queries' cumulative lengths; pass "
                         f"cu_seqlens too, or leave {packed} out.")
    return _padded_call(spec, query, key, value, attn_mask, dropout_p, is_causal, scale,
                        enable_gqa, key_padding_mask, query_padding_mask, generator, options)


def _padded_call(spec: Method, query: Tensor, key: Tensor, value: Tensor, attn_mask: Any,
                 dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                 key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
                 generator: Any, options: dict[str, Any], *, callers_mask: bool = True
                 ) -> Tensor:
    """``scaled_dot_product_attention`` of a padded batch, its arguments checked;
    ``callers_mask=False``: ``key_padding_mask`` is the library's own (the packed
    sequences'), so a mask with no real key is no sign of a mask given in torch's
    convention."""
    _check_layout(spec.name, query, key, value)
    query, key, value = _shared_batch(query, key, value)
    key, value = _grouped(spec.name, query, key, value, enable_gqa)
    if callers_mask:  # the caller's, not attn_mask's
        warn_if_no_real_key(spec.name, key_padding_mask, key)
    if is_causal and query.shape[-2] != key.shape[-2]:
        attn_mask = _top_left_causal(spec, attn_mask, query, key)
        is_causal = False
    options = sdpa_options(spec, options, is_causal, scale, query.shape[-1])
    if 0 in (*query.shape[:3], key.shape[-2], value.shape[-1]):
        if attn_mask is not None:
            _check_mask_shape(attn_mask, query, key)
        spec.bind(**options)  # the options are checked as in any call
        return _empty_attention(spec.name, query, key, value, key_padding_mask,
                                query_padding_mask)
    arguments: dict[str, Any] = {}
    if attn_mask is not None:
        _check_mask_shape(attn_mask, query, key)
        attn_mask = _four_dims(attn_mask, key.shape[-2])
        if spec.capabilities.attn_mask:
            arguments["attn_mask"] = attn_mask
        else:
            key_padding_mask, causal = attn_mask_as_padding(
                spec, attn_mask, key_padding_mask, query_padding_mask, query, key,
                bool(options.get("causal")))
            options = sdpa_options(spec, options, causal, None, query.shape[-1])
    if dropout_p and spec.capabilities.weight_dropout:
        arguments["dropout_p"] = dropout_p
    bound = spec.bind(**options)
    out = bound(query, key, value, key_padding_mask=key_padding_mask,
                query_padding_mask=query_padding_mask, generator=generator, **arguments)
    if dropout_p and not spec.capabilities.weight_dropout:
        out = F.dropout(out, p=dropout_p, training=True)
    return out


def refuse_causal_lengths(spec: Method, lq: int, lk: int) -> None:
    """The sentence for an approximate method's causal form asked of ``lq`` queries and
    ``lk != lq`` keys (or for a method without one): SDPA's top-left alignment is the
    exact methods' alone."""
    check_capabilities(spec.name, causal=True)
    step = (" (new queries over cached keys, a decoding step: a decoding cache steps "
            "them, MultiHeadAttention(..., causal=True).new_cache() or "
            "skyformer.hf.DecodingCache; docs/causal.md)" if lq < lk else "")
    raise ValueError(
        f"{spec.name}: is_causal with {lq} quer{'y' if lq == 1 else 'ies'} and {lk} "
        f"key{'' if lk == 1 else 's'}: SDPA aligns the causal mask top left (query i sees "
        f"keys j <= i), which only the methods that take any attn_mask ('softmax', "
        f"'kernelized') follow; {spec.name}'s causal form needs as many queries as "
        f"keys{step}.")


def _top_left_causal(spec: Method, attn_mask: Tensor | None, query: Tensor, key: Tensor
                     ) -> Tensor:
    """``is_causal`` with L != S as SDPA reads it: query i sees keys j <= i (the mask
    aligned top left), as a mask ``[L, S]`` combined with ``attn_mask`` (both apply),
    for the methods that take any mask; the causal forms of the others need L == S."""
    lq, lk = query.shape[-2], key.shape[-2]
    if not spec.capabilities.attn_mask:
        refuse_causal_lengths(spec, lq, lk)
    causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
    if attn_mask is None:
        return causal
    _check_mask_shape(attn_mask, query, key)
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    if not attn_mask.is_floating_point():
        return attn_mask  # the method's check refuses other dtypes, as without is_causal
    return torch.where(causal, attn_mask, float("-inf"))


def _batched(t: Any, dims: int = 3) -> Any:
    """An unbatched call's tensor of ``dims`` dimensions with a batch of one in front
    (anything else as it is, for the checks of the batched call to name)."""
    return t[None] if isinstance(t, Tensor) and t.dim() == dims else t


def _refuse_nested(method: str, *tensors: Any) -> None:
    """Nested (jagged) tensors are not taken: packed sequences come with ``cu_seqlens``."""
    if any(isinstance(t, Tensor) and t.is_nested for t in tensors):
        raise ValueError(
            f"{method}: nested tensors are not taken; pack the sequences one after the other "
            f"([1, H, T, E]) and pass their cumulative lengths as cu_seqlens [B + 1] (e.g. "
            f"from a jagged tensor nt [B, j, E]: nt.values() and nt.offsets()).")


def _refuse_padding_masks(method: str, key_padding_mask: Any, query_padding_mask: Any) -> None:
    """With ``cu_seqlens`` the lengths say which tokens are real: a padding mask besides
    them is refused, not left out in silence."""
    given = [name for name, m, default in (("key_padding_mask", key_padding_mask, None),
                                          ("query_padding_mask", query_padding_mask, "auto"))
             if not (m is default or (isinstance(m, str) and m == default))]
    if given:
        raise ValueError(
            f"{method}: with cu_seqlens, pass no {' or '.join(given)}: the cumulative lengths "
            f"say which tokens are real; leave padding out of the packed sequences (or pad a "
            f"batch [B, H, L, E] and pass the masks without cu_seqlens).")


def _check_layout(method: str, query: Any, key: Any, value: Any) -> None:
    """Each of query, key and value is ``[B, H, L, E]``, or a sentence with the call that
    makes it one where torch's SDPA takes the layout (more leading dims, or ``[L, E]``)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            fix = "."
            if isinstance(t, Tensor) and t.dim() > 4:
                fix = (f"; flatten the leading dims into one batch, {name}.flatten(0, -4) "
                       f"(the same for the others), and the output's back, "
                       f"out.unflatten(0, {tuple(t.shape[:-3])}).")
            elif isinstance(t, Tensor) and t.dim() == 2:
                fix = f"; for one head pass {name}[None] ([1, L, E])."
            raise ValueError(
                f"{method}: scaled_dot_product_attention takes {name} as [B, H, L, E] (or "
                f"[H, L, E]), got {shape}{fix}"
            )


def _empty_attention(method: str, query: Tensor, key: Tensor, value: Tensor,
                     key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None
                     ) -> Tensor:
    """SDPA's result where a batch, head, length or value size is 0: ``[B, H, L, Ev]``,
    zeros where it has rows (no key: a row without keys is zero, as in every call),
    tied to the inputs so that a backward pass gives them zero gradients."""
    check_attention_inputs(query, key, value, key_padding_mask, method=method,
                           query_padding_mask=query_padding_mask, allow_empty=True)
    tie = sum(t.reshape(-1)[:0].sum() for t in (query, key, value))  # 0, differentiable
    return query.new_zeros(*query.shape[:3], value.shape[-1]) + tie


def _shared_batch(query: Tensor, key: Tensor, value: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """query, key and value with a batch of one broadcast over the others' batch, as
    SDPA broadcasts them: views (no copy). Batches of other sizes stay as they are, for
    the method's check to name."""
    sizes = {t.shape[0] for t in (query, key, value)}
    if len(sizes) != 2 or 1 not in sizes:
        return query, key, value
    b = max(sizes)
    return tuple(t.expand(b, *t.shape[1:]) for t in (query, key, value))  # type: ignore


def _four_dims(attn_mask: Tensor, keys: int) -> Tensor:
    """``attn_mask`` as ``[B|1, H|1, L|1, S]``: SDPA broadcasts a mask from the right
    (``[S]`` and ``[L, S]`` are one mask for every batch and head, ``[H, L, S]`` one for
    every batch; resolve_mask would read a 2-D mask as transformers' ``[B, S]``), and a
    column ``[..., L, 1]`` holds for every key. A mask that a ``torch.func`` transform
    does not act on stays readable: the transform wraps the view made of it here, which
    the values of the mask given do not depend on."""
    shaped = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    shaped = shaped.expand(*shaped.shape[:-1], keys)
    if may_read_values(attn_mask) and not may_read_values(shaped):
        return values_to_check(shaped)  # type: ignore[return-value]
    return shaped


def _grouped(method: str, query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool
             ) -> tuple[Tensor, Tensor]:
    """Keys and values with as many heads as the queries (SDPA's grouped-query rule)."""
    h, hkv = query.shape[1], key.shape[1]
    if h == hkv:
        return key, value
    if not enable_gqa or hkv == 0 or h % hkv or value.shape[1] != hkv:
        needs = ("as many key as value heads and a number of query heads that is a "
                 "multiple of them" if enable_gqa else "enable_gqa=True and a number of "
                 "query heads that is a multiple of the key/value heads")
        raise ValueError(
            f"{method}: the query has {h} heads but key/value have {key.shape[1]}/"
            f"{value.shape[1]}; grouped-query attention needs {needs}."
        )
    check_capabilities(method, gqa=True)
    group = h // hkv
    return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)


def sdpa_options(spec: Method, options: dict[str, Any], is_causal: bool,
                  scale: float | None, head_dim: int) -> dict[str, Any]:
    """The method's options with SDPA's ``is_causal`` and ``scale``, or a sentence."""
    options = dict(options)
    if is_causal:
        check_capabilities(spec.name, causal=True)
        options["causal"] = True
    if scale is not None and "scale" in spec.option_names():
        options["scale"] = scale  # the call's, over a scale in the method's name
    elif scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        having = methods_taking("scale")
        raise CapabilityError(
            f"{spec.name} cannot use scale={scale:g}: it has no logit scale option, so it "
            f"takes only scale=None or SDPA's default 1/sqrt(E) = {head_dim**-0.5:.6g}, "
            f"which change nothing it computes; methods with a scale option: "
            f"{', '.join(having)}."
        )
    return options


def _check_mask_shape(attn_mask: Tensor, query: Tensor, key: Tensor) -> None:
    """``attn_mask`` broadcasts to [B, H, L, S], as SDPA requires, is boolean or float
    and is on the inputs' device, or a sentence that names the shape and dtype as given
    (not as the methods later see them: a [L, S] mask of integers was called 4-D) or the
    device (torch's error came from inside the method, an approximate one naming the
    key_padding_mask made of the mask)."""
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be boolean (True = attend) or float (added to the "
                         f"scores), as in scaled_dot_product_attention, got "
                         f"{attn_mask.dtype}; pass attn_mask.bool() for a mask of 0s and 1s.")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but the inputs are on "
                         f"{query.device}; pass attn_mask.to(query.device).")
    target = (*query.shape[:3], key.shape[-2])
    if not mask_broadcasts(attn_mask, target):
        b, h = target[:2]
        merged = (attn_mask.dim() == 3 and attn_mask.shape[0] == b * h and h > 1
                  and tuple(attn_mask.shape[1:]) == tuple(target[2:]))
        hint = (f" A torch.nn.MultiheadAttention mask [B * H, L, S] reshapes with "
                f"attn_mask.view({b}, {h}, {target[2]}, {target[3]}) (and a bool one of "
                f"torch's, True = blocked, inverts with ~)." if merged else "")
        raise ValueError(
            f"attn_mask has shape {tuple(attn_mask.shape)}, which does not broadcast to the "
            f"attention's [B, H, L, S] = {list(target)}; as in scaled_dot_product_attention "
            f"it is e.g. [L, S], [B, 1, L, S], or [B, 1, 1, S] for padded keys.{hint}")


def attn_mask_as_padding(spec: Method, attn_mask: Tensor, key_padding_mask: Tensor | None,
                         query_padding_mask: Any, query: Tensor, key: Tensor, causal: bool,
                         instead: str | None = None) -> tuple[Tensor | None, bool]:
    """An ``attn_mask`` as the key padding mask and causal flag an approximate method
    takes (combined with the caller's ``key_padding_mask``), or a sentence; the rows of
    the queries ``query_padding_mask`` calls real must follow it (``resolve_mask``).
    ``instead``: what the caller's own arguments take in place of a mask whose values
    cannot be read (by default this entry's: a bool ``[B, 1, 1, S]`` mask, or
    ``key_padding_mask`` and ``is_causal``)."""
    b, _, lq, _ = query.shape
    lk = key.shape[2]
    advice = (f"{spec.name} is one of those: use method='softmax' or 'kernelized', which "
              f"take any attn_mask")
    if may_read_values(attn_mask):
        given = query_padding_mask is None or (
            isinstance(query_padding_mask, Tensor) and query_padding_mask.dtype == torch.bool
            and tuple(query_padding_mask.shape) == (b, lq))
        rows = query_padding_mask if given else "auto"  # others: the method's check names
        resolved = _resolved_with_causal(attn_mask, causal, batch=b, query_len=lq,
                                         key_len=lk, query_valid=rows, advice=advice,
                                         all_real_as_none=all_real_padding_as_none(spec))
        valid, causal = resolved.key_padding_mask, causal or resolved.causal
    elif attn_mask.dtype == torch.bool and attn_mask.shape[-2] == 1 \
            and attn_mask.shape[-1] == lk and attn_mask.shape[-3] == 1:
        valid = attn_mask.reshape(-1, lk).expand(b, lk)
    elif attn_mask.is_floating_point():  # its values (a bias?) cannot be read to check
        raise CapabilityError(
            f"{spec.name} takes only {masks_taken(spec.capabilities)}, and under "
            f"torch.compile or a torch.func transform the values of a float attn_mask "
            f"cannot be read to check that it holds no bias (which {spec.name} would leave "
            f"out): pass {instead or _instead_of_a_float_mask(spec)}."
        )
    else:
        instead = instead or (f"{_mask_arguments(spec)}, or a mask [B, 1, 1, S] that is the "
                              f"same for every query")
        raise CapabilityError(
            f"{spec.name} takes only {masks_taken(spec.capabilities)}, and under "
            f"torch.compile or a torch.func transform the values of attn_mask cannot be read "
            f"to check it is one: pass {instead}."
        )
    if valid is not None and key_padding_mask is not None:
        if not _is_key_padding(key_padding_mask, b, lk):
            return key_padding_mask, causal  # the method's check names what is wrong
        valid = valid & key_padding_mask
    return (key_padding_mask if valid is None else valid), causal


def _resolved_with_causal(attn_mask: Tensor, causal: bool, **how: Any) -> ResolvedMask:
    """``resolve_mask`` of ``attn_mask`` as it applies beside ``causal`` (both apply): a
    mask refused alone is read again with the entries above the diagonal blocked, which
    the causal mask hides anyway (a prefix-LM mask with is_causal is causal). Only where
    it is refused alone: a key padding mask [B, 1, 1, S] stays one, no [N, N] block."""
    try:
        return resolve_mask(attn_mask, is_causal=False, **how)
    except UnsupportedMaskError as alone:
        if not causal or how["query_len"] != how["key_len"]:
            raise
        refused = alone
    n = how["query_len"]
    above = torch.ones(n, n, dtype=torch.bool, device=attn_mask.device).triu(1)
    allowed = allowed_entries(attn_mask)  # as resolve_mask reads it (finfo.min: blocked)
    hidden = (attn_mask.masked_fill(above, float("-inf")) if attn_mask.is_floating_point()
              else allowed & ~above)  # a float mask's bias is kept, for resolve_mask to refuse
    resolved = resolve_mask(hidden, is_causal=True, **how)
    valid = resolved.key_padding_mask
    if valid is not None and bool((allowed.flatten(1).any(-1) & ~valid.any(-1)).any()):
        raise refused  # it allowed only what causal hides (the other convention's mask?)
    return resolved


def _is_key_padding(mask: Any, b: int, lk: int) -> bool:
    """Whether ``mask`` is a bool ``[B, S]`` tensor, which an ``attn_mask``'s key padding
    may join; anything else goes to the method as given, whose check says what is wrong
    (joined, a float mask failed inside ``&`` and a ``[1, S]`` one was broadcast)."""
    return isinstance(mask, Tensor) and mask.dtype == torch.bool \
        and tuple(mask.shape) == (b, lk)


def _instead_of_a_float_mask(spec: Method) -> str:
    """What this entry takes in place of a float ``attn_mask`` it cannot read."""
    return f"a bool mask [B, 1, 1, S] (True = attend), or {_mask_arguments(spec)}"


def _mask_arguments(spec: Method) -> str:
    """The arguments that give ``spec`` the masks it takes: ``"key_padding_mask and
    is_causal"``, or the one of them it has."""
    caps = spec.capabilities
    return " and ".join(a for a, able in (("key_padding_mask", caps.mask),
                                          ("is_causal", caps.causal)) if able) or "no mask"


def _same_lengths(cu_q: Any, cu_k: Any) -> bool:
    """Whether the keys' cumulative lengths are the queries' (transformers passes one
    tensor for both; FlashAttention's callers pass two equal ones): one tensor, or in
    eager code equal ones (a host read, as the lengths' checks make; under
    ``torch.compile`` and ``torch.export`` two tensors are read as other lengths, which
    only KDEformer's and LSH Scatterbrain's blocks tell apart: docs/pytorch2.md)."""
    if cu_k is None or cu_k is cu_q:
        return cu_k is cu_q
    return isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor) \
        and cu_q.shape == cu_k.shape and cu_q.device == cu_k.device \
        and may_read_values(cu_q, cu_k) and bool(torch.equal(cu_q, cu_k))


def _first_unequal_sequence(cu_q: Tensor, cu_k: Tensor) -> tuple[int, int, int] | None:
    """``(i, Nq, Nk)`` of the first packed sequence whose queries and keys differ in
    number, or None. A host read: eager calls only, as the other checks of the lengths
    (``varlen.py``)."""
    lengths_q, lengths_k = torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()
    for i, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        if nq != nk:
            return i, nq, nk
    return None


def _check_paired_lengths(spec: Method, cu_q: Tensor, cu_k: Tensor, is_causal: bool) -> None:
    """Packed sequences whose query and key lengths differ (``cu_q``, ``cu_k``: checked
    ``[B + 1]``) are refused where one such sequence alone would be: by a method that
    needs Nq == Nk (padded to one width, it would run), and with is_causal, as one causal
    call, since whether a shorter query side aligns at the top or the bottom has no one
    convention (SDPA's top left, FlashAttention's bottom right)."""
    if spec.capabilities.cross_attention and not is_causal:
        return
    unequal = _first_unequal_sequence(cu_q, cu_k)
    if unequal is None:
        return
    i, nq, nk = unequal
    if not spec.capabilities.cross_attention:
        try:
            check_capabilities(spec.name, cross_attention=True)
        except CapabilityError as err:
            raise CapabilityError(
                f"{err} Packed sequence {i} has {nq} queries and {nk} keys (cu_seqlens and "
                f"cu_seqlens_k differ there); pack the keys as the queries.") from None
    raise ValueError(
        f"{spec.name}: is_causal needs as many queries as keys in every packed sequence, "
        f"got Nq={nq}, Nk={nk} in sequence {i} (cu_seqlens and cu_seqlens_k differ "
        f"there); pack the keys as the queries, or attend without is_causal.")


def _varlen(spec: Method, query: Tensor, key: Tensor, value: Tensor, attn_mask: Any,
            dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
            cu_seqlens: Tensor, cu_seqlens_k: Tensor | None, max_seqlen: int | None,
            max_seqlen_k: int | None, generator: Any, options: dict[str, Any]) -> Tensor:
    """Packed sequences: unpack to a padded batch with padding masks, attend, pack."""
    _check_layout(spec.name, query, key, value)
    if not query.device == key.device == value.device:  # before cu_seqlens meets them
        raise ValueError(f"{spec.name}: query, key and value must be on one device, got "
                         f"{query.device}, {key.device}, {value.device}.")
    if attn_mask is not None:
        raise ValueError(f"{spec.name}: with cu_seqlens, pass no attn_mask (the sequences "
                         f"are kept apart by the cumulative lengths; use is_causal).")
    check_capabilities(spec.name, varlen=True)  # varlen implies mask (Capabilities)
    if _same_lengths(cu_seqlens, cu_seqlens_k):
        # keys packed as the queries: self-attention, padded to one width (the wider of
        # two bounds given: both sides padded alike, each pair is Nq == Nk)
        if max_seqlen is None or max_seqlen_k is None:
            max_seqlen = max_seqlen if max_seqlen is not None else max_seqlen_k
        elif max_seqlen_k is not max_seqlen:
            bounds = [length_argument(m, spec.name, name, "cu_seqlens")
                      for m, name in ((max_seqlen, "max_seqlen"), (max_seqlen_k, "max_seqlen_k"))]
            for bound, name in zip(bounds, ("max_seqlen", "max_seqlen_k"), strict=True):
                if isinstance(cu_seqlens, Tensor):  # (anything else: unpack's sentence)
                    check_longest(cu_seqlens.long(), bound, spec.name, name)  # each a bound
            max_seqlen = torch.sym_max(*bounds)
        cu_seqlens_k = max_seqlen_k = None
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    if isinstance(cu_k, Tensor) and isinstance(cu_seqlens, Tensor) \
            and cu_k.shape != cu_seqlens.shape:
        raise ValueError(
            f"{spec.name}: cu_seqlens_k must have one entry per entry of cu_seqlens (the "
            f"same sequences, keys of other lengths), got {tuple(cu_k.shape)} and "
            f"{tuple(cu_seqlens.shape)}.")
    if cu_seqlens_k is None and key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{spec.name}: the keys hold {key.shape[2]} packed tokens and the queries "
            f"{query.shape[2]}, but without cu_seqlens_k the keys are packed as the queries "
            f"(cu_seqlens); pass cu_seqlens_k, the keys' cumulative lengths.")
    if key.shape[2] != value.shape[2]:
        raise ValueError(f"{spec.name}: key and value must hold the same packed tokens, got "
                         f"T = {key.shape[2]} keys and {value.shape[2]} values.")
    if cu_seqlens_k is None and max_seqlen_k is not None and max_seqlen_k != max_seqlen:
        raise ValueError(
            f"{spec.name}: max_seqlen_k ({max_seqlen_k!r}) without cu_seqlens_k: the keys are "
            f"packed as the queries (cu_seqlens), so their longest length is max_seqlen "
            f"({max_seqlen!r}); leave max_seqlen_k out, or pass cu_seqlens_k.")
    q, q_valid = unpack(query, cu_seqlens, max_seqlen, spec.name)
    k, k_valid = (unpack(key, cu_k, max_seqlen_k, spec.name, "max_seqlen_k", "cu_seqlens_k")
                  if cu_seqlens_k is not None else unpack(key, cu_k, max_seqlen, spec.name))
    if cu_seqlens_k is not None and may_read_values(cu_seqlens, cu_k):
        _check_paired_lengths(spec, cu_seqlens, cu_k, is_causal)  # checked tensors by now
    v, _ = unpack(value, cu_k, k.shape[2], spec.name)
    # one mask object for self-attention: the methods read two (equal) masks as
    # cross-attention (KDEformer's and Scatterbrain's LSH blocks, the causal chunks)
    query_valid = "auto" if cu_seqlens_k is None else q_valid
    out = _padded_call(spec, q, k, v, None, dropout_p, is_causal, scale, enable_gqa, k_valid,
                       query_valid, generator, options, callers_mask=False)
    return pack(out, cu_seqlens, query.shape[2])
