"""Attention functions in transformers' ``AttentionInterface`` form, one per method.

transformers calls ``fn(module, query, key, value, attention_mask, dropout=..., scaling=...,
is_causal=None, **kwargs)`` with ``query: [B, H, Nq, D]``, ``key, value: [B, Hkv, Nk, D]``
and expects ``(attn_output [B, Nq, H, Dv], attn_weights or None)``. Each function here

- picks the layer's setting (``skyformer.hf.layers``), or the method its name carries;
- turns the mask into ``key_padding_mask`` and ``causal`` (``skyformer.masks``),
  refusing anything else, and follows the module's ``is_causal`` when no mask is given;
- passes a model's own logit ``scaling`` to methods with a ``scale`` option and refuses it
  for the others (every other method assumes 1/sqrt(head dim));
- applies dropout in training: exact ``softmax`` runs transformers' SDPA path with
  ``dropout_p`` (dropout on the attention probabilities, as the model was trained);
  every other method has no attention matrix to drop entries of, so dropout is applied
  to its output ``[B, H, Nq, Dv]`` before the heads are merged (unbiased, like dropout on
  the probabilities, but it drops value mixtures instead of weights; this is also what
  ``skyformer.nn.MultiHeadAttention`` does);
- gives the methods that take any ``attn_mask`` (softmax, kernelized) the model's mask
  as it is, with a T5 position bias added to it, so that sliding windows, packed
  sequences, static caches and position biases work as with SDPA;
- refuses keyword arguments that change the attention in a way the method cannot
  apply (soft-capping, attention sinks, sparse key selections, also in exact layers,
  whose SDPA attention cannot apply them either; for the approximate methods also
  sliding windows, position biases and packed sequences);
- repeats key/value heads for grouped-query attention;
- returns ``(output.transpose(1, 2), None)``, or with the attention maps asked for
  (``output_attentions=True``: passed down, read by transformers' output recorder, or
  recorded from an attention module's own argument, ``hf/maps_flag.py``) the matrix the
  method applies (``skyformer.attention_weights``) in place of ``None``.

The mask builder registered with each name gives padding-only masks as ``[B, 1, Nq, Nk]``
views of one ``[B, Nk]`` row (stride 0 along Nq) instead of transformers' materialised
mask (O(N) instead of O(N^2) memory for long inputs) and defers to transformers' SDPA masks for
everything else.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from ..decoding import new_decoding_state
from ..linalg.tracing import may_read_values
from ..masks import UnsupportedMaskError, causal_without_mask, decoding_key_valid, resolve_mask
from ..ops.shared.causal_nystrom import CAUSAL_FORM_DEFAULTS
from ..registry import (
    CapabilityError,
    Method,
    get_method,
    list_methods,
    methods_that_can,
)
from ..registry.binding import all_real_padding_as_none
from ..sketch.rng import random_key
from ..weights import call_maybe_with_weights
from .decoding import DecodingLayer, claimed_step
from .layers import (
    DISPATCHING_MODELS,
    EXACT,
    STATE_NAME,
    LayerAttention,
    clear_layer,
    current_layer,
    is_cross_attention,
    is_default_scaling,
    layer_seed,
    make_layer,
    scaling_sentence,
)
from .maps_flag import maps_asked

try:  # the recorder of output_attentions=True (transformers 5); None where it is not there
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:  # pragma: no cover - the flag passed down is read alone then
    _COLLECTOR = None

PREFIX = "skyformer:"
# What to do with a layer whose mask a method cannot take, ending the error sentences.
USE_SDPA = (
    "load the model with attn_implementation='sdpa' or keep exact attention in the layers "
    "that need it (skyformer.hf.set_attention(model, 'exact', layers=...))"
)
# A self-attention step with more keys than queries runs over a cache of transformers'
# own, which hands it every cached key: the causal forms take Nq == Nk, a DecodingCache
# steps them (assisted generation, a prompt fed in parts)
OVER_A_CACHED_PREFIX = (
    "steps over a cached prefix decode with skyformer.hf.DecodingCache(model) as the cache "
    "(generate(..., cache=skyformer.hf.DecodingCache(model))); an assistant model "
    "(assistant_model=...) gets transformers' own cache whatever generate is given, so "
    "keep its attention exact (skyformer.hf.restore_exact(assistant)); for other masks, "
    + USE_SDPA
)
PER_LAYER = "skyformer"  # the implementation whose layers each follow their own setting

# Keyword arguments some models pass that change what attention computes. Those in
# _REFUSED_KWARGS transformers' SDPA attention cannot apply either (it drops sinks and
# sparse selections without a word), so exact layers refuse them too: such models run
# their own attention. Those in _IN_THE_MASK are also in the mask transformers builds
# for SDPA (or, for a position bias, merged into it here), so exact layers and the
# methods that take any attn_mask honour them.
_REFUSED_KWARGS = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "indices": "a sparse key selection",
    "block_indices": "a sparse key selection",
}
_IN_THE_MASK = {
    "sliding_window": "a sliding-window pattern",
    "position_bias": "an additive position bias",
    "cu_seq_lens_q": "packed sequences",
    "cu_seq_lens_k": "packed sequences",
}

# What to do with a model whose attention needs what _REFUSED_KWARGS names.
USE_ITS_OWN = (
    "run this model with its own attention: load it with attn_implementation='eager' "
    "(or call skyformer.hf.restore_exact(model))"
)
SDPA_HERE = "transformers' SDPA attention (what exact layers run here)"

_EXACT_LAYER = LayerAttention(EXACT, None, (), None, None, PER_LAYER, False)


def implementation_name(method: str) -> str:
    """The ``attn_implementation`` name of a method: ``"skyformer:<method>"``."""
    return PREFIX + method


def is_skyformer_implementation(implementation: str | None) -> bool:
    """Whether an ``attn_implementation`` name is one of ours: ``"skyformer"`` (each
    layer runs its own setting) or ``"skyformer:<method>"``."""
    return implementation is not None and (
        implementation == PER_LAYER or implementation.startswith(PREFIX))


# Held while a layer's setting is made or cleared on the attn_implementation route:
# concurrent first forwards (a thread-pool server) would each make a per-layer state
# and install their own, so the first calls ran with states the model then dropped.
_MAKING = threading.Lock()

# The configs that set_attention switched for one part of an encoder-decoder (by id;
# the configs weakly held): a layer of the other part, without a setting, runs exact
# attention by the caller's choice, not from a bare "skyformer".
_SET_CONFIGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def note_set_config(config: Any) -> None:
    """Record that ``set_attention`` set one part of ``config``'s encoder-decoder."""
    _SET_CONFIGS[id(config)] = config


def _layer_for(module: nn.Module, implementation: str, default_method: str) -> LayerAttention:
    layer = current_layer(module)
    if layer is not None and layer.implementation == implementation:
        return layer
    if layer is None and default_method == EXACT:  # nothing to make or clear
        if implementation == PER_LAYER and not torch.compiler.is_compiling() \
                and _SET_CONFIGS.get(id(getattr(module, "config", None))) is None:
            _warn_never_set(module)
        return _EXACT_LAYER
    if torch.compiler.is_compiling():  # traced once, on one thread
        return _make_layer_for(module, implementation, default_method)
    with _MAKING:
        return _make_layer_for(module, implementation, default_method)


def _warn_never_set(module: nn.Module) -> None:
    """The per-layer implementation in a layer ``set_attention`` never set (it gives
    every layer of the model it is given a setting, exact ones too): loaded with
    ``attn_implementation="skyformer"``, the name a user would guess for the method,
    every layer runs exact attention. Not where ``set_attention`` set one part of an
    encoder-decoder (``note_set_config``, by config: another encoder-decoder built on the
    same config object is silent too, and a deep copy of the set model, which holds a
    config of its own, warns). Shown once per place in the model's code (Python's
    warning registry)."""
    warnings.warn(
        f"attn_implementation={PER_LAYER!r} runs each attention layer as "
        f"skyformer.hf.set_attention set it, and this {type(module).__name__} has no "
        f"setting, so it runs exact attention; for one method in every layer load with "
        f"attn_implementation='skyformer:<method>' (e.g. 'skyformer:skyformer'), or call "
        f"skyformer.hf.set_attention(model, '<method>', ...) first.", UserWarning,
        stacklevel=5)


def _make_layer_for(module: nn.Module, implementation: str, default_method: str
                    ) -> LayerAttention:
    """``_layer_for`` where the module has no setting for ``implementation``: made now,
    unless another thread made it meanwhile."""
    layer = current_layer(module)
    if layer is not None and layer.implementation == implementation:
        return layer
    if default_method == EXACT:
        if layer is not None:
            clear_layer(module)  # made for another implementation: stale
        return _EXACT_LAYER
    index = getattr(module, "layer_idx", None)
    layer = make_layer(
        module, default_method, index=index if isinstance(index, int) else None,
        implementation=implementation, seed=None, cross=is_cross_attention(module), options={},
    )
    state = module._modules.get(STATE_NAME)
    if (module.training and torch.is_grad_enabled() and state is not None
            and any(p.requires_grad for p in state.parameters())):
        warnings.warn(
            f"{default_method} makes its trainable parameters in a layer's first forward "
            f"pass on the attn_implementation={implementation!r} route, after an optimizer "
            f"(or DDP) built at load time, which will not update them; to train, set the "
            f"method with skyformer.hf.set_attention(model, {default_method!r}) or load "
            f"with skyformer.hf.from_pretrained, which make them at once.",
            UserWarning, stacklevel=3)
    return layer


def make_first_forward_layers(modules: list[nn.Module], implementation: str) -> None:
    """Set up now, as their first forward pass would, the ``modules`` of a model switched
    to ``implementation`` = ``"skyformer:<method>"`` that have no setting for it (with
    the method's per-layer state), so that saved state can be loaded into them."""
    method = implementation.removeprefix(PREFIX)
    for module in modules:
        _layer_for(module, implementation, method)


def _where(module: nn.Module, layer: LayerAttention) -> str:
    name = type(module).__name__
    return name if layer.index is None else f"layer {layer.index} ({name})"


def _call_options(spec: Method, layer: LayerAttention, scaling: float | None, head_dim: int,
                  causal: bool, where: str) -> dict[str, Any]:
    """The options this call changes: ``causal`` from the model's masks, the model's own
    logit ``scale`` (unless the user set one)."""
    names = spec.option_names()
    if causal and not spec.capabilities.causal:
        raise CapabilityError(
            f"{where}: the model asks for causal attention (a decoder or a causal mask), and "
            f"{spec.name} cannot do causal masking; methods that can: "
            f"{', '.join(m for m in list_methods() if get_method(m).capabilities.causal)}."
        )
    changes: dict[str, Any] = {}
    if "causal" in names:
        changes["causal"] = causal
    if not causal:  # the causal form's own options, which a call that is not causal
        # refuses: they serve the model's causal layers (an encoder-decoder's decoder)
        changes.update({name: default for name, default in CAUSAL_FORM_DEFAULTS.items()
                        if name in names})
    if scaling is not None and not is_default_scaling(scaling, head_dim):
        if "scale" not in names:
            sentence = scaling_sentence(spec.name, scaling, head_dim, causal)
            raise CapabilityError(f"{where}: {sentence}.")
        if "scale" not in layer.explicit and "scale" not in dict(spec.preset):
            changes["scale"] = float(scaling)  # the user's, in a keyword or a variant, wins
    return changes


def _keys_for_call(module: nn.Module, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values as the methods take them: key/value heads repeated for
    grouped-query attention."""
    groups = getattr(module, "num_key_value_groups", 1)
    if isinstance(groups, int) and groups > 1:  # grouped-query attention
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return key, value


def skyformer_attention_forward(
    implementation: str,
    default_method: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """One attention call of a transformers model through a skyformer method.

    Args:
        implementation: the ``attn_implementation`` name this function is registered as.
        default_method: the method of layers without a setting (``"exact"`` for the
            per-layer implementation).
        module: the calling attention module.
        query: ``[B, H, Nq, D]``; key, value: ``[B, Hkv, Nk, D]`` (``H`` a multiple of ``Hkv``).
        attention_mask: see ``skyformer.masks.resolve_mask``.
        dropout: attention dropout probability (transformers passes 0 in eval mode).
        scaling: the model's logit scale (``None`` = 1/sqrt(D)).
        is_causal: causal flag; ``None`` = ``module.is_causal`` (as transformers' SDPA).
    Returns:
        ``(out [B, Nq, H, Dv], maps)``: ``maps`` ``[B, H, Nq, Nk]``, the method's attention
        weights (``skyformer.attention_weights``), where ``output_attentions=True`` asks
        for them and the method has them, else ``None``.
    """
    layer = _layer_for(module, implementation, default_method)
    decoding = claimed_step(key)
    try:
        if decoding is not None:
            decoding.follow(module, layer)
            decoding.check_reaches(attention_mask, query.shape[2])
        return _attention(module, layer, decoding, query, key, value, attention_mask,
                          dropout, scaling, is_causal, kwargs)
    except BaseException as error:
        if decoding is not None:  # undone, or the cache refuses the next step
            decoding.fail(_where(module, layer), error)
        raise


def _attention(module: nn.Module, layer: LayerAttention, decoding: DecodingLayer | None,
               query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float, scaling: float | None, is_causal: bool | None,
               kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """``skyformer_attention_forward`` once the layer and its cache step are known."""
    _refuse_what_the_layer_cannot_apply(module, layer, kwargs)
    # the attention maps of output_attentions=True: the method's weights where it has them
    # (exact layers: skyformer's softmax, whose maps transformers' SDPA would not give)
    weights = _attentions_requested(module, kwargs)
    if layer.method != EXACT:  # with or without a cache
        _refuse_packing_outside_the_mask(module, layer, attention_mask, query, kwargs)
        if weights and not layer.bound.method.capabilities.weights:
            _warn_no_weights(layer)
            weights = False
    if decoding is not None:
        if layer.method != EXACT and not layer.bound.method.capabilities.attn_mask:
            if weights:
                _warn_no_weights(layer, decoding=True)
            return _decoding_step(module, layer, decoding, query, key, value, attention_mask,
                                  dropout, scaling)
        key, value = decoding.keep(key, value)  # exact attention over every key so far
    if layer.method == EXACT and not weights:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    if layer.method == EXACT:  # its maps: the same attention as skyformer's softmax
        layer = dataclasses.replace(
            layer, bound=get_method("softmax").bind(query.shape[1], query.shape[-1]))
    assert layer.bound is not None
    spec = layer.bound.method
    where = _where(module, layer)
    takes_any_mask = spec.capabilities.attn_mask
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if takes_any_mask:
        return _with_attn_mask(module, layer, where, query, key, value, attention_mask,
                               dropout, scaling, bool(is_causal), kwargs.get("position_bias"),
                               weights)
    b, _, nq, head_dim = query.shape
    nk = key.shape[2]
    advice = OVER_A_CACHED_PREFIX if nq < nk and not layer.cross else USE_SDPA
    resolved = resolve_mask(attention_mask, batch=b, query_len=nq, key_len=nk,
                            is_causal=is_causal, advice=advice,
                            all_real_as_none=all_real_padding_as_none(spec),
                            name_padded_queries=_NAME_PADDED_TOKENS)
    # after the mask is taken: a mask refused (a static cache's slots) says it all; a
    # one-query step of a method whose queries are independent is its causal output
    if nq < nk and not layer.cross and decoding is None \
            and not (nq == 1 and spec.capabilities.independent_queries) \
            and not torch.compiler.is_compiling():
        _warn_steps_over_transformers_cache(layer)
    bound = layer.bound.replace(
        **_call_options(spec, layer, scaling, head_dim, resolved.causal, where))
    # softmax, which drops probabilities as the model was trained, took the any-mask path
    training_dropout = float(dropout) if module.training and dropout else 0.0
    key, value = _keys_for_call(module, key, value)
    key_padding_mask = resolved.key_padding_mask
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(query.device)
    try:
        spec.check_call(query, key, key_padding_mask)
    except CapabilityError as err:
        raise CapabilityError(f"{where}: {err}") from None

    out, maps = call_maybe_with_weights(
        bound, query, key, value, weights, key_padding_mask=key_padding_mask,
        # a decoder's queries in cross-attention are all real, also when Nq == Nk
        query_padding_mask=None if layer.cross else "auto",
        generator=_layer_key(layer, query.device), state=module._modules.get(STATE_NAME),
    )  # [B, H, Nq, Dv], [B, H, Nq, Nk] or None
    if training_dropout:
        out = F.dropout(out, p=training_dropout, training=True)
    return out.transpose(1, 2).contiguous(), maps


def _attentions_requested(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the model's caller asked for attention maps: ``output_attentions=True``
    passed down to the attention call (BERT), transformers' output recorder collecting
    them (GPT-2 and Llama drop the flag and read the attention modules' second output),
    or the module's own argument (Falcon's; ``maps_flag``)."""
    if kwargs.get("output_attentions") or maps_asked(module):
        return True
    if _COLLECTOR is None or (torch.compiler.is_compiling()
                              and not getattr(_COLLECTOR, "compiling", False)):
        # Dynamo cannot trace a ContextVar's get: compiled, the recorder is read where
        # transformers set it while compiling (its global), which a model without the
        # recorder (Falcon) never does
        return False
    collecting = _COLLECTOR.get()
    return isinstance(collecting, dict) and any(
        str(key).endswith("attentions") for key in collecting)


def _refuse_what_the_layer_cannot_apply(module: nn.Module, layer: LayerAttention,
                                         kwargs: dict[str, Any]) -> None:
    """A sentence for a keyword argument that changes what the layer would compute and
    it cannot apply: ``_REFUSED_KWARGS`` in every layer (exact ones run transformers'
    SDPA attention, which cannot either), ``_IN_THE_MASK`` too for a method that takes
    no attn_mask."""
    exact = layer.method == EXACT
    takes_any_mask = exact or (layer.bound is not None
                               and layer.bound.method.capabilities.attn_mask)
    refused = _REFUSED_KWARGS if takes_any_mask else {**_REFUSED_KWARGS, **_IN_THE_MASK}
    for name, what in refused.items():
        if kwargs.get(name) is None:
            continue
        if exact:
            cannot = f"{SDPA_HERE} cannot apply; {USE_ITS_OWN}"
        elif name in _REFUSED_KWARGS:
            cannot = f"{layer.method} cannot apply, nor can {SDPA_HERE}; {USE_ITS_OWN}"
        else:
            cannot = f"{layer.method} cannot apply; keep exact attention in this layer"
        raise CapabilityError(
            f"{_where(module, layer)}: the model asks for {what} ({name}=...), which {cannot}.")


# The call from which transformers builds the block mask of packed position_ids.
_BLOCK_MASK_CALL = "use_cache=False and no attention_mask"


def _refuse_packing_outside_the_mask(module: nn.Module, layer: LayerAttention,
                                     attention_mask: Tensor | None, query: Tensor,
                                     kwargs: dict[str, Any]) -> None:
    """A sentence for packed sequences that no mask keeps apart (``attention_mask`` None):
    ``position_ids`` ``[B, Nq]`` that restart (transformers builds their block mask only
    without a cache and without an ``attention_mask`` of the caller's: an all-real one,
    which its builder drops, arrives here as None too) or ``cu_seq_lens_q`` of more than
    one sequence (FlashAttention's kwargs, read by no mask); the method would attend
    across their boundaries. A host read: eager calls only (under ``torch.compile``
    transformers builds the block mask whenever the position ids are given without a
    cache)."""
    if attention_mask is not None:
        return
    positions, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    what = None
    if isinstance(cu, Tensor) and cu.dim() == 1 and cu.numel() > 2:
        what = "cu_seq_lens_q holds more than one sequence"
        fix = ("pass position_ids restarting at 0 too (DataCollatorWithFlattening's "
               f"return_position_ids=True) with {_BLOCK_MASK_CALL}, from which transformers "
               "builds the mask")
    elif isinstance(positions, Tensor) and positions.dim() == 2 \
            and positions.shape[-1] == query.shape[2] > 1 and may_read_values(positions) \
            and bool((positions.diff(dim=-1) != 1).any()):
        what = "the position_ids restart at 0 or jump"
        fix = (f"call the model with {_BLOCK_MASK_CALL}: transformers builds the mask that "
               "keeps packed sequences apart only without a cache and without a mask of the "
               "caller's (an all-real attention_mask reads as one sequence)")
    if what is None:
        return
    assert layer.bound is not None
    also = ("" if layer.bound.method.capabilities.attn_mask else
            f"; {layer.method} then refuses that mask, so keep exact attention in this layer "
            f"for packed sequences")
    raise UnsupportedMaskError(
        f"{_where(module, layer)}: {what} (packed sequences), but no attention mask keeps "
        f"them apart, and {layer.method} would attend across their boundaries; {fix}{also}.")


def _warn_no_weights(layer: LayerAttention, decoding: bool = False) -> None:
    """Say that ``output_attentions=True`` gets no attention maps from this layer: its
    method has none, or it decodes over a ``DecodingCache``."""
    if decoding:
        why = (f"{layer.method} returns no attention weights in a step over a "
               f"DecodingCache (its decoding state keeps sums over the past keys, not "
               f"them), so output_attentions=True gives none for its layers there; a "
               f"forward without the cache gives them")
    else:
        why = (f"{layer.method} returns no attention weights (its output is not one matrix "
               f"of the queries and keys applied to the values), so output_attentions=True "
               f"gives none for its layers; methods that give them: "
               f"{', '.join(methods_that_can('weights'))}")
    warnings.warn(f"{why}; to read softmax's maps, load the model with "
                  f"attn_implementation='eager'.", UserWarning, stacklevel=2)


def _warn_steps_over_transformers_cache(layer: LayerAttention) -> None:
    """Say (once: one text, one place) that a step over transformers' own key/value
    cache is not the causal forward's approximation (docs/causal.md)."""
    warnings.warn(
        f"{layer.method} decodes over transformers' own key/value cache here: each new "
        f"query attends with the method's non-causal form over the cached keys, not the "
        f"approximation of the causal forward the model ran on its prompt, so generate() "
        f"picks other tokens than a forward over the whole sequence would; pass "
        f"cache=skyformer.hf.DecodingCache(model) to generate() to decode the causal "
        f"forward (docs/causal.md).", UserWarning, stacklevel=2)


def _decoding_step(module: nn.Module, layer: LayerAttention, decoding: DecodingLayer,
                   query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   dropout: float, scaling: float | None) -> tuple[Tensor, None]:
    """The next positions of a ``DecodingCache`` layer: its decoding state's step, with
    dropout on its output in training (as the call without a cache)."""
    assert layer.bound is not None
    where = _where(module, layer)
    b, _, n, head_dim = query.shape
    key_valid = decoding.once_per_step("key_valid", attention_mask, n, lambda: (
        decoding_key_valid(attention_mask, batch=b, new=n, total=decoding.seen,
                           past_valid=decoding.past_valid(), advice=USE_SDPA)))
    if decoding.state is None:
        bound = layer.bound.replace(
            **_call_options(layer.bound.method, layer, scaling, head_dim, True, where))
        try:
            decoding.state = new_decoding_state(
                bound, generator=_layer_key(layer, query.device),
                state=module._modules.get(STATE_NAME))
        except CapabilityError as err:
            raise CapabilityError(f"{where}: {err}") from None
        decoding.state.restart_advice = "DecodingCache(model), or cache.reset()"
    key, value = _keys_for_call(module, key, value)
    if key_valid is not None:
        key_valid = key_valid.to(query.device)
    out = decoding.step(query, key, value, key_valid)  # [B, H, n, Dv]
    if module.training and dropout:
        out = F.dropout(out, p=float(dropout), training=True)
    return out.transpose(1, 2).contiguous(), None


# How a model's caller names its padded tokens, where a refused 4-D mask looks like
# one that hides their queries or opens them to every key (masks.NAME_PADDED_QUERIES).
_NAME_PADDED_TOKENS = ("pass the model the 2-D padding mask [B, N] (1 = real token) as "
                       "attention_mask instead, from which transformers builds its masks")


def _layer_key(layer: LayerAttention, device: torch.device) -> Tensor | None:
    """The random key of a layer with a seed (a tensor: compile-friendly), else None.
    Traced (``torch.export``, ``torch.compile``) it is made afresh: a tracer runs this
    code on fake tensors, which the cache would keep and give to later eager calls."""
    if layer.seed is None:
        return None
    seed = layer_seed(layer.seed, layer)
    return random_key(seed, device) if torch.compiler.is_compiling() else _seed_key(seed, device)


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int, device: torch.device) -> Tensor:
    """``random_key(seed)`` on ``device``, made once: the key is hashed on the host and
    moved, and on a GPU that copy waits for the queued work, so every forward after the
    first reuses it. Callers derive new keys from it and never write into it."""
    return random_key(seed, device)


def _with_attn_mask(
    module: nn.Module, layer: LayerAttention, where: str, query: Tensor, key: Tensor,
    value: Tensor, attention_mask: Tensor | None, dropout: float, scaling: float | None,
    is_causal: bool, position_bias: Tensor | None, weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """A method that takes any attn_mask gets the model's mask as SDPA would: sliding
    windows, packed sequences and static caches are in the mask; a position bias (T5)
    is added to it; without a mask, causal attention follows ``is_causal``. With
    ``weights``, the attention maps of the call too."""
    assert layer.bound is not None
    spec = layer.bound.method
    key, value = _keys_for_call(module, key, value)
    nq, nk = query.shape[2], key.shape[2]
    causal = attention_mask is None and causal_without_mask(is_causal, nq, nk)
    if causal and nk > nq:  # an empty static cache at prefill: the rest are unwritten
        key, value = key[:, :, :nq], value[:, :, :nq]
        position_bias = None if position_bias is None else position_bias[..., :nq]
        nk = nq
    if position_bias is not None:
        attention_mask = _biased_mask(position_bias, attention_mask, causal, nq, nk)
        causal = False
    if attention_mask is not None:
        attention_mask = attention_mask.to(query.device)
    bound = layer.bound.replace(
        **_call_options(spec, layer, scaling, query.shape[-1], causal, where))
    training_dropout = float(dropout) if module.training and dropout else 0.0
    arguments: dict[str, Any] = {}
    if training_dropout and spec.capabilities.weight_dropout:
        arguments["dropout_p"] = training_dropout
    out, maps = call_maybe_with_weights(
        bound, query, key, value, weights, attn_mask=attention_mask, query_padding_mask=None,
        generator=_layer_key(layer, query.device), state=module._modules.get(STATE_NAME),
        **arguments)  # [B, H, Nq, Dv]
    if training_dropout and not spec.capabilities.weight_dropout:
        out = F.dropout(out, p=training_dropout, training=True)
    return out.transpose(1, 2).contiguous(), maps


def _biased_mask(bias: Tensor, mask: Tensor | None, causal: bool, nq: int, nk: int) -> Tensor:
    """A position bias ``[B or 1, H, Nq, Nk]`` with the mask (bool or additive) or the
    causal pattern added: one additive mask."""
    blocked = torch.finfo(bias.dtype).min
    if mask is not None:
        mask = mask.to(bias.device)
        zero = torch.zeros((), dtype=bias.dtype, device=bias.device)
        add = torch.where(mask, zero, blocked) if mask.dtype == torch.bool \
            else mask.to(bias.dtype)
        return bias + add
    if causal:
        tril = torch.ones(nq, nk, dtype=torch.bool, device=bias.device).tril()
        return bias.masked_fill(~tril, blocked)
    return bias


def skyformer_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = bidirectional_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_bidirectional_skip: bool = False,
    **kwargs: Any,
) -> Tensor | None:
    """transformers mask builder: padding-only masks as ``[B, 1, Nq, Nk]`` bool, the key
    padding expanded over the queries with stride 0 (O(N) memory; ``None`` without
    padding where a skip is allowed), every other pattern as transformers' SDPA mask.
    The shape is transformers': a model may join the mask to another along the keys
    (T5Gemma2 concatenates its self- and cross-attention masks)."""
    if (
        mask_function is bidirectional_mask_function
        and local_size is None
        and isinstance(attention_mask, Tensor)
        and attention_mask.dim() == 2
    ):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        if allow_is_bidirectional_skip and not torch.compiler.is_compiling() \
                and bool(padding.all()):  # a traced call keeps the mask (no data guard)
            return None
        return padding[:, None, None, :].expand(-1, 1, q_length, -1)
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
        local_size=local_size, allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs,
    )


@functools.cache
def _function(implementation: str, default_method: str
              ) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The function registered as ``implementation``: one object a name, so that
    registering again (each ``set_attention``) leaves transformers' registry as it was
    (compiled models guard on what they looked up there)."""
    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        return skyformer_attention_forward(
            implementation, default_method, module, query, key, value, attention_mask, **kwargs
        )

    attention_forward.__name__ = f"skyformer_{default_method}_attention_forward"
    attention_forward.__qualname__ = attention_forward.__name__
    return attention_forward


def register_methods() -> list[str]:
    """Register ``"skyformer:<method>"`` for every registered method, and ``"skyformer"``
    (each layer runs its own setting, exact by default), with transformers' attention-
    function and mask registries. Idempotent; call again after registering a new method.

    Returns:
        the registered names.
    """
    names = {PER_LAYER: EXACT, **{implementation_name(m): m for m in list_methods()}}
    for name, method in names.items():
        AttentionInterface.register(name, _function(name, method))
        AttentionMaskInterface.register(name, skyformer_mask)
    return list(names)


def refuse_models_with_their_own_attention() -> None:
    """Make building a model (``from_pretrained``, ``from_config``, its class) with a
    skyformer ``attn_implementation`` fail with a sentence where the model computes
    attention in its own code (Bloom, MPT, DeBERTa, MPNet, GPT-Neo): transformers
    accepts any registered name there, and such a model would run its own attention
    under a config naming the method. Which models: those transformers itself does not
    let ``set_attn_implementation`` switch (``_can_set_attn_implementation``: no module
    of theirs calls ``ALL_ATTENTION_FUNCTIONS``). Idempotent."""
    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "_skyformer_checked", False):
        return  # a transformers without this hook: models are checked at set_attention

    @functools.wraps(check)
    def checked(self, attn_implementation, *args, **kwargs):
        _refuse_own_attention(type(self), attn_implementation)
        return check(self, attn_implementation, *args, **kwargs)

    checked._skyformer_checked = True
    PreTrainedModel._check_and_adjust_attn_implementation = checked


def _refuse_own_attention(cls: type, implementation: object) -> None:
    """Raise the sentence of ``refuse_models_with_their_own_attention`` for a model class
    ``cls`` asked to run ``implementation``, where it would ignore it."""
    if not isinstance(implementation, str) or not is_skyformer_implementation(implementation):
        return
    can_switch = getattr(cls, "_can_set_attn_implementation", None)
    if can_switch is None or can_switch():
        return
    raise ValueError(
        f"{cls.__name__} computes attention in its own code, not through transformers' "
        f"AttentionInterface, so it would ignore attn_implementation={implementation!r} "
        f"and run its own attention; skyformer.hf cannot change this model's attention: "
        f"load it with attn_implementation='eager'. {DISPATCHING_MODELS}"
    )
