"""The one way to call a registered method: bind it once, then call the binding.

``Method.bind`` validates the options once (the config), applies the rules every caller
needs (a fixed-length method gets ``max_seq_len`` from the sequence length it is bound
for) and returns a ``BoundMethod``. Calling it checks the call against the method's
capabilities (a sentence, not a traceback, for a mask, cross-attention or half precision
the method cannot take) and runs the method's core. Methods with a per-layer state
(learned projections, kept random features) get it from ``BoundMethod.new_state``: the
caller owns that module (a layer keeps it as a submodule, so it trains, moves and saves
with the model) and passes it to every call.

Used by ``skyformer.attention``, ``skyformer.MultiHeadAttention``, ``skyformer.hf``, the
experiments and the peak-memory subprocess alike.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..linalg.functional_ops import exporting
from ..ops.shared.inputs import check_attention_inputs, check_generator, check_query_mask_word
from ..seeds import check_seed
from ..sketch.rng import cpu_draws_seeded
from .autocast import as_autocast_hands_them, call_core
from .capabilities import CapabilityError

# Whether each registered function takes query_padding_mask (filled by ``register``,
# keyed by ``Method.function``; read without inspecting a signature in the call:
# compiled calls trace this code)
TAKES_QUERY_MASK: dict[Callable[..., Any], bool] = {}


def query_mask_argument(name: str, takes: bool, query_padding_mask: Any, q: Any, k: Any,
                        key_padding_mask: Any) -> dict[str, Any]:
    """The ``query_padding_mask`` keyword for a method's core: none for ``"auto"``
    (every core's default), nor for a core without the keyword where the mask says
    nothing ``"auto"`` would not (``None`` with other lengths, or without a key mask:
    every query real, as library callers pass for cross-attention); a sentence where
    such a core would drop a real query mask, or for a word other than ``"auto"``
    (which the core would not see)."""
    if isinstance(query_padding_mask, str):
        check_query_mask_word(name, query_padding_mask)
        return {}
    if takes:
        return {"query_padding_mask": query_padding_mask}
    lengths = [getattr(t, "shape", (None, None))[-2] for t in (q, k)]
    if query_padding_mask is None and (lengths[0] != lengths[1] or key_padding_mask is None):
        return {}
    raise TypeError(
        f"{name} takes no query_padding_mask (its function lacks the keyword argument), so "
        f"it cannot be told which queries are real apart from the keys' padding; add "
        f"query_padding_mask='auto' to the function and pass it to check_attention_inputs "
        f"(CONTRIBUTING.md).")


def all_real_padding_as_none(method: Any) -> bool:
    """Whether a caller that turns an attention mask into key padding for ``method``
    (a registry ``Method``) must pass None where every key is real, which takes a read
    of the mask on the host: for a method without key padding (capability ``mask``),
    and for one whose function lacks ``query_padding_mask`` (``query_mask_argument``
    refuses a key mask there when the queries could be padded). The library's methods
    give the same result, up to rounding, with a mask of real keys as with None."""
    return not (method.capabilities.mask and TAKES_QUERY_MASK.get(method.function, True))


def takes_keyword(fn: Callable[..., Any], name: str, *, named: bool = False) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` (or any, ``**kwargs``, unless
    ``named``: a function taking ``**kwargs`` alone may drop it)."""
    parameters = inspect.signature(fn).parameters
    return (not named and any(p.kind is p.VAR_KEYWORD for p in parameters.values())) or (
        name in parameters and parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY)


def _refuse_unknown_arguments(method: Method, arguments: dict[str, Any]) -> None:
    """A sentence for a keyword the method's core does not take (``dropout_p``, ``mask``):
    Python's own named the core's function, ``skyformer_attention() got an unexpected
    keyword argument``, which the user never called."""
    from .methods import _CALL_NAMES, _argument_names, did_you_mean

    taken = _argument_names(method.core)  # cached: the usual call reads no signature
    unknown = [name for name in arguments
               if name not in taken and not takes_keyword(method.core, name)]
    if not unknown:
        return
    call = [n for n in _CALL_NAMES if n not in ("q", "k", "v", "method")]
    own = [n for n in taken if n not in ("q", "k", "v", "config", *call)]
    close = did_you_mean(unknown[0], [*call, *own]) if len(unknown) == 1 else ""
    raise TypeError(f"{method.name}: the bound call takes no argument "
                    f"{', '.join(map(repr, unknown))}{close}; it takes q, k, v and "
                    f"{', '.join([*call, *own])} (options are given to bind(); "
                    f"SDPA's arguments to skyformer.scaled_dot_product_attention).")


def _names_generator(factory: Callable[..., Any]) -> bool:
    """Whether a state factory names a ``generator`` keyword argument: one that only
    takes ``**kwargs`` may drop it, and would then draw unseeded."""
    try:
        return takes_keyword(factory, "generator", named=True)
    except (TypeError, ValueError):  # no signature to read: take it as absent
        return False


if TYPE_CHECKING:
    from .methods import Method


def capability_sentence_for(method: Method, capability: str) -> str:
    from .methods import _capability_sentence  # the registry imports this module

    return _capability_sentence(method.name, capability)

HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_symbolic_length(method: Method, config: Any, q: Any, k: Any) -> None:
    """Fail with a sentence where ``torch.export`` traces a symbolic sequence length
    (``torch.export.Dim`` for N) that the call cannot follow, rather than let export
    report a guard it cannot prove deep inside torch: control flow that follows N
    (``Capabilities.fixed_shapes_because``), or a token budget that the lengths the Dim
    allows would cap (``autocast.capped``). The causal forms by chunks of positions
    export (``ops/shared/causal_prefix.py``)."""
    lengths = [t.shape[-2] for t in (q, k) if isinstance(t, Tensor) and t.dim() >= 2]
    if all(isinstance(n, int) for n in lengths) or not exporting():
        return
    why, able = method.capabilities.fixed_shapes_because, ", ".join(_symbolic())
    if why is not None:
        raise CapabilityError(
            f"{method.name} cannot be exported with a symbolic sequence length "
            f"(torch.export.Dim for N): {why}. Export it with a static length (leave N out "
            f"of dynamic_shapes), or export what can: {able}.")
    shortest = [_shortest(n) for n in lengths]
    capped = _caps(config, shortest)
    if capped:
        uncapped = _uncapped_length(config, min(shortest))
        options = ", ".join(f"{name}={getattr(config, name)}" for name in capped)
        raise CapabilityError(
            f"{method.name} caps {options} by the sequence length, which the symbolic "
            f"length (torch.export.Dim for N) lets fall to {min(shortest)}, where the cap "
            f"applies; give N a minimum of {uncapped} (torch.export.Dim('N', "
            f"min={uncapped})), from which nothing is capped, or export a static length.")


def _symbolic() -> list[str]:
    """The methods that export with a symbolic length (their causal forms too)."""
    from .methods import get_method, list_methods  # the registry imports this module

    return [name for name in list_methods()
            if get_method(name).capabilities.fixed_shapes_because is None]


def _shortest(n: Any) -> int:
    """The smallest value of a length: a symbolic one's lower bound (its Dim's min)."""
    if isinstance(n, int):
        return n
    return int(n.node.shape_env.bound_sympy(n.node.expr).lower)


def _caps(config: Any, lengths: list[int]) -> dict[str, Any]:
    """The options ``config.budget_caps`` changes at these query and key lengths."""
    caps = getattr(config, "budget_caps", None)
    return {} if caps is None else caps(lengths[0], lengths[-1])


def _uncapped_length(config: Any, n: int) -> int:
    """The shortest length from ``n`` on at which no budget is capped (caps shrink as
    the sequence grows): doubling, then bisection."""
    high = max(n, 1)
    while _caps(config, [high]):
        high *= 2
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _caps(config, [middle]) else (low, middle)
    return high


@dataclass(frozen=True, eq=False)
class BoundMethod:
    """A method with validated options, for layers of ``num_heads`` heads of ``head_dim``.

    ``num_heads`` and ``head_dim`` are needed only to build a per-layer state
    (``new_state``); a functional call leaves them ``None``.
    """

    method: Method
    config: Any
    num_heads: int | None = None
    head_dim: int | None = None

    @property
    def name(self) -> str:
        return self.method.name

    def replace(self, **options: Any) -> BoundMethod:
        """The same binding with some options changed (validated again); ``self`` when
        nothing changes."""
        current = self.options()
        # The type counts too: 128.0 or True equal to a current 128 or 1 must be validated
        # (and refused) as a new value would be.
        if all(name in current and type(current[name]) is type(value)
               and current[name] == value for name, value in options.items()):
            return self
        config = self.method.make_config(**{**current, **options})
        return dataclasses.replace(self, config=config)

    def options(self) -> dict[str, Any]:
        """Option name -> value, every option included."""
        return self.method.options_of(self.config)

    def new_state(self, seed: int | None = None) -> nn.Module | None:
        """The method's per-layer state module (``None`` for methods without one).

        Args:
            seed: an integer in [0, 2^64): draw its initial parameters from a CPU
                ``torch.Generator`` of its own seeded with ``seed``, passed to the
                factory as ``generator=``: the numbers torch's global generator seeded
                alike would give, which is neither read nor changed (other threads may
                draw meanwhile). A factory without a named ``generator`` argument
                (``**kwargs`` alone may drop it) is built with torch's global CPU
                generator seeded for the while (restored after; not safe beside draws
                in other threads). ``None`` draws from the global state, as any
                ``nn.Module`` does.
        """
        if seed is not None:
            check_seed("new_state's seed", seed)
        factory = self.method.state
        if factory is None:
            return None
        if self.num_heads is None or self.head_dim is None:
            raise ValueError(
                f"{self.name} keeps per-layer state (e.g. learned projections); bind it with "
                f"the layer's shape: get_method({self.name!r}).bind(num_heads, head_dim, ...)."
            )
        if seed is None:
            return factory(self.config, self.num_heads, self.head_dim)
        if _names_generator(factory):
            generator = torch.Generator().manual_seed(seed)
            return factory(self.config, self.num_heads, self.head_dim, generator=generator)
        with cpu_draws_seeded(seed):  # a factory registered without a generator argument
            return factory(self.config, self.num_heads, self.head_dim)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        query_padding_mask: Tensor | str | None = "auto",
        generator: torch.Generator | Tensor | None = None,
        state: nn.Module | None = None,
        **arguments: Any,
    ) -> Tensor:
        """Attention of ``q: [B, H, Nq, D]`` to ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``.

        Args:
            key_padding_mask: ``[B, Nk]`` bool, True = real token.
            query_padding_mask: ``"auto"`` (the key mask marks the queries when
                Nq == Nk), ``None`` (every query real) or ``[B, Nq]`` bool.
            generator: source of the method's randomness.
            state: the module from ``new_state``; ``None`` calls the method as a bare
                function call does (e.g. Linformer then draws its projections).
            **arguments: further call arguments of the method's core (e.g. the exact
                methods' ``attn_mask``).
        Returns:
            ``[B, H, Nq, Dv]``.
        """
        self.method.check_call(q, k, key_padding_mask, self.config)
        check_symbolic_length(self.method, self.config, q, k)
        if arguments.get("attn_mask") is not None and not self.method.capabilities.attn_mask:
            raise CapabilityError(capability_sentence_for(self.method, "attn_mask"))
        if arguments and not torch.compiler.is_compiling():  # inspect is not traced
            _refuse_unknown_arguments(self.method, arguments)
        query_mask = query_mask_argument(
            self.method.name, TAKES_QUERY_MASK.get(self.method.function, True),
            query_padding_mask, q, k, key_padding_mask)
        if state is not None:  # it may count the call (Performer's redraws): a call the
            # core would refuse must not count, so the core's input checks come first, on
            # the inputs as autocast hands them over (Llama's rotary step gives float32
            # q, k beside a bfloat16 v), cast only where their dtypes differ
            same = isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) \
                and q.dtype == k.dtype == v.dtype
            check_attention_inputs(*((q, k, v) if same else as_autocast_hands_them(q, k, v)),
                                   key_padding_mask, method=self.method.name,
                                   query_padding_mask=query_mask.get("query_padding_mask",
                                                                     "auto"))
            check_generator(self.method.name, generator, q.device)
        extra = {**(state(q, k) if state is not None else {}), **arguments, **query_mask}
        return call_core(self.method.core, q, k, v, self.config,
                         key_padding_mask=key_padding_mask, generator=generator, **extra)
