"""``nn.Module`` wrappers: projections and head split/merge around a registered method."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .amp import autocast_enabled
from .checks import check_positive_int
from .linalg.tracing import may_read_values
from .ops.shared.inputs import check_attention_inputs, check_padding_mask
from .ops.shared.options import check_probability
from .registry import BoundMethod, Method, get_method
from .registry.guard import warn_if_no_real_key
from .registry.variants import base_name
from .weights import call_with_weights, check_weights

if TYPE_CHECKING:
    from .decoding import DecodingState


_TOKEN_LOCK = threading.Lock()  # a layer's first token, made once across threads


class _LayerToken:
    """Which layer made a decoding cache (``MultiHeadAttention.new_cache``). A deep copy
    is a new token whose ``parent`` is the original: a layer and its caches copied
    together share the copy (``copy.deepcopy``'s memo), a cache copied alone (to
    continue a prompt twice) still descends from its layer's token, and two clones of
    one layer differ. A copied layer cuts its token's ``parent`` (``__setstate__``): the
    original does not step the copy's caches (an EMA copy's weights move apart). Pickling
    drops it (None: an unpickled cache is checked by its method and options)."""

    __slots__ = ("parent",)

    def __init__(self, parent: _LayerToken | None = None) -> None:
        self.parent = parent

    def __deepcopy__(self, memo: dict) -> _LayerToken:
        return _LayerToken(self)

    def __reduce__(self) -> tuple:
        return type(None), ()

    def made(self, cache_token: Any) -> bool:
        """Whether a cache holding ``cache_token`` was made by this token's layer (or is
        a copy of such a cache)."""
        while cache_token is not None:
            if cache_token is self:
                return True
            cache_token = cache_token.parent
        return False


def _refuse_whole_sequence_mask(key_padding_mask: Any, new: int, held: int) -> None:
    """A sentence for a decoding step given a longer mask than its ``new`` positions
    (the whole sequence's so far, ``[B, held + new]``, as Hugging Face passes one),
    where the step's mask covers those positions alone."""
    if (held and isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() == 2
            and key_padding_mask.shape[1] > new):
        raise ValueError(
            f"MultiHeadAttention: with a cache, key_padding_mask covers the step's {new} new "
            f"position{'s' * (new != 1)} alone ([B, {new}]; the cache keeps the {held} "
            f"earlier ones'), got {tuple(key_padding_mask.shape)}: for a mask of the whole "
            f"sequence, pass its last columns, mask[:, -{new}:].")


def _same_features(theirs: Any, ours: torch.nn.Module) -> bool:
    """Whether a cache's features module (Performer's, read at its first step) is the
    layer's, or a copy with the same ``projection`` (an unpickled cache holds a copy;
    its redraw counters may differ, and the layer may have moved to another dtype or
    device since). Read once, at the cache's first step."""
    if theirs is ours:
        return True
    a, b = (getattr(m, "projection", None) for m in (theirs, ours))
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape \
        and torch.equal(a.to(device=b.device, dtype=b.dtype), b)


class BoundMethodProperties:
    """``method``, ``spec`` and ``config`` of a layer that holds its method bound as
    ``self.bound`` (``MultiHeadAttention``, ``TorchMultiheadAttention``)."""

    bound: BoundMethod

    @property
    def method(self) -> str:
        return self.bound.name

    @property
    def spec(self) -> Method:
        """The registered method."""
        return self.bound.method

    @property
    def config(self) -> Any:
        """The method's resolved options (a frozen dataclass)."""
        return self.bound.config

    def __prepare_scriptable__(self) -> Any:
        """``torch.jit.script`` calls this on every module first: a sentence instead of
        TorchScript's "Unknown type annotation: 'BoundMethod'"."""
        raise RuntimeError(
            f"{type(self).__name__} ({self.method}) cannot be scripted with "
            f"torch.jit.script (TorchScript cannot type its bound method and options); use "
            f"torch.jit.trace, torch.export or torch.compile (docs/pytorch2.md).")


def check_layer_configuration(where: str, dim_name: str, dim: Any, num_heads: Any,
                              dropout: Any, bias: Any) -> None:
    """What both attention layers (``MultiHeadAttention``, ``TorchMultiheadAttention``)
    refuse, in a sentence naming ``where``: a size that is no positive integer, a
    ``dim_name`` the heads do not divide (with the head counts that do), a dropout
    outside [0, 1] (``nn.Dropout`` takes 1: every output zero), a bias not a bool (the
    drop-in reads any truthy bias as torch does, before this check)."""
    for name, value in ((dim_name, dim), ("num_heads", num_heads)):
        check_positive_int(f"{where}: {name}", value)
    if dim % num_heads:
        divisors = [h for h in range(1, min(dim, 64) + 1) if dim % h == 0]
        raise ValueError(f"{where}: {dim_name} ({dim}) must be divisible by num_heads "
                         f"({num_heads}), each head taking {dim_name} / num_heads features; "
                         f"pass num_heads among {', '.join(map(str, divisors))}.")
    check_probability(where, "dropout", dropout)
    if not isinstance(bias, bool):
        raise ValueError(f"{where}: bias must be True or False, got {bias!r}.")


class MultiHeadAttention(BoundMethodProperties, nn.Module):
    """Multi-head attention whose core is any registered method.

    A layer ``x: [B, N, dim] -> [B, N, dim]`` with separate q/k/v/output projections.
    ``dropout`` is applied to the attention output before the output projection
    (approximate methods have no attention matrix to drop entries of).

    It is not call-compatible with ``torch.nn.MultiheadAttention``: it takes one
    batch-first ``x`` for self-attention (and a ``context`` for cross-attention) instead
    of ``(query, key, value)``, its ``key_padding_mask`` is True for real tokens (torch's
    is True for padding), it returns the output alone (the weights come from
    ``attention_weights``, a call of their own), and its
    parameters are ``q_proj``/``k_proj``/``v_proj``/``out_proj``, not ``in_proj_weight``.
    It takes no ``batch_first`` (``x`` is always batch-first), ``kdim``/``vdim`` (a
    context has width ``dim``), ``add_bias_kv``, ``add_zero_attn``, ``device`` or
    ``dtype`` (``layer.to(...)``): each is refused in a sentence.

    Args:
        dim: model width; must be divisible by ``num_heads``.
        num_heads: number of heads H (head dim = dim / H).
        method: a name from ``skyformer.list_methods()``.
        dropout: dropout probability on the attention output.
        bias: whether the projections have biases.
        seq_len: the longest sequence the layer will see; a fixed-length method
            (Linformer) takes it as its ``max_seq_len`` unless that option is given.
        process_group: a ``torch.distributed`` process group over which the sequence is
            sharded: each rank passes its contiguous shard ``[B, N_r, dim]`` of ``x`` (and
            of the mask) and gets its shard of the output (``skyformer.distributed``,
            docs/distributed.md). The parameters and buffers (Performer's features) must
            be alike on every rank, and the gradients summed over the group after
            backward (``distributed.sum_gradients``).
        **method_options: options of the method (e.g. ``num_features=64``).

    Example::

        layer = MultiHeadAttention(64, 2, method="skyformer", num_features=128)
        y = layer(x, key_padding_mask=mask)   # x: [B, N, 64], mask: [B, N] bool
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        method: str = "skyformer",
        *,
        dropout: float = 0.0,
        bias: bool = True,
        seq_len: int | None = None,
        process_group: Any = None,
        **method_options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(method, str):  # torch's third positional argument is dropout
            hint = (f"; dropout is keyword-only here: dropout={method!r}"
                    if isinstance(method, (int, float)) and not isinstance(method, bool) else "")
            raise TypeError(f"MultiHeadAttention: method must be a method's name (one of "
                            f"skyformer.list_methods()), got {type(method).__name__} "
                            f"{method!r}{hint}.")
        check_layer_configuration("MultiHeadAttention", "dim", dim, num_heads, dropout, bias)
        _refuse_torch_arguments(method_options, dim)
        if process_group is not None:
            from .distributed.forms import form_of  # torch.distributed only when asked

            form = form_of(method)  # refuses a method without a form before binding
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.bound: BoundMethod = get_method(method).bind(
            num_heads, self.head_dim, seq_len=seq_len, **method_options
        )
        if process_group is not None:  # options the sequence-parallel form cannot run
            form.check(self.bound.config)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        # Per-layer state of the method (learned projections, kept random features).
        self.method_state = self.bound.new_state()
        self._group = _GroupHandle(process_group)

    @property
    def process_group(self) -> Any:
        """The group the sequence is sharded over (``None``: one process)."""
        return self._group.group

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "process_group" in state:  # pickled before the group was held by a handle
            state["_group"] = _GroupHandle(state.pop("process_group"))
        token = state.get("_decoding_token")
        if token is not None:  # a deep copy (pickling drops the token): a layer of its own
            token.parent = None
        super().__setstate__(state)

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, Dh]

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *torch_arguments: Any,
        context: Tensor | None = None,
        query_padding_mask: Tensor | None = None,
        generator: torch.Generator | Tensor | None = None,
        cache: DecodingState | None = None,
        **torch_keywords: Any,
    ) -> Tensor:
        """Attend from ``x: [B, N, dim]`` to itself, or to ``context: [B, M, dim]``.

        ``key_padding_mask: [B, N]`` (or ``[B, M]`` with a context), True = real token;
        in self-attention it also marks the padded queries. With a context the queries
        are all real unless ``query_padding_mask: [B, N]`` says otherwise; as the
        cross-attention of a causal decoder, where later queries are later tokens, use a
        method with ``independent_queries`` (docs/causal.md), since the others mix them. With a
        ``cache`` (``new_cache()``), ``x`` holds the next positions of the sequences the
        cache has seen: causal self-attention to all of them (decoding); the mask then
        marks those new positions alone, ``[B, n]`` (the cache keeps the earlier ones').
        ``generator`` (a ``torch.Generator`` or a key, ``skyformer.random_key``) makes
        the draws of a randomised method (landmarks, hashes, samples); with ``None``
        each call takes one fresh key from torch's global generator, in eval mode too,
        so the same input gives another output on every call: pass a generator seeded
        anew (or a key) for reproducible outputs. Performer's features and Linformer's
        projections are the layer's own (``method_state``) and take no draw here.
        ``torch_arguments`` and ``torch_keywords`` take nothing: they are there so that
        torch.nn.MultiheadAttention's call (``(query, key, value)``, ``need_weights``,
        ``attn_mask``, ``is_causal``) is refused in a sentence saying what to do instead
        (``skyformer.TorchMultiheadAttention`` takes that call; torch's
        ``TransformerEncoderLayer`` passes key_padding_mask by keyword beside three
        positional tensors, which Python refuses before this method runs). Returns
        ``[B, N, dim]`` (zeros through the output projection where B, N or the
        context's M is 0, without calling the method; with a ``process_group`` such a
        call is refused on every rank: each rank's shard needs a row).
        """
        with self._failing_together():  # a rank refused alone would leave the others waiting
            _refuse_torch_call(torch_arguments, torch_keywords)
            self._check_forward(x, context, key_padding_mask, query_padding_mask, cache,
                                generator)
        q = self._split(self.q_proj(x))
        source = x if context is None else context
        k = self._split(self.k_proj(source))
        v = self._split(self.v_proj(source))
        # a decoding step with no new token: zeros, the cache unchanged (an empty batch
        # with a cache is the step's own error: the cache holds its batch)
        no_new_token = cache is not None and x.shape[1] == 0 and x.shape[0] > 0
        if no_new_token:
            cache.check_batch(x.shape[0])
        if cache is not None and not no_new_token:
            _refuse_whole_sequence_mask(key_padding_mask, x.shape[1], cache.length)
            # the forward's sentences, naming the argument passed here
            check_attention_inputs(q, k, v, key_padding_mask, method=self.bound.name)
            if cache.length == 0:  # later steps also attend to the keys the cache holds
                warn_if_no_real_key(self.bound.name, key_padding_mask, k)
            out = cache.step(q, k, v, key_padding_mask)
        elif self.process_group is not None:
            out = self._sequence_parallel(q, k, v, key_padding_mask, generator)
        elif 0 in (x.shape[0], x.shape[1], source.shape[1]):
            # no query, or no key: an empty (or zero) output, as torch.nn.MultiheadAttention
            # gives (a model's empty sub-batch; the methods refuse empty inputs), in the
            # graph of q, k, v
            # so that x and the weights get their (empty or zero) gradients
            self._check_empty_batch_mask(key_padding_mask, k)
            if context is not None:  # the method's sentence, as for a context of keys
                check_padding_mask(self.bound.name, "query_padding_mask", query_padding_mask,
                                   q.shape[0], q.shape[2], "Nq", q)
            out = q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
            if self.method_state is not None:  # Linformer's projections: every parameter
                # gets a gradient, as DDP (find_unused_parameters=False) needs of each rank
                out = out + 0 * sum(p.sum() for p in self.method_state.parameters())
        else:
            warn_if_no_real_key(self.bound.name, key_padding_mask, k)
            out = self.bound(
                q, k, v, key_padding_mask=key_padding_mask,
                query_padding_mask="auto" if context is None else query_padding_mask,
                generator=generator, state=self.method_state,
            )  # [B, H, N, Dh]
        b, _, n, _ = out.shape
        out = out.transpose(1, 2).reshape(b, n, self.dim)
        return self.out_proj(self.dropout(out))

    if TYPE_CHECKING:  # calling the layer runs forward: type checkers see its signature
        __call__ = forward

    def _failing_together(self) -> AbstractContextManager:
        """Sequence parallel, a check that fails on this rank only still lets the other
        ranks raise (``distributed.layout.failing_together``); else nothing."""
        if self.process_group is None:
            return nullcontext()
        from .distributed.layout import failing_together

        return failing_together(f"MultiHeadAttention ({self.bound.name}, sequence parallel)",
                                self.process_group)

    def _check_forward(self, x: Any, context: Any, key_padding_mask: Any,
                       query_padding_mask: Any, cache: DecodingState | None,
                       generator: Any) -> None:
        """A sentence for inputs ``forward`` cannot take."""
        self._refuse_keys_as_mask(key_padding_mask)
        source = x if context is None else context
        weight = self.q_proj.weight
        for name, t in (("x", x), ("context", source)):
            if not isinstance(t, Tensor):
                raise TypeError(f"MultiHeadAttention: {name} must be a tensor [B, N, "
                                f"{self.dim}], got {type(t).__name__}.")
            if t.dim() != 3 or t.shape[-1] != self.dim:
                raise ValueError(
                    f"MultiHeadAttention: {name} must have shape [B, N, {self.dim}], got "
                    f"{tuple(t.shape)}."
                )
            if t.dtype != weight.dtype and not autocast_enabled(t.device.type):
                raise TypeError(
                    f"MultiHeadAttention: {name} is {t.dtype} but the layer's weights are "
                    f"{weight.dtype}; convert one of them ({name}.to({weight.dtype}) or "
                    f"layer.to({t.dtype}))."
                )
        # eager calls only: a tracer would record the size comparison as a guard (N != B,
        # which torch.export refuses for a symbolic length)
        if (isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() == 2
                and may_read_values(source) and source.shape[0] != source.shape[1]
                and tuple(key_padding_mask.shape) == (source.shape[1], source.shape[0])):
            name = "x" if context is None else "context"
            raise ValueError(  # the method's sentence would blame the mask alone
                f"MultiHeadAttention: {name} {tuple(source.shape)} and key_padding_mask "
                f"{tuple(key_padding_mask.shape)} disagree on which size is the batch: "
                f"this layer is batch-first, {name} [B, N, dim] and the mask [B, N]; if "
                f"{name} is sequence-first [N, B, dim] (torch's batch_first=False), pass "
                f"{name}.transpose(0, 1), else pass key_padding_mask.T.")
        if context is not None and source.shape[0] != x.shape[0]:
            raise ValueError(
                f"MultiHeadAttention: x and context must hold the same batch, got "
                f"{x.shape[0]} and {source.shape[0]} sequences (x {tuple(x.shape)}, context "
                f"{tuple(source.shape)}).")
        if context is None and query_padding_mask is not None:
            raise ValueError(
                "MultiHeadAttention: query_padding_mask is for attention to a context; in "
                "self-attention key_padding_mask marks the padded queries too (pass the "
                "mask there).")
        if cache is not None:
            self._check_cache(cache)
        if cache is not None and (context is not None or self.process_group is not None):
            raise ValueError("MultiHeadAttention: a decoding cache runs causal self-attention "
                             "on one process; it takes no context and no process_group.")
        if cache is not None and generator is not None:
            raise ValueError(
                "MultiHeadAttention: a decoding cache draws once, from the key it was made "
                "with; pass the generator to new_cache(generator=...), not to each step.")
        if context is not None and self.process_group is not None:
            raise ValueError("MultiHeadAttention: with a process_group the layer runs "
                             "sequence-parallel self-attention; it takes no context.")
        if context is not None and getattr(self.config, "causal", None) is True \
                and source.shape[1] != x.shape[1]:
            raise ValueError(
                f"MultiHeadAttention: this layer was built with causal=True, which attends "
                f"causally within one sequence (as many queries as keys), and x holds "
                f"{x.shape[1]} position{'s' * (x.shape[1] != 1)}, context "
                f"{source.shape[1]}; a decoder's cross-attention to an encoder is a layer of "
                f"its own, built without causal=True (with a method whose outputs use their "
                f"own query alone: docs/causal.md).")

    def _check_empty_batch_mask(self, key_padding_mask: Any, k: Tensor) -> None:
        """The method's sentence for a key_padding_mask of the wrong shape, dtype or
        device, which an empty batch (the method not called) would otherwise take
        silently. ``k: [B, H, Nk, Dh]``."""
        check_padding_mask(self.bound.name, "key_padding_mask", key_padding_mask,
                           k.shape[0], k.shape[2], "Nk", k)

    def _check_cache(self, cache: Any) -> None:
        """A sentence for a cache this layer cannot step: not a cache, another layer's
        (it holds that layer's keys and state: stepped here, the two would mix), or one
        of another method; and any cache where the layer is not causal."""
        from .decoding import DecodingState

        if not isinstance(cache, DecodingState):
            raise TypeError(f"MultiHeadAttention: cache must be this layer's decoding cache "
                            f"(cache = layer.new_cache()), got {type(cache).__name__}.")
        self._refuse_cache_unless_causal()
        owner = getattr(cache, "layer", None)
        token = self.__dict__.get("_decoding_token")
        if owner is not None and (token is None or not token.made(owner)):
            raise ValueError(
                "MultiHeadAttention: this cache was made by another layer's new_cache(); a "
                "cache holds one layer's keys and state, so each layer needs its own: "
                "caches = [layer.new_cache(...) for layer in layers].")
        if owner is None:  # new_decoding_state's own, or unpickled
            self._check_foreign_cache(cache)

    def _check_foreign_cache(self, cache: DecodingState) -> None:
        """A sentence for a cache no layer made (``new_decoding_state``, or unpickled)
        whose method, options (``causal`` aside: decoding is causal) or method state
        (Performer's features) are not this layer's: its steps would not be the layer's
        forward."""
        fix = "make it with the layer's new_cache()"
        if base_name(cache.method) != self.spec.base_name:  # a variant: by its options below
            raise ValueError(f"MultiHeadAttention: this cache decodes {cache.method!r}, the "
                             f"layer runs {self.method!r}; {fix}.")
        theirs = cache.bound.options() if hasattr(cache, "bound") else {}
        for name, value in self.bound.options().items():
            if name != "causal" and name in theirs and theirs[name] != value:
                raise ValueError(f"MultiHeadAttention: this cache decodes {self.method} with "
                                 f"{name}={theirs[name]!r}, the layer with {name}={value!r}; "
                                 f"{fix}.")
        # features read at the first step (Performer's): a cache that stepped holds them
        if self.method_state is not None and hasattr(cache, "features_module") \
                and cache.length == 0 \
                and not _same_features(cache.features_module, self.method_state):
            raise ValueError(f"MultiHeadAttention: this cache was made without the layer's "
                             f"own {self.method} features, so its first step would draw "
                             f"others; {fix} (or pass state=layer.method_state to "
                             f"new_decoding_state).")

    def _refuse_cache_unless_causal(self) -> None:
        if getattr(self.config, "causal", None) is False:  # a method that can be causal
            raise ValueError(
                f"MultiHeadAttention: this {self.method} layer was built without causal=True, "
                f"so its forward attends to every position, later ones included, while a "
                f"decoding cache attends causally: its steps would not equal the layer's "
                f"forward. Build the layer as MultiHeadAttention({self.dim}, "
                f"{self.num_heads}, {self.method!r}, causal=True) to train and decode it.")

    def _refuse_keys_as_mask(self, key_padding_mask: Any) -> None:
        """A sentence for ``layer(x, keys)``, torch.nn.MultiheadAttention's call order:
        keys ``[B, M, width]`` where the ``[B, N]`` mask goes, of the layer's width or
        (torch's ``kdim``) a float tensor of another."""
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 3:
            return
        width = key_padding_mask.shape[-1]
        if width == self.dim:
            what, fix = "x or a context", ""
        elif key_padding_mask.is_floating_point():
            what, fix = "keys or values", (f", of width dim ({self.dim}): bring it to that "
                                           f"width first (e.g. with an nn.Linear({width}, "
                                           f"{self.dim})).")
        else:
            return
        raise ValueError(
            f"MultiHeadAttention: key_padding_mask must be [B, N] bool (True = real token), "
            f"got a tensor of shape {tuple(key_padding_mask.shape)}, the shape of {what}; "
            f"the layer takes one x, not torch.nn.MultiheadAttention's (query, key, value): "
            f"to attend to other positions pass their source as context=...{fix}")

    def attention_weights(self, x: Tensor, key_padding_mask: Tensor | None = None, *,
                          context: Tensor | None = None,
                          query_padding_mask: Tensor | None = None,
                          generator: torch.Generator | Tensor | None = None) -> Tensor:
        """The matrix ``[B, H, N, M]`` (``M``: the context's length, else ``N``) that the
        layer's method applies to the projected values in ``forward`` with the same
        arguments and draws (``skyformer.attention_weights``): ``forward(x, ...)`` is
        ``out_proj(dropout(heads merged(weights @ v_proj(x or context))))``. Pass one key
        (``skyformer.random_key(seed)``) to both calls for the weights of that output.
        A method without such a matrix, and a layer with a ``process_group`` (its ranks
        hold shards of the keys), are refused in a sentence."""
        where = "MultiHeadAttention.attention_weights"
        if self.process_group is not None:
            raise ValueError(f"{where}: the layer runs over a process_group, each rank holding "
                             f"a shard of the keys; build a layer without one (the same "
                             f"state_dict) to read the weights of the whole sequence.")
        check_weights(self.bound.name, f"{where}: ")
        self._check_forward(x, context, key_padding_mask, query_padding_mask, None, generator)
        source = x if context is None else context
        q, k = self._split(self.q_proj(x)), self._split(self.k_proj(source))
        if 0 in (x.shape[0], x.shape[1], source.shape[1]):  # as forward: no method call
            return q.new_zeros(*q.shape[:-1], k.shape[2])
        warn_if_no_real_key(self.bound.name, key_padding_mask, k)
        return call_with_weights(
            self.bound, q, k, k[..., :0], key_padding_mask=key_padding_mask,
            query_padding_mask="auto" if context is None else query_padding_mask,
            generator=generator, state=_as_next_call(self.method_state))[1]

    def new_cache(self, generator: torch.Generator | Tensor | None = None) -> DecodingState:
        """An empty decoding cache for ``forward(x, cache=...)``: causal self-attention of
        each new chunk of positions to every position before it, equal (to rounding) to
        the causal forward over the whole sequence with the same random key (for
        ``skyformer`` and ``nystrom_softmax`` with the same ``landmark_stride``: without
        one the cache keeps the stride its first chunk set, ceil(n0 / m), while a forward
        takes ceil(n / m) of the whole sequence; fix it to compare them). Its memory
        is constant in the length for ``linear``, ``performer``, ``skyformer`` and
        ``nystrom_softmax`` (``skyformer.decoding``); the exact methods keep the keys
        and values.

        Args:
            generator: the random key of the whole decode (``None``: drawn from torch's
                global generator at the first step).
        Raises:
            ValueError: the layer was built without ``causal=True``: its forward attends
                to every position, which its cached steps would not equal.
        """
        from .decoding import new_decoding_state

        self._refuse_cache_unless_causal()
        cache = new_decoding_state(self.bound, generator=generator, state=self.method_state)
        # the layer it steps (_check_cache): a token of the layer's own (None in a
        # layer unpickled: it gets a new one), made under a lock, so that caches made
        # at once in several threads get the same one
        with _TOKEN_LOCK:
            token = self.__dict__.get("_decoding_token")
            if token is None:
                token = self.__dict__["_decoding_token"] = _LayerToken()
        cache.layer = token
        return cache

    def _sequence_parallel(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                           generator: Any) -> Tensor:
        """Attention of this rank's shard of the sequence (``process_group``). A call that
        fails in training puts the method state's buffers back (Performer's call count,
        redraws and features; the built-in states change them in training only): a rank
        that refused its input alone counted nothing, so the others, which raise at the
        exchange, must not count it either, or their features would be redrawn at other
        calls from then on."""
        from .distributed import run_sequence_parallel

        kept = {} if self.method_state is None or not self.method_state.training else {
            name: buffer.clone() for name, buffer in self.method_state.named_buffers()}
        try:
            with self._failing_together():
                state = self.method_state(q, k) if self.method_state is not None else {}
            return run_sequence_parallel(self.bound, q, k, v, group=self.process_group,
                                         key_padding_mask=key_padding_mask,
                                         generator=generator, **state)  # [B, H, N_r, Dh]
        except BaseException:
            with torch.no_grad():
                for name, buffer in self.method_state.named_buffers() if kept else ():
                    buffer.copy_(kept[name])
            raise

    def extra_repr(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.bound.options().items())
        return f"dim={self.dim}, num_heads={self.num_heads}, method={self.method!r}" + (
            f", {options}" if options else ""
        )


def _as_next_call(state: nn.Module | None) -> Any:
    """``state`` as the next ``forward`` will find it, left unchanged: its ``upcoming``
    where it has one (a state that counts its calls: Performer's, which may redraw),
    else the state itself (its call changes nothing)."""
    return getattr(state, "upcoming", state)


def _refuse_torch_arguments(method_options: dict[str, Any], dim: int) -> None:
    """A sentence for an argument of ``torch.nn.MultiheadAttention``'s that this layer
    does not take, saying what it does instead (read as a method option, it was refused
    as an unknown option of the method, with the method's options as the choices)."""
    for name in ("batch_first", "kdim", "vdim", "add_bias_kv", "add_zero_attn", "device",
                 "dtype"):
        if name not in method_options:
            continue
        if name == "batch_first":
            why = ("always takes x batch-first, [B, N, dim]; leave batch_first out (a "
                   "sequence-first x [N, B, dim] converts with x.transpose(0, 1))")
        elif name in ("kdim", "vdim"):
            why = (f"projects keys and values from a context of width dim ({dim}); leave "
                   f"{name} out and bring the context to that width first (e.g. with an "
                   f"nn.Linear({name}, {dim}))")
        elif name in ("add_bias_kv", "add_zero_attn"):
            why = (f"has no {name}: it attends to the keys and values given; leave {name} "
                   f"out")
        else:
            why = (f"takes no {name}: build it and call layer.to({name}), or build it "
                   f"in a `with torch.device(...)` block for its device")
        raise ValueError(f"MultiHeadAttention {why}; torch.nn.MultiheadAttention's "
                         f"arguments are not this layer's (its docstring lists how they "
                         f"differ).")


def _refuse_torch_call(arguments: tuple[Any, ...], keywords: dict[str, Any]) -> None:
    """A sentence for a call in ``torch.nn.MultiheadAttention``'s form, ``layer(query, key,
    value, need_weights=..., attn_mask=..., is_causal=...)``, or for any other argument
    ``forward`` does not take, saying what the layer does instead. ``arguments``: those
    past ``(x, key_padding_mask)``."""
    drop_in = ("; skyformer.TorchMultiheadAttention takes torch's call, its weights and "
               "its masks (skyformer.replace_attention swaps it into a torch model)")
    if arguments:
        raise TypeError(
            f"MultiHeadAttention takes one x (and key_padding_mask) positionally, not "
            f"torch.nn.MultiheadAttention's (query, key, value): it got "
            f"{2 + len(arguments)} positional arguments. Call layer(x, key_padding_mask) for "
            f"self-attention and layer(x, context=...) to attend to other positions "
            f"(its keys' and values' source); x is batch-first, [B, N, dim]{drop_in}.")
    if not keywords:
        return
    name = next(iter(keywords))
    if name in ("need_weights", "average_attn_weights"):
        why = ("returns the output alone, with no attention weights (the approximate "
               f"methods form no attention matrix); leave {name} out, and for the matrix "
               f"the layer's method applies call layer.attention_weights(x, "
               f"key_padding_mask) with the forward's arguments")
    elif name == "attn_mask":
        why = ("takes no attn_mask: build the layer with causal=True for a causal mask and "
               "pass key_padding_mask (True = real token) for padding; other masks go to "
               "skyformer.scaled_dot_product_attention(q, k, v, attn_mask=..., method=...) "
               "for the methods that take them")
    elif name == "is_causal":
        why = ("takes no is_causal: build the layer with causal=True (a method that can be "
               "causal) and leave is_causal out")
    else:
        why = (f"forward() got an unexpected keyword argument {name!r}; it takes "
               f"key_padding_mask, context, query_padding_mask, generator and cache")
    raise TypeError(f"MultiHeadAttention {why}.")


class _GroupHandle:
    """A layer's process group: a handle to live connections, so a deep copy of the
    layer (an EMA model, ``copy.deepcopy``) shares it, and pickling the layer
    (``torch.save(model)``) says what to save instead."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupHandle:
        return self

    def __reduce__(self) -> Any:
        if self.group is None:
            return (_GroupHandle, (None,))
        raise TypeError("MultiHeadAttention: a layer with a process_group holds the group's "
                        "live connections and cannot be pickled; save model.state_dict() "
                        "instead and build the layer with its group where it is loaded.")
