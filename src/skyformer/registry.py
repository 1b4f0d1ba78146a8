"""The one place method names live: name -> (function, config dataclass, capabilities).

Methods register themselves with a decorator next to their implementation::

    @register("skyformer", SkyformerConfig, Capabilities(target="gaussian", randomized=True))
    def skyformer_attention(q, k, v, *, key_padding_mask=None, generator=None, **options): ...

Every config is a frozen dataclass whose defaults are the method's documented
defaults; every approximate method has the common option ``num_features``.
Capabilities are data; asking for something a method cannot do fails with a
sentence naming the method, the missing capability and the methods that have it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor

Target = Literal["softmax", "gaussian"]

_CAPABILITY_TEXT = {
    "mask": "honour a key_padding_mask",
    "causal": "do causal masking",
    "cross_attention": "attend with a different number of queries and keys",
    "fixed_length": "run without a fixed max_seq_len",
    "half_precision": "take float16/bfloat16 inputs",
}


@dataclass(frozen=True)
class Capabilities:
    """What a method can do, as data.

    target: the exact attention the method equals or approximates: ``"softmax"``
        (softmax(QK^T/sqrt(D))V) or ``"gaussian"`` (kernelized attention C V).
    exact: computes its target exactly.
    mask: honours ``key_padding_mask``.
    causal: has a ``causal`` option.
    cross_attention: accepts Nq != Nk.
    randomized: output depends on the ``generator``.
    fixed_length: needs a fixed ``max_seq_len`` (e.g. Linformer's projections).
    learned_parameters: owns trainable parameters (a ``state`` module, see ``Method``).
    half_precision: accepts float16/bfloat16 inputs.
    """

    target: Target
    exact: bool = False
    mask: bool = True
    causal: bool = False
    cross_attention: bool = True
    randomized: bool = False
    fixed_length: bool = False
    learned_parameters: bool = False
    half_precision: bool = True


StateFactory = Callable[[Any, int, int], "torch.nn.Module"]


@dataclass(frozen=True)
class Method:
    """A registered attention method.

    ``state``, when set, builds the per-layer module a method needs beyond its options
    (learned projections, random features kept between calls):
    ``state(config, num_heads, head_dim) -> nn.Module``. ``nn.MultiHeadAttention`` owns
    that module and, on every call, passes ``module(q, k)`` (a dict of extra keyword
    arguments) to the function. Called directly, such functions must work without
    those arguments (e.g. by drawing them from the generator) or say what is missing.
    """

    name: str
    function: Callable[..., Tensor]
    config_class: type
    capabilities: Capabilities
    summary: str
    state: StateFactory | None = None

    def defaults(self) -> dict[str, Any]:
        """Option name -> default value."""
        return dataclasses.asdict(self.config_class())

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.config_class))

    def make_config(self, **options: Any) -> Any:
        """Build the frozen config, rejecting unknown options with the list of known ones."""
        unknown = sorted(set(options) - set(self.option_names()))
        if "causal" in unknown and options.get("causal"):
            raise CapabilityError(_capability_sentence(self.name, "causal"))
        if unknown:
            known = ", ".join(self.option_names()) or "none"
            raise ValueError(
                f"{self.name} has no option {', '.join(map(repr, unknown))}; "
                f"its options are: {known}."
            )
        return self.config_class(**options)


class CapabilityError(ValueError):
    """A method was asked for something its capabilities exclude."""


_REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    config_class: type,
    capabilities: Capabilities,
    *,
    summary: str = "",
    state: StateFactory | None = None,
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator that registers an attention function under ``name``."""
    if not dataclasses.is_dataclass(config_class):
        raise TypeError(f"config_class of {name!r} must be a dataclass.")

    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in _REGISTRY:
            raise ValueError(f"attention method {name!r} is already registered.")
        _REGISTRY[name] = Method(name, fn, config_class, capabilities, summary, state)
        return fn

    return decorator


def _load_builtin_methods() -> None:
    from . import ops  # noqa: F401  (importing ops registers the built-in methods)


def list_methods() -> list[str]:
    """Names of every registered method, in registration order."""
    _load_builtin_methods()
    return list(_REGISTRY)


def get_method(name: str) -> Method:
    """The registered method ``name``; unknown names fail with the list of known ones."""
    _load_builtin_methods()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"unknown attention method {name!r}; available: {', '.join(_REGISTRY)}."
        )
    return _REGISTRY[name]


def _capability_sentence(name: str, capability: str) -> str:
    having = [
        m.name for m in _REGISTRY.values() if _has(m.capabilities, capability)
    ]
    return (
        f"{name} cannot {_CAPABILITY_TEXT[capability]}"
        + (f"; methods that can: {', '.join(having)}." if having else ".")
    )


def _has(caps: Capabilities, capability: str) -> bool:
    if capability == "fixed_length":
        return not caps.fixed_length
    return bool(getattr(caps, capability))


def check_capabilities(
    name: str,
    *,
    mask: bool = False,
    causal: bool = False,
    cross_attention: bool = False,
    half_precision: bool = False,
) -> Method:
    """Fail with a sentence if method ``name`` cannot do what is asked."""
    method = get_method(name)
    caps = method.capabilities
    for capability, wanted in (
        ("mask", mask),
        ("causal", causal),
        ("cross_attention", cross_attention),
        ("half_precision", half_precision),
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
    generator: torch.Generator | None = None,
    **options: Any,
) -> Tensor:
    """Dispatch to a registered method by name.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        method: a name from ``list_methods()``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: source of randomness for randomised methods.
        **options: the method's options (see ``skyformer list``).
    Returns:
        ``[B, H, Nq, Dv]``.
    """
    spec = check_capabilities(
        method,
        mask=key_padding_mask is not None,
        causal=bool(options.get("causal", False)),
        cross_attention=isinstance(q, Tensor) and isinstance(k, Tensor)
        and q.dim() == 4 and k.dim() == 4 and q.shape[2] != k.shape[2],
        half_precision=isinstance(q, Tensor) and q.dtype in (torch.float16, torch.bfloat16),
    )
    config = spec.make_config(**options)
    return spec.function(
        q, k, v, key_padding_mask=key_padding_mask, generator=generator,
        **dataclasses.asdict(config),
    )
