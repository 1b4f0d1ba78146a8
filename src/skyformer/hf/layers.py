"""Per-layer attention settings of a Hugging Face model.

Every attention module that dispatches through transformers' ``AttentionInterface``
(BERT/RoBERTa/MiniLM self- and cross-attention, ViT, Llama-type decoders, ...) can carry
a ``LayerAttention``: the method it runs, the method's resolved config, the seed of its
randomness and, for methods with learned or kept parameters, a ``skyformer_state``
submodule. Settings are made and checked here, before any forward pass, so that a
method that cannot serve a layer (a decoder layer needs causal masking, a model with
its own logit scale needs a ``scale`` option, ...) fails when it is chosen.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..registry import (
    BoundMethod,
    CapabilityError,
    Method,
    check_capabilities,
    get_method,
    list_methods,
    methods_taking,
    methods_that_can,
)
from ..registry.methods import did_you_mean
from ..registry.variants import is_variant
from ..seeds import SEED_LIMIT, check_seed
from .maps_flag import follow_maps_flag

EXACT = "exact"  # run transformers' own SDPA attention in this layer
STATE_NAME = "skyformer_state"  # submodule holding a method's per-layer parameters
SETTING_NAME = "skyformer_layer"  # attribute holding a module's LayerAttention

_CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")
# Which models a skyformer method can serve, ending the sentences that refuse a model.
DISPATCHING_MODELS = (
    "Models that dispatch so include BERT, RoBERTa, XLM-R, ELECTRA, ALBERT, DistilBERT, "
    "ViT, CLIP, SigLIP, GPT-2, GPT-J, OPT, Llama, Mistral, Qwen2, Gemma, Phi, Falcon, "
    "StableLM, BART, Marian, T5 and Whisper (docs/hf.md lists the architectures tested)."
)


@dataclass(frozen=True)
class LayerAttention:
    """What one attention module runs.

    method: a registered method name, or ``"exact"`` (transformers' SDPA attention).
    bound: the method bound with its options (``None`` for exact).
    explicit: option names the user set (they take precedence over the model's values,
        e.g. a user-given ``scale`` over the model's ``scaling``).
    seed: ``None`` = randomised methods draw from torch's global generator (fresh draws
        every call, as in training); an int = every call draws from a generator seeded
        with ``layer_seed`` = (seed + position) mod 2^64 (the same input gives the same
        output), and the per-layer state is initialised under that seed too.
    index: the layer number (``module.layer_idx`` or the module's position in the model;
        ``None`` for a module set up during a forward pass without a ``layer_idx``).
    implementation: the ``attn_implementation`` name this setting was made for; it is
        ignored once the model is switched to another implementation.
    cross: the module attends from one sequence to another (cross-attention).
    position: the module's position among the model's attention modules
        (``attention_modules``, model order), which a seed is offset by: unlike ``index``,
        it differs between an encoder-decoder's encoder layer i, decoder self-attention i
        and cross-attention i, so these draw apart (``None``: as ``index``).
    """

    method: str
    bound: BoundMethod | None
    explicit: tuple[str, ...]
    seed: int | None
    index: int | None
    implementation: str
    cross: bool
    position: int | None = None

    @property
    def config(self) -> Any:
        """The method's frozen config (``None`` for exact)."""
        return None if self.bound is None else self.bound.config

    def options(self) -> dict[str, Any]:
        return {} if self.bound is None else self.bound.options()

    def describe(self) -> dict[str, Any]:
        return {"layer": self.index, "method": self.method, "options": self.options(),
                "seed": self.seed}


def attention_modules(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """``(layer index, qualified name, module)`` of every attention module of ``model``
    that dispatches through transformers' attention-function registry, in model order.

    The index is the module's ``layer_idx`` when every such module has one (a decoder's
    self- and cross-attention of one block share it), else its position in this list.
    """
    found = [(name, m) for name, m in model.named_modules() if _dispatches(m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module that dispatches through "
            f"transformers' AttentionInterface (modules with config, scaling and is_causal "
            f"that call ALL_ATTENTION_FUNCTIONS); skyformer.hf cannot change its attention. "
            f"{DISPATCHING_MODELS}"
        )
    indices = [getattr(m, "layer_idx", None) for _, m in found]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        indices = list(range(len(found)))
    return [(i, name, m) for i, (name, m) in zip(indices, found, strict=True)]


def _dispatches(module: nn.Module) -> bool:
    """Whether the module calls transformers' attention-function registry: its forward
    names ``ALL_ATTENTION_FUNCTIONS`` (CLIP, SigLIP, ModernBERT have no ``scaling``
    attribute), or it has the attributes such modules have."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    if "ALL_ATTENTION_FUNCTIONS" in _forward_names(module):
        return True
    return hasattr(module, "is_causal") and hasattr(module, "scaling")


_CAUSAL_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask",
                         "_create_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask")


def causal_scopes(model: nn.Module) -> list[str]:
    """Qualified names of the submodules whose forward builds a causal mask (CLIP's text
    transformer does, while its attention modules say ``is_causal = False``): the
    attention modules below them attend causally."""
    scopes = []
    for name, module in model.named_modules():
        if getattr(module, "is_decoder", None) is False:  # a stack shared with a decoder (T5)
            continue
        if any(b in _forward_names(module) for b in _CAUSAL_MASK_BUILDERS):
            scopes.append(name)
    return scopes


def _forward_names(module: nn.Module) -> tuple[str, ...]:
    """The global and attribute names the module's forward refers to (decorators
    unwrapped)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return () if code is None else code.co_names


def under(name: str, scopes: list[str]) -> bool:
    """Whether module ``name`` is one of ``scopes`` or below one."""
    return any(s == "" or name == s or name.startswith(s + ".") for s in scopes)


def mask_pattern(module: nn.Module) -> str | None:
    """What the module adds to plain (padding, causal) masking, in words, or None: a
    sliding window (Mistral, Qwen2, ModernBERT's local layers), T5's position bias or
    the ALiBi bias Falcon adds to its mask."""
    config = getattr(module, "config", None)
    window = getattr(module, "sliding_window", None) if hasattr(module, "sliding_window") \
        else getattr(config, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool):
        return f"a sliding window of {window} tokens"
    if hasattr(module, "relative_attention_num_buckets"):
        return "an additive relative position bias (T5)"
    if getattr(config, "alibi", None) is True:
        return "an ALiBi position bias (added to its mask)"
    return None


def model_scaling(module: nn.Module) -> float | None:
    """The logit scale the module's attention call passes, if it says: its ``scaling``
    (or CLIP's ``scale``), or 1.0 where its forward multiplies the queries by it itself
    and calls with ``scaling=1.0`` (OPT, Whisper: ``prescales_queries``)."""
    for name in ("scaling", "scale"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return 1.0 if prescales_queries(module) else float(value)
    return None


# prescales_queries' reading, per forward function (weakly: a class or a forward
# replaced later is read anew, and none is kept alive by it)
_PRESCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prescales_queries(module: nn.Module) -> bool:
    """Whether the module's forward (its own, where one is set on the instance) calls
    with the keyword ``scaling=1.0``, having scaled the queries: read from its source
    (comments aside), once per function; False without a source. Under
    ``torch.compile`` a function not read before (at ``set_attention``) reads False,
    and the call's own check of the scale it passes (``attention._call_options``)
    stands."""
    forward = module.__dict__.get("forward", type(module).forward)
    forward = inspect.unwrap(getattr(forward, "__func__", forward))  # a bound method's
    if forward not in _PRESCALES:
        if torch.compiler.is_compiling():
            return False
        _PRESCALES[forward] = _passes_scaling_one(forward)
    return _PRESCALES[forward]


def _passes_scaling_one(function: Any) -> bool:
    """Whether ``function``'s code has a call with the keyword ``scaling=1.0`` (its
    syntax tree: a comment or a string saying so does not count)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.keyword) and node.arg == "scaling"
               and isinstance(node.value, ast.Constant) and node.value.value == 1.0
               and not isinstance(node.value.value, bool)
               for node in ast.walk(tree))


def is_cross_attention(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` attends from one sequence to another (by its flags and names)."""
    if getattr(module, "is_cross_attention", False):
        return True
    if "cross" in type(module).__name__.lower():
        return True
    if getattr(module, "is_decoder", False) and getattr(module, "is_causal", None) is False:
        return True  # a decoder's attention that is not causal: BART's encoder_attn & co.
    return name.rsplit(".", 1)[-1].lower() in _CROSS_NAMES


def heads_and_dim(module: nn.Module) -> tuple[int | None, int | None]:
    """Number of query heads and head dim of an attention module, when it says."""
    config = getattr(module, "config", None)
    heads = (
        getattr(module, "num_attention_heads", None)
        or getattr(module, "num_heads", None)
        or getattr(config, "num_attention_heads", None)
    )
    dim = getattr(module, "attention_head_size", None) or getattr(module, "head_dim", None)
    if dim is None and heads and getattr(config, "hidden_size", None):
        dim = config.hidden_size // heads
    return (int(heads) if heads else None), (int(dim) if dim else None)


def position_limit(module: nn.Module) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings``), if it says:
    fixed-length methods (Linformer) are bound for it."""
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 \
        else None


def first_forward_options(module: nn.Module, method: str) -> dict[str, Any]:
    """The options a layer without a setting runs ``method`` with on the
    ``attn_implementation="skyformer:<method>"`` route, where its first forward pass sets
    it up: the method bound as ``build_layer`` binds it, without options."""
    return get_method(method).bind(seq_len=position_limit(module)).options()


def resolve_method_name(method: str) -> str:
    """``"skyformer:performer"`` or ``"performer"`` -> ``"performer"``; ``"exact"``/``"sdpa"``
    -> ``"exact"``; a variant (``"performer[num_features=64]"``) as it is; unknown names
    fail with the list of known ones."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}.")
    name = method.removeprefix("skyformer:")
    if name in (EXACT, "sdpa"):
        return EXACT
    if is_variant(name):  # "nystrom_softmax[num_features=64]": checked, kept as given
        get_method(name)
        return name
    if name not in list_methods():
        close = did_you_mean(name, [*list_methods(), EXACT])
        raise ValueError(
            f"unknown attention method {method!r}{close}; available: "
            f"{', '.join(list_methods())}, or 'exact' for the model's own attention."
        )
    return name


def refuse_causal_option(spec: Method, explicit: dict[str, Any]) -> None:
    """Fail in a sentence where ``causal`` is given as a keyword or in a variant's name:
    causal masking follows the model."""
    if "causal" in explicit or "causal" in dict(spec.preset):
        raise ValueError(
            f"{spec.name}: do not pass causal; causal masking follows the model (its masks "
            f"and is_causal flags)."
        )


def _check_module(spec: Method, module: nn.Module, index: int | None, cross: bool,
                  explicit: dict[str, Any], causal: bool = False) -> None:
    """Fail now, with a sentence, if ``spec`` cannot serve this module."""
    where = type(module).__name__ if index is None else f"layer {index} ({type(module).__name__})"
    caps = spec.capabilities
    refuse_causal_option(spec, explicit)
    softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    if softcap:  # Gemma-2: refused at the first forward pass by every layer, exact too
        raise CapabilityError(
            f"{where} caps its attention logits (attn_logit_softcapping={softcap}), which no "
            f"skyformer method applies, nor transformers' SDPA attention; run this model "
            f"with its own attention (attn_implementation='eager').")
    if (causal or getattr(module, "is_causal", False)) and not cross and not caps.causal:
        raise CapabilityError(
            f"{where} uses causal attention (a decoder), and {spec.name} cannot do causal "
            f"masking; methods that can: "
            f"{', '.join(m for m in list_methods() if get_method(m).capabilities.causal)}."
        )
    if (causal or getattr(module, "is_causal", False)) and not cross and caps.causal:
        try:  # an option no form takes gets its own sentence, not the causal form's
            spec.make_config(**explicit)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        try:  # the options of the causal form the model's masks will ask for
            spec.make_config(**explicit, causal=True)
        except ValueError as err:
            raise ValueError(f"{where} uses causal attention (a decoder), and the causal "
                             f"form of {spec.name} refuses these options: {err}") from None
    if cross:
        check_capabilities(spec.name, cross_attention=True)
    if cross and (causal or attends_from_a_causal_decoder(module)) \
            and not caps.independent_queries:
        able = ", ".join(methods_that_can("independent_queries"))
        raise CapabilityError(
            f"{where} is the cross-attention of a causal decoder, whose later queries are "
            f"later target tokens: {spec.name}'s outputs mix the queries (landmarks, "
            f"clusters or samples drawn from all of them), so in teacher-forced training "
            f"and evaluation a position would see the tokens after it. Methods whose "
            f"outputs use their own query alone: {able}; or set {spec.name} in the "
            f"encoder alone (in an encoder-decoder model: skyformer.hf.set_attention("
            f"model.get_encoder(), {spec.name!r}, ...)).")
    if not caps.attn_mask:
        pattern = mask_pattern(module)
        if pattern is not None:
            raise CapabilityError(
                f"{where} uses {pattern}, which {spec.name} cannot apply (it takes key "
                f"padding and causal masks only); use softmax or kernelized, which take any "
                f"mask, or keep exact attention in the layers that use it "
                f"(skyformer.hf.set_attention(model, {spec.name!r}, layers=[...]) with the "
                f"others, where the model has layers without it)."
            )
    scaling = model_scaling(module)
    _, head_dim = heads_and_dim(module)
    if scaling is not None and head_dim and not is_default_scaling(scaling, head_dim) \
            and "scale" not in spec.option_names():
        decoder = (causal or getattr(module, "is_causal", False)) and not cross
        raise CapabilityError(scaling_sentence(spec.name, scaling, head_dim, decoder)
                              + f" ({where})")
    param = next(module.parameters(), None)
    if param is not None and param.dtype in (torch.float16, torch.bfloat16):
        check_capabilities(spec.name, half_precision=True)


def attends_from_a_causal_decoder(module: nn.Module) -> bool:
    """Whether a cross-attention module's queries come from a causal decoder, as the
    module and its config tell: the decoders of BART, Marian, Whisper and T5 mark their
    attention modules ``is_decoder``, a BERT-type decoder its config (``is_decoder``), a
    decoder-only language model given cross-attention (GPT-2) its config
    (``add_cross_attention``). DETR-type decoders and BLIP-2's Q-Former, whose queries
    are not tokens in order, mark neither. ``set_attention`` also reads the model: a
    cross-attention inside a part that builds causal masks (``causal_scopes``)."""
    config = getattr(module, "config", None)
    return (getattr(module, "is_decoder", None) is True
            or getattr(config, "is_decoder", None) is True
            or getattr(config, "add_cross_attention", None) is True)


def is_default_scaling(scaling: float, head_dim: int) -> bool:
    """Whether a model's logit scale is the 1/sqrt(head dim) every method assumes."""
    return math.isclose(float(scaling), head_dim**-0.5, rel_tol=1e-6)


def scaling_sentence(method: str, scaling: float, head_dim: int, causal: bool = False) -> str:
    """Why ``method`` (no ``scale`` option) cannot serve a module whose attention call
    passes ``scaling``, and the methods that can (causal ones, for a decoder)."""
    causal_ones = methods_that_can("causal")
    having = [m for m in methods_taking("scale") if not causal or m in causal_ones]
    return (
        f"{method} cannot use the model's attention logit scale {float(scaling):.6g} (the "
        f"scale its attention call passes, where 1/sqrt(head dim) = {head_dim**-0.5:.6g}): "
        f"{method} has no scale option; {'causal ' if causal else ''}methods with a scale "
        f"option: {', '.join(having) or 'none'}"
    )


def layer_seed(seed: int, layer: LayerAttention) -> int:
    """The seed of ``layer`` for a model seeded ``seed``: (seed + its position among the
    model's attention modules) mod 2^64, a seed every generator takes
    (``skyformer.seeds``) for any seed ``check_seed`` took."""
    return (seed + seed_offset(layer)) % SEED_LIMIT


def seed_offset(layer: LayerAttention) -> int:
    """What a seed given to ``layer`` is offset by: its position (else its index)."""
    offset = layer.index if layer.position is None else layer.position
    return offset or 0


def check_setting_arguments(method: str, seed: object, options: dict[str, Any]) -> None:
    """The checks a setting's arguments get before any model is touched: a seed in
    [0, 2^64) or None; no options for exact attention (a method's own are checked when
    it is bound)."""
    if seed is not None:
        check_seed("seed", seed)
    if method == EXACT and options:
        raise ValueError(f"exact attention takes no options, got {', '.join(options)}; "
                         f"options belong to the approximate methods (skyformer list).")


def build_layer(
    module: nn.Module, method: str, *, index: int | None, implementation: str, seed: int | None,
    cross: bool, options: dict[str, Any], causal: bool = False, position: int | None = None,
) -> tuple[LayerAttention, nn.Module | None]:
    """Check ``method`` against ``module`` and build its setting and per-layer state
    (``None`` for methods without one). ``causal``: the module is inside a part of the
    model that builds causal masks (``causal_scopes``): a self-attention module there
    attends causally although its ``is_causal`` flag may say no, and a cross-attention
    module attends from a causal decoder's tokens. Changes nothing: see
    ``install_layer``. ``position``: see ``LayerAttention``."""
    check_setting_arguments(method, seed, options)
    if method == EXACT:
        return LayerAttention(EXACT, None, (), seed, index, implementation, cross,
                              position), None
    spec = get_method(method)
    _check_module(spec, module, index, cross, options, causal)
    heads, head_dim = heads_and_dim(module)
    bound = spec.bind(heads, head_dim, seq_len=position_limit(module), **options)
    explicit = tuple(sorted(options))
    layer = LayerAttention(method, bound, explicit, seed, index, implementation, cross,
                           position)
    if spec.state is None:
        return layer, None
    if heads is None or head_dim is None:
        raise ValueError(
            f"{method} keeps per-layer parameters, but the number of heads and the head dim "
            f"of {type(module).__name__} are unknown (no num_attention_heads/head_dim "
            f"attributes)."
        )
    return layer, new_state(module, layer)


def new_state(module: nn.Module, layer: LayerAttention) -> nn.Module:
    """The layer's state on the module's device and dtype. Made of ordinary tensors
    also where the first forward pass runs under ``torch.inference_mode()`` (the
    ``attn_implementation`` route makes it there): inference tensors could never be
    trained nor updated in place (Performer's redraws) outside that mode."""
    with torch.inference_mode(False), torch.no_grad():
        # the seed also fixes the state's initialisation (projections, feature seeds)
        seed = None if layer.seed is None else layer_seed(layer.seed, layer)
        state = layer.bound.new_state(seed=seed)
        param = next(module.parameters(), None)
        if param is not None:
            state = state.to(device=param.device, dtype=param.dtype)
    return state


def install_layer(module: nn.Module, layer: LayerAttention, state: nn.Module | None) -> None:
    """Attach a setting (and its state, as the submodule ``skyformer_state``) to ``module``."""
    remove_state(module)
    if state is not None:
        module.add_module(STATE_NAME, state)
    module.__dict__[SETTING_NAME] = layer
    follow_maps_flag(module)  # Falcon's output_attentions, which its module keeps


def make_layer(module: nn.Module, method: str, **kwargs: Any) -> LayerAttention:
    """``build_layer`` then ``install_layer``; returns the setting."""
    layer, state = build_layer(module, method, **kwargs)
    install_layer(module, layer, state)
    return layer


def remove_state(module: nn.Module) -> None:
    if STATE_NAME in module._modules:
        del module._modules[STATE_NAME]


def clear_layer(module: nn.Module) -> None:
    """Remove a module's setting and state (it runs whatever its config names)."""
    module.__dict__.pop(SETTING_NAME, None)
    remove_state(module)


def current_layer(module: nn.Module) -> LayerAttention | None:
    return module.__dict__.get(SETTING_NAME)
