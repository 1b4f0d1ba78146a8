"""The one place method names live: name -> (function, config dataclass, capabilities).

Methods register themselves with a decorator next to their implementation, written once
as a core that reads its options from the config::

    @register("skyformer", SkyformerConfig, Capabilities(target="gaussian", randomized=True))
    def skyformer_attention(q, k, v, config: SkyformerConfig, *, key_padding_mask=None,
                            generator=None) -> Tensor: ...

The decorator returns the public function, options as keyword arguments
(``skyformer_attention(q, k, v, num_features=64)``, see ``signature.public_function``).
A function written directly in that public form may be registered too.

Every config is a frozen dataclass whose defaults are the method's documented defaults;
every approximate method has the common option ``num_features``. Capabilities are data;
asking for something a method cannot do fails with a sentence naming the method, the
missing capability and the methods that have it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import numbers
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import check_positive_int
from .autocast import autocast_dtype, in_the_library
from .binding import HALF_DTYPES, TAKES_QUERY_MASK, BoundMethod, takes_keyword
from .capabilities import (
    TARGETS,
    Capabilities,
    CapabilityError,
    Target,
    capability_sentence,
    masks_taken,
)
from .guard import warn_if_no_real_key
from .option_types import accepted_options
from .signature import AttentionFunction, config_fields, core_of, public_function, takes_config
from .variants import base_name, is_variant, parse_variant

StateFactory = Callable[[Any, int, int], "torch.nn.Module"]
_OPTION_NAMES: dict[type, tuple[str, ...]] = {}  # config class -> its option names

# Names ``Method.bind`` takes itself; no method may have an option of that name.
_BIND_ARGUMENTS = ("num_heads", "head_dim", "seq_len")
# The arguments of every call (``attention``, a public function, a bound method): an
# option of one of these names could never be passed.
_CALL_NAMES = ("q", "k", "v", "method", "key_padding_mask", "query_padding_mask",
               "generator", "state")
# Names the integrations give a meaning of their own: skyformer.hf's model attention.
_RESERVED_METHOD_NAMES = ("exact", "sdpa")
# Arguments of torch's scaled_dot_product_attention, which skyformer's takes beside the
# methods' options (a sentence for one given to a method as an option points there).
_SDPA_ARGUMENTS = frozenset({"attn_mask", "dropout_p", "is_causal", "enable_gqa"})
# The exact method of each target: what approximation errors are measured against.
_EXACT = {"softmax": "softmax", "gaussian": "kernelized"}


@dataclass(frozen=True)
class Method:
    """A registered attention method.

    ``function`` is the public function (options as keyword arguments); ``core`` the same
    computation with the options given as one config. ``state``, when set, builds the
    per-layer module a method needs beyond its options (learned projections, random
    features kept between calls): ``state(config, num_heads, head_dim) -> nn.Module``,
    whose ``module(q, k)`` returns a dict of extra keyword arguments for the core. Called
    without them, such methods work (e.g. by drawing them from the generator) or say
    what is missing.

    ``preset``: options a variant sets (``variants.py``: ``get_method`` of
    ``"skyformer[pinv_gradient=implicit]"``); options given to ``bind`` or
    ``make_config`` override them.
    """

    name: str
    function: Callable[..., Tensor]
    config_class: type
    capabilities: Capabilities
    summary: str
    state: StateFactory | None = None
    preset: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # Read once per config class: torch.compile cannot trace dataclasses.fields() of
        # a class, and a variant named inside a compiled function is made there.
        names = _OPTION_NAMES.get(self.config_class)
        if names is None:
            names = tuple(f.name for f in dataclasses.fields(self.config_class))
            _OPTION_NAMES[self.config_class] = names
        object.__setattr__(self, "_option_names", names)

    @property
    def core(self) -> Callable[..., Tensor]:
        """``core(q, k, v, config, *, key_padding_mask, generator, **state_arguments)``."""
        return core_of(self.function)

    @property
    def base_name(self) -> str:
        """The registered name (a variant's without its brackets)."""
        return base_name(self.name)

    def defaults(self) -> dict[str, Any]:
        """Option name -> default value (a variant's: with its options set)."""
        return config_fields(self.config_class(**dict(self.preset)))

    def option_names(self) -> tuple[str, ...]:
        return self._option_names  # type: ignore[attr-defined]

    def budget_changes_output(self) -> bool:
        """Whether ``num_features`` is an option that changes what the method computes:
        what ``compare``/``bench --features`` and ``hf-eval`` ask before passing or
        sweeping it. A config lists options it accepts with no effect in a class
        attribute ``INERT_OPTIONS`` (linear attention takes ``num_features`` so that one
        call fits every method, and is run once, not once per value; ``approx`` keeps its
        flat line as a reference)."""
        return "num_features" in self.option_names() and "num_features" not in getattr(
            self.config_class, "INERT_OPTIONS", ())

    def options_of(self, config: Any) -> dict[str, Any]:
        """Option name -> value of a config of this method."""
        return config_fields(config)

    def make_config(self, **options: Any) -> Any:
        """Build the frozen config, rejecting unknown options with the list of known ones."""
        options = {**dict(self.preset), **options}
        unknown = sorted(set(options) - set(self.option_names()))
        if options.get("causal") is True and not self.capabilities.causal:
            # an unknown option, or one the config has while the capability says no
            raise CapabilityError(_capability_sentence(self.name, "causal"))
        if unknown:
            known = ", ".join(self.option_names()) or "none"
            sdpa = sorted(set(unknown) & _SDPA_ARGUMENTS)
            # where each unknown name goes, in one parenthesis: SDPA's entry, and the
            # method's own call where it takes the name (softmax's attn_mask: both)
            hints = ([f"{', '.join(sdpa)}: skyformer.scaled_dot_product_attention takes "
                      f"torch's SDPA arguments"] if sdpa else [])
            hints += self._call_argument_hints(unknown)
            hint = f" ({'; '.join(hints)})" if hints else ""
            # an option the method takes and ignores is no suggestion (linear's budget)
            inert = getattr(self.config_class, "INERT_OPTIONS", ())
            close = (option_suggestion(unknown[0], [name for name in self.option_names()
                                                    if name not in inert])
                     if len(unknown) == 1 else "")
            raise ValueError(
                f"{self.name} has no option {', '.join(map(repr, unknown))}{close}; "
                f"its options are: {known}{hint}."
            )
        options = {name: _python_int(value) for name, value in options.items()}
        if not in_the_library(self.config_class):
            _check_option_types(self.name, self.config_class, options)
            _check_common_knob(self.name, options)
        return self.config_class(**options)

    def _call_argument_hints(self, unknown: list[str]) -> list[str]:
        """Where the unknown names are arguments of every call (``generator``, given to a
        layer or to ``bind``) or of the method's own function (Performer's
        ``projection``, Linformer's ``proj_k``, softmax's ``attn_mask``): how to pass
        them, which options cannot, one hint for each kind."""
        hints = []
        if "attention_mask" in unknown:  # Hugging Face's name: 1 marks a real token
            hints.append("attention_mask: Hugging Face's mask goes to each call as "
                         "key_padding_mask, in the caller's convention: "
                         "(attention_mask == 1) to skyformer's calls and layers, "
                         "(attention_mask == 0) to TorchMultiheadAttention")
        if "seed" in unknown:
            hints.append("seed: pass generator=skyformer.random_key(seed) when calling, "
                         "layer(x, generator=...) or bound(q, k, v, generator=...)")
        per_call = [name for name in unknown
                    if name in _CALL_NAMES and name not in ("q", "k", "v", "method")]
        if per_call:  # given to a layer's constructor or to bind(), as an option
            one = len(per_call) == 1
            given = ", ".join(f"{name}=..." for name in per_call)
            hints.append(f"{', '.join(per_call)}: {'an argument' if one else 'arguments'} of "
                         f"each call, not {'an option' if one else 'options'}: pass "
                         f"{'it' if one else 'them'} when calling, layer(x, {given}) or "
                         f"bound(q, k, v, {given})")
        taken = [name for name in unknown if name in _argument_names(self.function)
                 and name not in _CALL_NAMES]
        if taken:
            given = ", ".join(f"{name}=..." for name in taken)
            ops = sys.modules.get("skyformer.ops")
            function = (f"skyformer.ops.{self.function.__name__}"
                        if getattr(ops, self.function.__name__, None) is self.function
                        else f"{self.function.__module__}.{self.function.__name__}")
            one = len(taken) == 1
            hints.append(f"{', '.join(taken)}: {'an argument' if one else 'arguments'} of "
                         f"the call, not {'an option' if one else 'options'}: pass "
                         f"{'it' if one else 'them'} to {function}(q, k, v, {given}) or to "
                         f"skyformer.get_method({self.base_name!r}).bind()(q, k, v, {given})")
        return hints

    def resolve_options(self, options: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
        """``options`` with the rules of a layer that sees sequences of ``seq_len`` tokens:
        a fixed-length method (Linformer) gets ``max_seq_len=seq_len`` unless it is given,
        in ``options`` or in a variant's name (``"linformer[max_seq_len=64]"``)."""
        resolved = dict(options)
        if (seq_len is not None and self.capabilities.fixed_length
                and "max_seq_len" in self.option_names()
                and {**dict(self.preset), **resolved}.get("max_seq_len") is None):
            resolved["max_seq_len"] = seq_len
        return resolved

    def bind(self, num_heads: int | None = None, head_dim: int | None = None, *,
             seq_len: int | None = None, **options: Any) -> BoundMethod:
        """Validate ``options`` once and return the callable binding (``binding.py``).

        Args:
            num_heads, head_dim: the layer's shape (needed for a per-layer state).
            seq_len: the longest sequence the layer sees (fixed-length methods need it).
            **options: the method's options (see ``skyformer list``).
        """
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                            ("seq_len", seq_len)):
            check_positive_int(f"{self.name}: {name}", value, optional=True)
        config = self.make_config(**self.resolve_options(options, seq_len))
        return BoundMethod(self, config, num_heads, head_dim)

    def check_call(self, q: object, k: object, key_padding_mask: object,
                   config: Any = None) -> None:
        """Fail with a sentence if this call needs a capability the method lacks, or (given
        the call's ``config``) has more keys than a fixed-length method's ``max_seq_len``.
        Inputs that are not ``[B, H, N, D]`` tensors are left to the method's own input
        checks."""
        q_ok = isinstance(q, Tensor) and q.dim() == 4
        k_ok = isinstance(k, Tensor) and k.dim() == 4
        half = q_ok and (q.dtype in HALF_DTYPES  # type: ignore[union-attr]
                         or autocast_dtype(q) in HALF_DTYPES)  # type: ignore[arg-type]
        check_capabilities(
            self.name,
            mask=key_padding_mask is not None,
            cross_attention=q_ok and k_ok and q.shape[2] != k.shape[2],  # type: ignore[union-attr]
            half_precision=half,  # given half, or cast to half by autocast (call_core)
        )
        if config is not None and k_ok:
            self.check_length(config, k.shape[2])  # type: ignore[union-attr]

    def check_length(self, config: Any, keys: object) -> None:
        """A fixed-length method (``Capabilities.fixed_length``) holds one position per key
        up to ``max_seq_len``: more keys fail with a sentence, not inside the method."""
        limit = getattr(config, "max_seq_len", None)
        if self.capabilities.fixed_length and isinstance(limit, int) \
                and isinstance(keys, int) and keys > limit:
            raise CapabilityError(
                f"{self.name}: the input has {keys} keys but max_seq_len={limit}; the method "
                f"holds one position per key up to max_seq_len, so truncate the input or "
                f"give a larger max_seq_len.")


def _check_option_types(method: str, config_class: type, options: dict[str, Any]) -> None:
    """A sentence for an option of a method from outside the library whose value its
    config's annotation excludes (``option_types``; the library's configs check their
    own in ``__post_init__``)."""
    accepted = accepted_options(config_class)
    for name, value in options.items():
        if name in accepted and not accepted[name].takes(value):
            raise TypeError(f"{method}: option {name} must be {accepted[name].text} (as "
                            f"{config_class.__name__} declares it), got {value!r} "
                            f"({type(value).__name__}).")


def _check_common_knob(method: str, options: dict[str, Any]) -> None:
    """``num_features``, the common knob (features, landmarks or samples), at least 1
    for a method from outside the library too: a plugin's config may take 0, which no
    approximation can use, and sweeps (``approx``, ``compare``) count on it. ``None``,
    where a config's annotation allows it, is the config's to read."""
    value = options.get("num_features")
    if value is not None and not isinstance(value, bool) and isinstance(value, int):
        check_positive_int(f"{method}: num_features", value)


def _python_int(value: Any) -> Any:
    """NumPy's integer scalars (``np.int64(64)``, from ``np.arange`` sweeps) as Python
    ints, the type the option checks take and the result files write; anything else as
    it is."""
    if isinstance(value, numbers.Integral) and not isinstance(value, int):
        return int(value)
    return value


_REGISTRY: dict[str, Method] = {}
# variants by the name they were asked for, with the method they were made of (a name
# registered again makes its variants again)
_VARIANTS: dict[str, tuple[str, Method, Method]] = {}
# what a method's name may hold: variants, module:function@target names and shells need
# the rest ("softmax " would be refused by every lookup, which strips)
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _required_options(config_class: type) -> list[str]:
    """The arguments ``config_class()`` cannot be built without (its constructor's, so
    an ``InitVar`` counts and a class's own ``__init__`` with defaults does not)."""
    try:
        parameters = inspect.signature(config_class).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the first bind says
        return []
    return [p.name for p in parameters if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def register(
    name: str,
    config_class: type,
    capabilities: Capabilities,
    *,
    summary: str = "",
    state: StateFactory | None = None,
) -> Callable[[Callable[..., Tensor]], AttentionFunction]:
    """Decorator that registers an attention function under ``name``; returns its public
    form (generated from a core, see the module docstring)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TypeError(f"register: a method's name is a non-empty string of letters, digits, "
                        f"'_', '-' and '.' (brackets name a variant, ':' and '@' a function "
                        f"in the eval tools), got {name!r}.")
    if not isinstance(config_class, type) or not dataclasses.is_dataclass(config_class):
        raise TypeError(f"config_class of {name!r} must be a class decorated with "
                        f"@dataclasses.dataclass(frozen=True) (the method's options as its "
                        f"fields; the class itself, not an instance), got {config_class!r}.")
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities of {name!r} must be a skyformer.registry.Capabilities, "
                        f"got {type(capabilities).__name__}.")
    if capabilities.target not in TARGETS:
        raise ValueError(f"{name!r}: the target is the exact attention it approximates, one "
                         f"of {', '.join(TARGETS)}; got {capabilities.target!r}.")
    options = {f.name for f in dataclasses.fields(config_class)}
    required = _required_options(config_class)
    if required:  # spec.defaults(), skyformer list and approx bind with no options
        raise TypeError(f"{name!r}: every option needs a default (the method's defaults are "
                        f"its config's), and {config_class.__name__} has none for "
                        f"{', '.join(required)}; give {'each' if len(required) > 1 else 'it'} "
                        f"one (e.g. num_features: int = 64).")
    for capability, option in (("causal", "causal"), ("fixed_length", "max_seq_len")):
        if getattr(capabilities, capability) and option not in options:
            raise TypeError(f"{name!r} declares {capability}=True, which its config must "
                            f"carry as the option {option!r}; add it to "
                            f"{config_class.__name__}.")
    clash = sorted(options & set(_BIND_ARGUMENTS))
    if clash:
        raise TypeError(f"{name!r}: option names {clash} are reserved for Method.bind.")
    clash = sorted(options & set(_CALL_NAMES))
    if clash:
        raise TypeError(f"{name!r}: option names {clash} are arguments of every call "
                        f"({', '.join(_CALL_NAMES)}); rename the option in "
                        f"{config_class.__name__}.")
    if name in _RESERVED_METHOD_NAMES:
        raise ValueError(f"register: {name!r} names the model's own attention in "
                         f"skyformer.hf (set_attention(model, {name!r})); register the "
                         f"method under another name.")

    if not config_class.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"config_class of {name!r} must be a frozen dataclass (a method's "
                        f"options are fixed once bound): declare it with "
                        f"@dataclasses.dataclass(frozen=True).")

    def decorator(fn: Callable[..., Tensor]) -> AttentionFunction:
        _refuse_taken_name(name, fn)
        _check_call_arguments(name, fn)
        _check_options_taken(name, fn, config_class)
        _check_positional_arguments(name, fn, config_class, state)
        _check_declared_arguments(name, fn, capabilities)
        _check_keyword_defaults(name, fn, config_class)
        public = with_options(config_class, name)(fn) if takes_config(fn) else fn
        _REGISTRY[name] = Method(name, public, config_class, capabilities, summary, state)
        TAKES_QUERY_MASK[public] = takes_keyword(fn, "query_padding_mask")
        _name_in_transformers()
        return public

    return decorator


def _name_in_transformers() -> None:
    """Where ``skyformer.hf`` is imported, give every method (this one too) its
    ``attn_implementation`` name now: a method registered after that import (a plugin
    imported second) was otherwise unknown to transformers until the next
    ``set_attention``."""
    hf = sys.modules.get("skyformer.hf")
    register_methods = getattr(hf, "register_methods", None)  # None while it imports
    if register_methods is not None:
        register_methods()


def _refuse_taken_name(name: str, fn: Callable[..., Tensor]) -> None:
    """Refuse ``name`` where another function holds it. The same function defined
    again (its module re-imported with ``importlib.reload``, a notebook cell run
    twice) takes its place."""
    held = _REGISTRY.get(name)
    if held is None or _defined_as(core_of(held.function)) == _defined_as(fn):
        return
    raise ValueError(f"attention method {name!r} is already registered, by "
                     f"{'.'.join(_defined_as(core_of(held.function)))}; register "
                     f"{'.'.join(_defined_as(fn))} under another name.")


def _defined_as(fn: Callable[..., Any]) -> tuple[str, str]:
    return getattr(fn, "__module__", "?") or "?", getattr(fn, "__qualname__", repr(fn))


# What every call passes a method's core (``binding.BoundMethod.__call__``); the calls
# with queries of their own padding (cross-attention) pass query_padding_mask too
CALL_ARGUMENTS = ("key_padding_mask", "generator")


def _check_call_arguments(name: str, fn: Callable[..., Tensor]) -> None:
    """A core that cannot take the arguments every call passes gets a sentence at
    registration, not a TypeError at its first call."""
    missing = [a for a in CALL_ARGUMENTS if not takes_keyword(fn, a)]
    if missing:
        raise TypeError(
            f"register: the function registered as {name!r} must take the keyword arguments "
            f"{', '.join(CALL_ARGUMENTS)} (every call passes them), and query_padding_mask "
            f"for calls with queries of their own padding; it lacks {', '.join(missing)}.")


def _check_options_taken(name: str, fn: Callable[..., Tensor], config_class: type) -> None:
    """A function registered as its public form (no ``config`` parameter) takes every
    option as a keyword argument; one that takes neither them nor a ``config`` (a core
    whose fourth parameter has another name) gets a sentence at registration, not a
    TypeError at every call."""
    if takes_config(fn):
        return
    missing = [f.name for f in dataclasses.fields(config_class) if not takes_keyword(fn, f.name)]
    if missing:
        raise TypeError(
            f"register: the function registered as {name!r} takes neither a config (a "
            f"core: its fourth positional parameter named config, def f(q, k, v, config, "
            f"*, key_padding_mask=None, generator=None)) nor the options "
            f"{', '.join(missing)} as keyword arguments (a public form); name its fourth "
            f"parameter config.")


def _check_declared_arguments(name: str, fn: Callable[..., Tensor],
                              capabilities: Capabilities) -> None:
    """A capability whose call passes an argument the function does not take
    (``attn_mask``) gets a sentence at registration: its first masked call named
    ``skyformer.scaled_dot_product_attention``, the function the user had called."""
    if capabilities.attn_mask and not takes_keyword(fn, "attn_mask"):
        raise TypeError(f"register: {name!r} declares attn_mask=True, so calls pass it an "
                        f"attn_mask, which the function registered does not take; add the "
                        f"keyword argument attn_mask=None (or leave attn_mask undeclared).")


def _check_keyword_defaults(name: str, fn: Callable[..., Tensor], config_class: type) -> None:
    """A public form (options as keyword arguments) whose own default of an option
    differs from its config's: every registered call runs the config's, a direct call
    of the function its own, one method with two defaults."""
    if takes_config(fn):
        return
    parameters = inspect.signature(fn).parameters
    for f in dataclasses.fields(config_class):
        own = parameters[f.name].default if f.name in parameters else inspect.Parameter.empty
        if own is inspect.Parameter.empty or f.default is dataclasses.MISSING:
            continue
        plain = (bool, int, float, str)  # a None, tensor or list default: not compared
        if isinstance(own, plain) and isinstance(f.default, plain) and own == own \
                and f.default == f.default and own != f.default:  # NaN != NaN
            raise ValueError(f"register: {name!r} defaults {f.name} to {own!r} in its "
                             f"function and to {f.default!r} in {config_class.__name__}; "
                             f"registered calls run the config's, so give both one default.")


def _check_positional_arguments(name: str, fn: Callable[..., Tensor], config_class: type,
                                state: StateFactory | None) -> None:
    """A function that cannot be called as every call calls it, ``fn(q, k, v, config,
    **keywords)`` (a core) or ``fn(q, k, v, **options, **keywords)`` (a public form), by
    its positional parameters (a missing ``v``, an extra one without a default) gets a
    sentence at registration. Keyword-only parameters without a default, and with a
    per-layer ``state`` any parameter, are taken as the state's arguments, which a
    layer passes by name."""
    signature = inspect.signature(fn)
    core = takes_config(fn)
    positional = ("q", "k", "v", "config") if core else ("q", "k", "v")
    keywords = dict.fromkeys(CALL_ARGUMENTS)
    if not core:
        keywords.update(dict.fromkeys(f.name for f in dataclasses.fields(config_class)))
    by_name = (inspect.Parameter.KEYWORD_ONLY,) if state is None else (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    keywords.update((p.name, None) for p in list(signature.parameters.values())[
        len(positional):] if p.kind in by_name and p.default is p.empty)
    try:
        signature.bind(*positional, **keywords)
    except TypeError as error:
        form = ("def f(q, k, v, config, *, key_padding_mask=None, generator=None)" if core
                else "def f(q, k, v, *, key_padding_mask=None, generator=None, <options>)")
        raise TypeError(f"register: the function registered as {name!r} cannot be called "
                        f"as every call calls it, with q, k, v{', config' * core} by "
                        f"position ({error}); its form: {form}.") from None


def with_options(config_class: type, method: str
                 ) -> Callable[[Callable[..., Tensor]], AttentionFunction]:
    """Decorator: the public form of a core whose options are those of the registered
    ``method`` (``register`` applies it; use it alone for a core outside the registry,
    e.g. a materialised variant of a method)."""

    def decorator(core: Callable[..., Tensor]) -> AttentionFunction:
        def make_config(options: dict[str, Any]) -> Any:
            spec = get_method(method)
            # a misspelt argument (``generatr``, ``mask``) named as the other entries name it
            refuse_misnamed_arguments(spec, options, core.__name__, core)
            return spec.make_config(**options)

        return public_function(
            core, config_class, make_config,
            lambda q, k, mask, config: get_method(method).check_call(q, k, mask, config))

    return decorator


def list_methods() -> list[str]:
    """Names of every registered method, in registration order."""
    return list(_REGISTRY)


def get_method(name: str) -> Method:
    """The registered method ``name``, or a variant of it with some options set
    (``"skyformer[pinv_gradient=implicit]"``, ``variants.py``), checked at once; unknown
    names fail with the list of known ones."""
    if isinstance(name, str) and is_variant(name):
        cached = _VARIANTS.get(name)  # parsed and checked once (calls name it every time)
        if cached is None or _REGISTRY.get(cached[0]) is not cached[1]:
            base, preset = parse_variant(name)
            of = get_method(base)
            method = Method(name.strip(), of.function, of.config_class, of.capabilities,
                            of.summary, of.state, preset)
            _make_variant_config(method, of)  # unknown options and bad values fail here
            cached = _VARIANTS[name] = (base, of, method)
        return cached[2]
    if isinstance(name, Tensor):  # attention(q, k, v, mask): SDPA's order
        raise TypeError(
            f"the attention method must be a method's name, got a tensor of shape "
            f"{tuple(name.shape)}: a mask goes by keyword, key_padding_mask= ([B, Nk] bool, "
            f"True = real token) or, in skyformer.scaled_dot_product_attention(q, k, v, "
            f"attn_mask, ...), where torch's SDPA takes it.")
    if not isinstance(name, str):  # None, a number: what the list below names is a str
        raise TypeError(f"the attention method must be a method's name (one of "
                        f"skyformer.list_methods()), got {type(name).__name__} {name!r}.")
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention method {name!r}{did_you_mean(name, _REGISTRY)}; available: "
            f"{', '.join(_REGISTRY)} (a method of your own: import the module that "
            f"registers it first; on the command line, skyformer --plugin MODULE ...)."
        )
    return _REGISTRY[name]


# How a value is written in a variant's brackets (variants.py), for a value refused there
VARIANT_VALUES = ("in a variant's brackets a value is a number, true / false, null (None) or "
                  "a string, quoted where it would read as one of those: [mode='1']")


def _make_variant_config(method: Method, of: Method) -> None:
    """The variant's options checked (``make_config``): an unknown one fails with its
    sentence, a value its config refuses with how brackets write values too (a str
    option given 1 needs quotes, ``None`` is written null or None)."""
    if not all(key in of.option_names() for key, _ in method.preset):
        method.make_config()  # the unknown option's sentence
        return
    try:
        method.make_config()
    except (TypeError, ValueError) as error:
        # a value of another type than the option takes, or a word read as a string
        # (none, yes) that the sentence names: perhaps written as brackets do not read
        # it; a value out of range (gamma=0) gets the method's sentence alone
        words = [repr(value) for _, value in method.preset if isinstance(value, str)]
        if not isinstance(error, TypeError) and not any(w in str(error) for w in words):
            raise
        raise with_note(error, VARIANT_VALUES) from None


def with_note(error: Exception, note: str) -> Exception:
    """``error`` again, its sentence followed by `` (note).``; an exception of a class
    that cannot be made from one sentence (a plugin's own) is given back unchanged."""
    try:
        return type(error)(f"{str(error).rstrip('.')} ({note}).")
    except Exception:  # its own __init__: its sentence stays as it was
        return error


def did_you_mean(given: object, names: Iterable[str]) -> str:
    """`` (did you mean 'skyformer'?)`` where ``given`` (a method or option name) is a
    close misspelling of one of ``names`` (a letter swapped, missing or of another case,
    spaces around it), else ``""``."""
    if not isinstance(given, str):
        return ""
    names = list(names)
    folded = {name.lower(): name for name in names}
    close = folded.get(given.strip().lower())
    if close is None:
        found = difflib.get_close_matches(given.strip().lower(), list(folded), n=1, cutoff=0.75)
        close = folded[found[0]] if found else None
    return f" (did you mean {close!r}?)" if close is not None and close != given else ""


# Names other libraries and papers give to what every approximate method here calls
# num_features (landmarks, random features, projection length, sampled columns): a
# close spelling of another option ('landmarks' and 'landmark_stride') is not the point.
BUDGET_NAMES = frozenset({
    "landmarks", "num_landmarks", "n_landmarks", "nb_features", "n_features",
    "num_random_features", "num_samples", "proj_dim", "proj_len", "projection_dim",
    "rank",
})


def option_suggestion(given: str, names: Iterable[str]) -> str:
    """`` (did you mean 'num_features'?, ...)`` for an option name ``given`` that ``names``
    (a method's options) lacks: another library's name of the feature budget, or a
    close misspelling (``did_you_mean``); else ``""``."""
    names = list(names)
    if given in BUDGET_NAMES and "num_features" in names:
        return (" (did you mean 'num_features'? every approximate method's landmarks, "
                "random features or projection size)")
    return did_you_mean(given, names)


def refuse_misspelt_arguments(options: Iterable[str], entry: str,
                              function: Callable[..., Any]) -> None:
    """A sentence (ValueError) where a keyword of ``options`` is a close misspelling of
    one of the entry point ``function``'s named arguments (``layer`` for ``layers``)."""
    for name in options:
        close = did_you_mean(name, _argument_names(function))
        if close:
            raise ValueError(f"{entry} has no argument {name!r}{close}.")


def refuse_misnamed_arguments(method: Method, options: dict[str, Any], entry: str,
                              function: Callable[..., Any]) -> None:
    """A sentence (ValueError) for an option ``method`` lacks that was meant as an
    argument of the entry point ``entry`` (``function``): a close misspelling of one of
    its named arguments (``is_casual``, ``methd``: the method's own error would blame
    the default method, or list options that are not the point), or ``mask``, which no
    entry point takes under that name."""
    unknown = sorted(set(options or ()) - set(method.option_names()))
    if not unknown:  # the usual call: the cached names are not asked (a compiled call
        return       # would trace them, and Dynamo warns of a functools cache)
    names = _argument_names(function)
    for name in unknown:
        close = did_you_mean(name, names)
        if close and not did_you_mean(name, method.option_names()):  # else the method's
            raise ValueError(f"{entry} has no argument {name!r}{close}; {method.name}'s "
                             f"options are: {', '.join(method.option_names()) or 'none'}.")
        if name == "mask":
            other = " or attn_mask (SDPA's mask)" if "attn_mask" in names else ""
            raise ValueError(f"{entry} takes no argument 'mask': pass key_padding_mask "
                             f"([B, Nk] bool, True = real token){other}.")


@functools.cache
def _argument_names(function: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``function`` takes by name (not its ``**options``)."""
    return tuple(name for name, p in inspect.signature(function).parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def exact_method(target: Target) -> Method:
    """The exact method of ``target``: ``softmax`` or ``kernelized`` (Gaussian)."""
    if target not in _EXACT:
        raise ValueError(f"target must be one of {', '.join(_EXACT)}, got {target!r}.")
    return get_method(_EXACT[target])


def methods_that_can(capability: str) -> list[str]:
    """The registered methods that can do ``capability`` (a key of ``CAPABILITY_TEXT``),
    in registration order."""
    return [m.name for m in tuple(_REGISTRY.values())  # a copy: see outputs.registered_names
            if m.capabilities.has(capability)]


def methods_taking(option: str) -> list[str]:
    """The registered methods with ``option`` among their options, in registration
    order."""
    return [m.name for m in tuple(_REGISTRY.values()) if option in m.option_names()]


def _capability_sentence(name: str, capability: str) -> str:
    able = methods_that_can(capability)
    sentence = capability_sentence(name, capability, able)
    base = base_name(name)
    why = _REGISTRY[base].capabilities.not_causal_because if base in _REGISTRY else None
    if capability == "causal" and why:
        sentence = f"{sentence[:-1]} ({name}: {why})."
    if capability == "attn_mask" and base in _REGISTRY:
        sentence = f"{sentence[:-1]} ({name} takes {_masks_and_arguments(_REGISTRY[base])})."
    return sentence


def _masks_and_arguments(method: Method) -> str:
    """``"key padding and causal masks only, as key_padding_mask and causal=True"``: the
    masks a method without ``attn_mask`` takes and how they are passed."""
    caps = method.capabilities
    arguments = [a for a, able in (("key_padding_mask", caps.mask), ("causal=True", caps.causal))
                 if able]
    return masks_taken(caps) + (f" only, as {' and '.join(arguments)}" if arguments else "")


def check_capabilities(
    name: str,
    *,
    mask: bool = False,
    causal: bool = False,
    cross_attention: bool = False,
    half_precision: bool = False,
    gqa: bool = False,
    varlen: bool = False,
    weights: bool = False,
) -> Method:
    """Fail with a sentence if method ``name`` cannot do what is asked."""
    method = get_method(name)
    caps = method.capabilities
    for capability, wanted in (
        ("mask", mask),
        ("causal", causal),
        ("cross_attention", cross_attention),
        ("half_precision", half_precision),
        ("gqa", gqa),
        ("varlen", varlen),
        ("weights", weights),
    ):
        if wanted and not getattr(caps, capability):
            raise CapabilityError(_capability_sentence(name, capability))
    return method


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str = "skyformer",
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Dispatch to a registered method by name.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        method: a name from ``list_methods()``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        query_padding_mask: ``"auto"`` (in self-attention, Nq == Nk, the key mask also
            marks padded queries), ``None`` (every query real: cross-attention with
            Nq == Nk) or ``[B, Nq]`` bool.
        generator: source of randomness for randomised methods (a torch.Generator, a
            random key from ``skyformer.random_key``, or None).
        **options: the method's options (see ``skyformer list``).
    Returns:
        ``[B, H, Nq, Dv]``.
    """
    if options.get("causal"):
        check_capabilities(method, causal=True)
    spec = get_method(method)
    refuse_misnamed_arguments(spec, options, "skyformer.attention", attention)
    bound = BoundMethod(spec, spec.make_config(**options))
    warn_if_no_real_key(method, key_padding_mask, k)
    return bound(q, k, v, key_padding_mask=key_padding_mask,
                 query_padding_mask=query_padding_mask, generator=generator)
