"""Choosing a model's attention: all layers or some, with options, and back to exact.

Three ways in, one state:

- ``AutoModel.from_pretrained(path, attn_implementation="skyformer:<method>")`` or
  ``model.set_attn_implementation("skyformer:<method>")``: every attention layer runs the
  method with its default options (capabilities are checked at the first forward pass);
- ``set_attention(model, method, layers=None, seed=None, **options)``: the documented
  route for options and per-layer choice; checks every chosen layer at once;
- ``from_pretrained(path, method, ...)`` (``loading.py``): both in one call, so a method
  that cannot serve the model (e.g. a decoder and a method without causal masking) fails
  at load.

``restore_exact(model)`` returns the model to the implementation it had before.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from ..ops.shared.causal_nystrom import (
    CAUSAL_FORM_DEFAULTS,
    CausalNystromOptions,
    refuse_causal_form_options,
)
from ..registry import get_method
from ..registry.methods import refuse_misnamed_arguments, refuse_misspelt_arguments
from ..registry.variants import is_variant
from .attention import (
    PER_LAYER,
    PREFIX,
    implementation_name,
    is_skyformer_implementation,
    note_set_config,
    register_methods,
)
from .layers import (
    EXACT,
    SETTING_NAME,
    attention_modules,
    build_layer,
    causal_scopes,
    check_setting_arguments,
    clear_layer,
    current_layer,
    first_forward_options,
    heads_and_dim,
    install_layer,
    is_cross_attention,
    is_default_scaling,
    model_scaling,
    resolve_method_name,
    under,
)

ModelT = TypeVar("ModelT", bound=nn.Module)  # the model given is the model returned

_ORIGINAL = "_skyformer_original_attn_implementation"
KEEP_STATE = object()  # marks a layer whose setting is re-stamped and whose state is kept


def _implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        load = (" To load a saved model with a method, call skyformer.hf.from_pretrained"
                "(path, method)." if isinstance(model, (str, os.PathLike)) else "")
        raise TypeError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__} (no "
            f"config._attn_implementation).{load}"
        )
    return config._attn_implementation


def _select(model: nn.Module, layers: Iterable[int] | None) -> tuple[list, set[int] | None]:
    modules = attention_modules(model)
    if layers is None:
        return modules, None
    valid = sorted({i for i, _, _ in modules})
    numbers = f"layer numbers of this model ({valid[0]}..{valid[-1]})"
    if isinstance(layers, torch.Tensor):  # a tensor of numbers, or one number
        layers = layers.tolist()
    if not isinstance(layers, bool) and _as_int(layers) is not None:
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None (every layer), a layer number or a list of "
                        f"{numbers}, got {type(layers).__name__}.")
    chosen = set()
    for given in layers:
        i = None if isinstance(given, bool) else _as_int(given)
        if i not in valid:
            raise ValueError(f"layers must be {numbers}, got {given!r}.")
        chosen.add(i)
    if not chosen:
        raise ValueError(f"layers is empty, so no layer would change; pass {numbers}, or "
                         f"None for every layer.")
    return modules, chosen


def _as_int(value: object) -> int | None:
    """An integer given as a Python, NumPy or 0-d tensor integer, else ``None``."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_layers(model: nn.Module, layers: Iterable[int] | int | None) -> None:
    """Raise ``set_attention``'s sentence for layer numbers ``model`` does not have."""
    _select(model, layers)


def set_attention(
    model: ModelT,
    method: str,
    *,
    layers: Iterable[int] | int | None = None,
    seed: int | None = None,
    **options: Any,
) -> ModelT:
    """Make ``layers`` of a transformers model run attention ``method`` with ``options``.

    Args:
        model: a ``PreTrainedModel`` whose attention dispatches through transformers'
            ``AttentionInterface`` (BERT/RoBERTa/MiniLM, ViT, Llama-type, ...).
        method: a name from ``skyformer.list_methods()`` (``"skyformer:"`` prefix allowed),
            or ``"exact"`` for the model's own (SDPA) attention.
        layers: a layer number or several (``module.layer_idx``, or the position among
            the model's attention modules; Python, NumPy or tensor integers), at least
            one; ``None`` = every layer. Layers not listed keep what they
            run now.
        seed: ``None``: randomised methods draw from torch's global generator on every
            call; an int: the i-th attention module in model order (layer i where each layer
            has one) draws from a generator seeded (seed + i) mod 2^64 on every call and
            initialises its per-layer state under that seed (deterministic outputs; from a
            generator of its own: torch's global one is neither read nor changed). An
            encoder-decoder's encoder layer i, decoder self-attention i and cross-attention
            i are different modules and draw apart; positions count within ``model``, so
            parts set one call each need seeds far apart.
        **options: the method's options (``skyformer list``); options the model fixes
            (``max_seq_len`` from ``max_position_embeddings``) are filled in, ``causal``
            follows the model and the model's logit ``scaling`` is passed as ``scale``
            unless given here.
    Returns:
        ``model`` (changed in place).
    Raises:
        ValueError / CapabilityError: unknown method, layer or option, or a method that
            cannot serve a chosen layer (causal decoder layers, cross-attention, a logit
            scale other than 1/sqrt(head dim) without a ``scale`` option, half precision).
    """
    register_methods()  # methods registered after ``import skyformer.hf`` get a name too
    name = resolve_method_name(method)
    # layer=, seeds=: this function's argument, not the method's option
    if name == EXACT:
        refuse_misspelt_arguments(options, "skyformer.hf.set_attention", set_attention)
    else:
        refuse_misnamed_arguments(get_method(name), options, "skyformer.hf.set_attention",
                                  set_attention)
    check_setting_arguments(name, seed, options)  # also where no layer is built (exact)
    current = _implementation(model)
    _refuse_inner_module(model)
    modules, chosen = _select(model, layers)
    if not is_skyformer_implementation(current):
        model.__dict__[_ORIGINAL] = current
    # a variant has no implementation name of its own, and the other part of an
    # encoder-decoder would run one too: each layer holds its setting
    one_part = _one_part(model, modules)
    whole = chosen is None and name != EXACT and not is_variant(name) and not one_part
    target = implementation_name(name) if whole else PER_LAYER
    if one_part and is_skyformer_implementation(current):
        # the other part reads the same config: under "skyformer:<m>" its layers run <m>
        # (set up at their first forward pass), and under another name they would run
        # exact attention, so the name stays and this part's settings are made for it
        target = current
    if chosen is None and name == EXACT:
        return restore_exact(model)

    # Build and check every setting before changing anything.
    built = []
    scopes = causal_scopes(model)
    causal_layers = 0  # of those that run ``name``: where the causal form's options act
    for position, (index, qualified, module) in enumerate(modules):
        cross = is_cross_attention(module, qualified)
        old = current_layer(module)
        runs = _runs(module)  # T5's encoder and decoder hold copies of the config
        if chosen is None or index in chosen:
            plan = (name, options, seed)
            causal_layers += not cross and (under(qualified, scopes)
                                            or bool(getattr(module, "is_causal", False)))
        elif old is not None and old.implementation == runs:
            # Unchanged layer: keep its setting and its state (learned parameters).
            built.append((module, dataclasses.replace(old, implementation=target), KEEP_STATE))
            continue
        elif is_skyformer_implementation(runs) and runs != PER_LAYER:
            plan = (runs.removeprefix(PREFIX), {}, None)
        else:
            plan = (EXACT, {}, None)
        layer, state = build_layer(module, plan[0], index=index, implementation=target,
                                   seed=plan[2], cross=cross, options=dict(plan[1]),
                                   causal=under(qualified, scopes), position=position)
        built.append((module, layer, state))
    if not causal_layers:
        _refuse_causal_form_options(name, options)
    _switch(model, target)  # first: where refused, nothing is installed
    if one_part:  # the other part of an encoder-decoder reads the config too
        for config in {id(m.config): m.config for _, _, m in modules}.values():
            note_set_config(config)
    for module, layer, state in built:  # only once every layer has passed its checks
        if state is KEEP_STATE:
            module.__dict__[SETTING_NAME] = layer
        else:
            install_layer(module, layer, state)
    return model


def _refuse_causal_form_options(name: str, options: dict[str, Any]) -> None:
    """A sentence where options of the causal form (``landmark_stride``,
    ``causal_local``) are set for layers none of which is causal: every call would take
    their defaults (an encoder's), as the other entry points refuse them."""
    if name == EXACT:
        return
    config = get_method(name).make_config(**options)
    if isinstance(config, CausalNystromOptions):
        refuse_causal_form_options(name, config, way_out=None, not_causal=(
            "no layer set here is causal (an encoder's self-attention)"))


def _runs(module: nn.Module) -> str | None:
    """The implementation an attention module dispatches on: its own config's, which is
    the model's except in a part holding a copy (T5's encoder and decoder stacks)."""
    return module.config._attn_implementation


def _one_part(model: nn.Module, modules: list) -> bool:
    """Whether ``model`` is the encoder or the decoder of an encoder-decoder model (BART's
    or Whisper's ``get_encoder()``), whose config the other part reads too: switching
    that config to ``"skyformer:<method>"`` would run the method in the other part's
    layers as well, with default options. Whole models hold an encoder's self-attention
    (neither cross-attention nor causal) and cross-attention."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    cross = [is_cross_attention(module, qualified) for _, qualified, module in modules]
    encoder = any(not c and not getattr(module, "is_causal", False)
                  for c, (_, _, module) in zip(cross, modules, strict=True))
    return not (any(cross) and encoder)


def _with_model_scale(module: nn.Module, method: str, options: dict[str, Any],
                      explicit: Iterable[str]) -> dict[str, Any]:
    """``options`` with the logit scale each call passes (``attention._call_options``):
    the model's own where it is not 1/sqrt(head dim) (OPT's prescaled queries: 1.0) and
    neither the user nor the variant set one."""
    if options.get("scale") is not None or "scale" not in options or "scale" in explicit:
        return options
    scaling, (_, head_dim) = model_scaling(module), heads_and_dim(module)
    if scaling is None or head_dim is None or is_default_scaling(scaling, head_dim) \
            or "scale" in dict(get_method(method).preset):
        return options
    return {**options, "scale": float(scaling)}


def _refuse_inner_module(model: nn.Module) -> None:
    """A sentence for a module inside a model that holds its config but cannot switch
    its attention (BERT's ``model.encoder``): the switch failed with an AttributeError
    after a key was left on it."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(
            f"{type(model).__name__} holds a transformers config but is no model whose "
            f"attention can be switched (it has no set_attn_implementation); pass the "
            f"whole model, with layers=[...] for some of its layers (or an encoder-decoder's "
            f"model.get_encoder() / get_decoder()).")


def _switch(model: nn.Module, implementation: str) -> None:
    model.set_attn_implementation(implementation)
    if _implementation(model) != implementation:
        raise ValueError(
            f"{type(model).__name__} did not accept attn_implementation={implementation!r} "
            f"(transformers lets only models whose attention calls ALL_ATTENTION_FUNCTIONS "
            f"change it); skyformer.hf cannot change this model's attention."
        )


def restore_exact(model: ModelT, *, layers: Iterable[int] | int | None = None) -> ModelT:
    """Return ``layers`` (default: all) to the model's own attention.

    With ``layers=None`` every setting and per-layer state is removed and the model gets
    back the implementation it had before ``set_attention`` (``"sdpa"`` if it was loaded
    with a skyformer implementation). One part of an encoder-decoder model (its
    ``get_encoder()``) running a skyformer method returns to exact attention alone: the
    other part, which reads the same config, keeps what it runs.
    """
    if layers is not None:
        return set_attention(model, EXACT, layers=layers)
    current = _implementation(model)
    _refuse_inner_module(model)  # before any layer is cleared
    modules = attention_modules(model)
    if is_skyformer_implementation(current) and _one_part(model, modules):
        # the other part keeps what it runs (set_attention keeps the implementation)
        return set_attention(model, EXACT, layers=sorted({i for i, _, _ in modules}))
    for _, _, module in modules:
        clear_layer(module)
    original = model.__dict__.pop(_ORIGINAL, None) or current
    _switch(model, original if original and not is_skyformer_implementation(original) else "sdpa")
    return model


def describe(model: nn.Module) -> list[dict[str, Any]]:
    """What every attention layer of ``model`` runs: layer, module, method, options (a
    dict; a layer set up at its first forward pass gives the options it will run;
    ``causal`` as the module declares it, ``is_causal``, for each call follows the
    model's mask: True in a decoder's self-attention), seed."""
    _implementation(model)
    rows = []
    for index, qualified, module in attention_modules(model):
        implementation = _runs(module)
        layer = current_layer(module)
        if layer is not None and layer.implementation == implementation:
            method, options, seed = layer.method, layer.options(), layer.seed
            options = _with_model_scale(module, method, options, layer.explicit)
        elif is_skyformer_implementation(implementation) and implementation != PER_LAYER:
            # the attn_implementation route: set up when it runs
            method, seed = implementation.removeprefix(PREFIX), None
            options = _with_model_scale(module, method, first_forward_options(module, method),
                                        ())
        elif implementation == PER_LAYER:
            method, options, seed = EXACT, {}, None
        else:
            method, options, seed = f"{EXACT} ({implementation})", {}, None
        if "causal" in options and isinstance(getattr(module, "is_causal", None), bool):
            # each call takes causal from the model's mask: a decoder's is causal, and the
            # other calls leave the causal form's options out (attention._call_options)
            options = {**options, "causal": module.is_causal}
            if not module.is_causal:
                options.update({name: default for name, default in
                                CAUSAL_FORM_DEFAULTS.items() if name in options})
        rows.append({"layer": index, "module": qualified, "method": method,
                     "options": options, "seed": seed})
    return rows
