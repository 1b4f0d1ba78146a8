"""A drop-in replacement for ``torch.nn.MultiheadAttention`` whose core is any registered
method, and ``replace_attention``, which swaps it into a model built on torch's layer.

``TorchMultiheadAttention`` takes torch's constructor arguments, parameter names and
initialisation (``in_proj_weight``, ``in_proj_bias``, ``q_proj_weight``/...,
``out_proj``), torch's call ``(query, key, value, key_padding_mask, need_weights,
attn_mask, average_attn_weights, is_causal)`` and return value ``(output, weights)``, so
that a model built on ``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``, ``nn.Transformer``) runs a skyformer method with its
trained weights. What differs from torch:

- Attention weights are returned only by a layer built with ``return_weights=True``:
  then ``need_weights=True`` gives the matrix the method applies to the values
  (``skyformer.attention_weights``; torch's weights for ``softmax``), averaged over the
  heads as torch's (``average_attn_weights``), at the cost of that matrix and of the
  method run with ``S`` more value columns. Otherwise ``(output, None)``, with a warning
  once per layer where ``need_weights=True`` (torch's default; ``need_weights=False``
  silences it): no method materialises the attention matrix, ``softmax`` included (its
  output comes from SDPA's fused kernels), and torch's default would otherwise cost
  every call of a model written for torch's layer that matrix.
- Masks, in torch's conventions (``key_padding_mask`` True = padding, ``attn_mask``
  True = not allowed, or additive floats), are turned into SDPA's and routed as
  ``skyformer.scaled_dot_product_attention`` routes them: the exact methods
  (``softmax``, ``kernelized``) take any mask; the approximate ones take key padding and
  causal masks (``skyformer.masks.resolve_mask``) and refuse others in a sentence.
- ``is_causal`` is torch's hint that ``attn_mask`` is the causal mask: as in torch the
  mask must be given with it. The exact methods do as torch's SDPA path does: the hint
  alone where it would take it (no ``key_padding_mask``, ``need_weights=False``), the
  mask otherwise (torch's inference fast path applies the mask always, so a wrong hint
  gives torch two results; a right one, one); the approximate methods run their causal
  form without reading the mask (as torch's SDPA path drops it for the hint), which
  needs as many queries as keys.
- In self-attention (``query is key``, as torch's layers call it) the approximate methods
  take the padded queries as padding (skyformer's convention: output rows 0, never
  landmarks, so that padding equals truncation); torch and the exact methods give those
  rows the attention of a real query. A query that may attend to no key gets 0, not NaN.
- Dropout drops attention weights for ``softmax`` (as torch) and, for methods without a
  weight matrix, entries of the attention output (the same expectation), in training only.
- ``add_bias_kv`` and ``add_zero_attn`` append torch's keys and values (a learned pair,
  then a zero pair) after the projections, with a mask column every query may attend
  (the exact methods, as torch: with the ``is_causal`` hint alone, SDPA's top-left
  causal mask over the ``S + n`` keys, which leaves them unattended). The approximate
  methods that take other numbers of queries and keys take them in their non-causal
  forms (self-attention's padded queries stay padding; Linformer's projection sees them
  after the padding, so there padding no longer equals truncation) and refuse a causal
  call in a sentence: their causal forms pair query ``i`` with key ``i``.

torch's ``TransformerEncoderLayer`` has a fused fast path (eval under ``no_grad``) that
reads ``self_attn.in_proj_weight`` and runs torch's own softmax, and declines it where
any module inside the layer has a forward hook: every layer here registers a pre-hook
that does nothing, so that path is never taken. ``TransformerEncoder``'s sparsity path
(nested tensors of the real tokens) still runs, each layer then handing its
``self_attn`` a nested tensor: it is padded, attended with the padding as key padding,
and nested again.
"""

from __future__ import annotations

import numbers
import operator
import warnings
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .amp import autocast_enabled
from .checks import check_positive_int
from .functional import attn_mask_as_padding, refuse_causal_lengths, sdpa_options
from .linalg.tracing import values_to_check
from .masks import BLOCKED_LOGIT
from .nn import BoundMethodProperties, check_layer_configuration
from .registry import (
    BoundMethod,
    CapabilityError,
    get_method,
    methods_that_can,
)
from .registry.guard import warn_if_every_key_is_torch_padding
from .user_frame import warn_from_user_frame
from .weights import call_maybe_with_weights, check_weights

NAME = "TorchMultiheadAttention"


def _decline_torch_fast_path(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that does nothing. ``nn.TransformerEncoderLayer`` takes its
    fused fast path (torch's exact softmax from ``self_attn.in_proj_weight``) only where
    no module inside it has hooks; this one makes it call ``self_attn`` instead."""
    return None


class TorchMultiheadAttention(BoundMethodProperties, nn.Module):
    """``torch.nn.MultiheadAttention`` with any registered method as its core.

    Constructor, parameters, initialisation, call and return value as torch's (module
    doc for what differs); ``load_state_dict`` takes a ``torch.nn.MultiheadAttention``'s
    state dict (a method's own state, e.g. Performer's features, is then kept as it is).

    Args:
        embed_dim, num_heads, dropout, bias, kdim, vdim, batch_first, device, dtype: as
            torch's (``dropout`` on the attention in training only).
        add_bias_kv, add_zero_attn: as torch's (``bias_k``, ``bias_v`` ``[1, 1, E]``,
            Xavier-normal; module doc).
        method: a name from ``skyformer.list_methods()`` (options in brackets allowed).
        seq_len: the longest key sequence passed; a fixed-length method (Linformer) takes
            it, plus the keys ``add_bias_kv`` and ``add_zero_attn`` append, as its
            ``max_seq_len`` unless that option is given.
        return_weights: ``True``: ``need_weights=True`` returns the attention weights
            (module doc), for a method whose capabilities include ``weights``.
        **method_options: options of the method (e.g. ``num_features=64``).

    Example::

        mha = TorchMultiheadAttention(64, 4, method="skyformer", num_features=128)
        out, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)  # x: [N, B, 64]
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        method: str = "skyformer",
        seq_len: int | None = None,
        return_weights: bool = False,
        **method_options: Any,
    ) -> None:
        super().__init__()
        # torch's layer takes any integer type (np.int64 from a search) and any truthy bias
        embed_dim, num_heads, kdim, vdim = map(_torch_int, (embed_dim, num_heads, kdim, vdim))
        bias = bool(bias)
        _check_configuration(embed_dim, num_heads, dropout, bias, kdim, vdim, NAME)
        _refuse_process_group(method_options)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = bool(add_zero_attn)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias,
                                                        **factory)
        if add_bias_kv:  # any truthy value, as torch's
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()  # before the method's state: torch's draws, in its order
        if seq_len is not None:  # the method sees the appended keys too
            seq_len = seq_len + self._appended_keys
        self.bound: BoundMethod = get_method(method).bind(
            num_heads, self.head_dim, seq_len=seq_len, **method_options)
        _check_appended_keys(self.bound, self._appended_names, NAME)
        state = self.bound.new_state()  # learned projections, kept random features
        if state is not None and (device is not None or dtype is not None):
            state = state.to(**factory)
        self.method_state = state
        self.return_weights = _check_return_weights(return_weights, self.bound, NAME)
        self._weights_warned = False
        self.register_forward_pre_hook(_decline_torch_fast_path)

    def reset_parameters(self) -> None:
        """torch's initialisation of the projections (PyTorch's meta-device recipe:
        ``to_empty``, then ``reset_parameters()`` of every module, the method's state
        included: it has its own)."""
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections, zero biases, Xavier-normal
        ``bias_k`` and ``bias_v``."""
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
            xavier_normal_(self.bias_v)

    @property
    def _appended_names(self) -> list[str]:
        """Those of ``add_bias_kv`` and ``add_zero_attn`` that are set."""
        return _appended_names(self.bias_k is not None, self.add_zero_attn)

    @property
    def _appended_keys(self) -> int:
        """How many keys ``add_bias_kv`` and ``add_zero_attn`` append to each sequence."""
        return len(self._appended_names)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, method: str = "skyformer", *,
                   seq_len: int | None = None, return_weights: bool | None = None,
                   **method_options: Any) -> TorchMultiheadAttention:
        """A layer with ``mha``'s configuration, device, dtype and training mode, running
        ``method``, whose parameters are ``mha``'s own (the same objects, which of them
        require grad kept): an optimizer built over them trains the new layer. Pass
        ``copy.deepcopy(mha)`` for a layer of its own. ``return_weights``: ``None`` keeps
        that of ``mha`` where it is one of these layers (else ``False``)."""
        return _from_torch(cls, mha, f"{NAME}.from_torch", method, seq_len,
                           {"return_weights": return_weights, **method_options})

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        generator: torch.Generator | Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """torch.nn.MultiheadAttention's call (module doc for what differs).

        Args:
            query: ``[L, B, E]`` (``[B, L, E]`` with ``batch_first``, ``[L, E]`` unbatched);
                key: ``[S, B, kdim]``; value: ``[S, B, vdim]`` (laid out as the query).
            key_padding_mask: ``[B, S]`` (``[S]`` unbatched), bool (True = padding, not
                attended) or float (added to the scores).
            need_weights: ``True`` returns the weights where the layer was built with
                ``return_weights=True``, else warns once per layer that it does not.
            attn_mask: ``[L, S]`` or ``[B * num_heads, L, S]``, bool (True = NOT allowed
                to attend) or float (added to the scores).
            average_attn_weights: the weights' mean over the heads (as torch).
            is_causal: the hint that ``attn_mask`` is the causal mask (given with it).
            generator: a ``torch.Generator`` or a key (``skyformer.random_key``) for a
                randomised method's draws; ``None``: torch's global generator.
        Returns:
            ``(output, weights)``, output laid out as ``query`` with width ``embed_dim``;
            weights ``[B, L, S]`` (``[B, H, L, S]`` unaveraged; ``[L, S]`` or ``[H, L, S]``
            unbatched) where returned, else ``None``.
        """
        self._warn_no_weights(need_weights)
        if any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
            return self._nested(query, key, value, key_padding_mask, attn_mask, generator), None
        batched = _check_call(query, key, value, key_padding_mask, attn_mask, is_causal)
        self._check_positions(query, key, value, batched)
        self_attention = query is key and key is value  # as torch's layers call it
        if not batched:  # one sequence: batch_first is ignored, as torch does
            query, key, value = query[None], key[None], value[None]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        self._check_shapes(query, key, value, key_padding_mask, attn_mask, batched)
        # torch runs SDPA with the hint alone where it may, else the mask (the exact methods
        # follow it; the approximate ones take the hint always)
        hint_alone = is_causal and key_padding_mask is None and not need_weights
        out, weights = self._attend(query, key, value, key_padding_mask, attn_mask, is_causal,
                                    hint_alone, self_attention, generator,
                                    need_weights and self.return_weights)  # [L, B, E]
        if weights is not None:  # torch's shape: averaged over the heads, batched or not
            weights = weights.mean(1) if average_attn_weights else weights
            weights = weights if batched else weights[0]
        if not batched:
            return out[:, 0], weights
        return (out.transpose(0, 1) if self.batch_first else out), weights

    if TYPE_CHECKING:  # calling the layer runs forward: type checkers see its signature
        __call__ = forward

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any,
                attn_mask: Any, is_causal: bool, hint_alone: bool, self_attention: bool,
                generator: Any, weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Batch-first attention: ``query: [B, L, E]``, ``key: [B, S, kdim]``, ``value:
        [B, S, vdim]``, torch's masks; returns ``[L, B, E]``, torch's layout in memory
        (batch-first is a view of it, as torch's: a dropout after the layer then draws
        torch's mask for torch's output), and with ``weights`` those of the call,
        ``[B, H, L, S]`` (else ``None``)."""
        q, k, v = self._project(query, key, value, self_attention)  # [B, H, L|S, Dh]
        exact = self.spec.capabilities.attn_mask
        if self._appended_keys and exact:  # torch's keys and mask columns
            k, v = self._append_keys(k, v)
            key_padding_mask, attn_mask = (None if m is None else _with_columns(
                m, self._appended_keys, False) for m in (key_padding_mask, attn_mask))
        if not self._appended_keys:  # else the appended keys are real
            warn_if_every_key_is_torch_padding(f"{NAME} ({self.method})", key_padding_mask)
        b, _, lq, _ = q.shape
        appended = 0 if exact else self._appended_keys  # after the masks are read
        if 0 in (b, lq, k.shape[2] + appended):  # torch: empty, or the output projection of 0
            out = q.new_zeros(lq, b, self.embed_dim) + 0 * (q.sum() + k.sum() + v.sum())
            if self.method_state is not None:  # every parameter gets a gradient (DDP)
                out = out + 0 * sum(p.sum() for p in self.method_state.parameters())
            empty = q.new_zeros(b, self.num_heads, lq, k.shape[2]) if weights else None
            return self.out_proj(out), empty
        key_valid, padding_bias, allowed = _sdpa_masks(key_padding_mask, attn_mask,
                                                       self.num_heads)
        if self.spec.capabilities.attn_mask and hint_alone and lq == k.shape[2]:
            out, kept = self._exact(q, k, v, key_valid, None, generator, weights, causal=True)
        elif self.spec.capabilities.attn_mask and hint_alone:  # SDPA's top-left causal mask
            top_left = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            out, kept = self._exact(q, k, v, key_valid, top_left, generator, weights)
        elif self.spec.capabilities.attn_mask:
            out, kept = self._exact(q, k, v, key_valid, _joined(allowed, padding_bias, q.dtype),
                                    generator, weights)
        else:
            out, kept = self._approximate(q, k, v, key_valid, padding_bias, allowed, is_causal,
                                          self_attention, generator, weights)
        merged = out.permute(2, 0, 1, 3).reshape(lq, b, self.embed_dim)
        p = self._dropout()
        if p and not (self.spec.capabilities.attn_mask and self.spec.capabilities.weight_dropout):
            # the output's dropout, where the method's weights are not dropped: on the
            # merged heads (dropped before the merge, Skyformer's permuted output failed
            # in the backward that AOTAutograd compiles)
            merged = F.dropout(merged, p=p, training=True)
        return self.out_proj(merged), kept

    def _project(self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections split into heads, ``[B, H, N, Dh]`` each (one product
        for self-attention)."""
        if self_attention and self._qkv_same_embed_dim:
            projected = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        else:
            if self._qkv_same_embed_dim:
                weights = self.in_proj_weight.chunk(3)
            else:
                weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            biases = ((None,) * 3 if self.in_proj_bias is None
                      else self.in_proj_bias.chunk(3))
            projected = tuple(F.linear(x, w, bias) for x, w, bias in
                              zip((query, key, value), weights, biases, strict=True))
        return tuple(t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                     for t in projected)  # type: ignore[return-value]

    def _append_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """torch's ``add_bias_kv`` and ``add_zero_attn``: ``bias_k`` / ``bias_v`` (split
        into heads), then zeros, appended to ``k``, ``v`` ``[B, H, S, Dh]``."""
        b, h, _, dh = k.shape
        keys, values = [k], [v]
        if self.bias_k is not None:
            for appended, bias in ((keys, self.bias_k), (values, self.bias_v)):
                appended.append(bias.to(k.dtype).reshape(1, h, 1, dh).expand(b, h, 1, dh))
        if self.add_zero_attn:
            keys.append(k.new_zeros(b, h, 1, dh))
            values.append(v.new_zeros(b, h, 1, dh))
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def _check_appended_length(self, keys: int) -> None:
        """A fixed-length method's ``max_seq_len`` must hold the keys given and those
        appended: a sentence naming both where it does not."""
        limit = self.bound.options().get("max_seq_len")
        total = keys + self._appended_keys
        if self.spec.capabilities.fixed_length and isinstance(limit, int) and total > limit:
            raise CapabilityError(
                f"{NAME} ({self.method}): {keys} keys and the {self._appended_keys} that "
                f"{_appending(self._appended_names)} make {total}, but max_seq_len={limit}; "
                f"build the layer with seq_len={keys} (the keys passed: the layer adds those "
                f"it appends) instead of max_seq_len, or with max_seq_len={total}.")

    def _refuse_appended_causal(self) -> None:
        """A sentence for a causal call of an approximate method with appended keys."""
        raise ValueError(
            f"{NAME} ({self.method}): {_appending(self._appended_names)} keys that every "
            f"query attends, which the "
            f"causal form of {self.method} (query i with the keys up to i) cannot add; drop "
            f"is_causal=True and the causal attn_mask, or use method='softmax' or "
            f"'kernelized', which follow torch's masks with the appended keys.")

    def _dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def _exact(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None,
               mask: Tensor | None, generator: Any, weights: bool, causal: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """A method that takes any mask (``softmax``, ``kernelized``): torch's masks as
        they are, or its causal form alone (``causal``: torch's hint without its mask),
        every query real (torch's rows for padded queries); the output and, with
        ``weights``, the weights (dropped where the method drops weights; else
        ``_attend`` drops the output)."""
        arguments: dict[str, Any] = {} if mask is None else {"attn_mask": mask}
        bound = self.bound.replace(causal=True) if causal else self.bound
        p = self._dropout()
        weight_dropout = self.spec.capabilities.weight_dropout
        if p and weight_dropout:
            arguments["dropout_p"] = p
        out, kept = call_maybe_with_weights(bound, q, k, v, weights, key_padding_mask=key_valid,
                                            query_padding_mask=None, generator=generator,
                                            state=self.method_state, **arguments)
        return out, kept

    def _approximate(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None,
                     padding_bias: Tensor | None, allowed: Tensor | None, is_causal: bool,
                     self_attention: bool, generator: Any, weights: bool
                     ) -> tuple[Tensor, Tensor | None]:
        """A method that takes key padding and causal masks: torch's masks resolved into
        them (``functional.attn_mask_as_padding``), or a sentence. With the ``is_causal``
        hint the method runs its causal form and ``attn_mask`` is not read. The output
        and, with ``weights``, the weights (before the output's dropout)."""
        if padding_bias is not None:  # torch's layers hand a bool mask on as 0 / -inf
            real = self._real_keys(padding_bias[:, 0, 0, :])
            key_valid = real if key_valid is None else key_valid & real
        rows: Tensor | str | None = "auto" if self_attention else None  # cross: all real
        mask = None if is_causal else allowed
        causal = is_causal
        if mask is not None:
            key_valid, causal = attn_mask_as_padding(self.spec, mask, key_valid, rows, q, k,
                                                     causal, instead=self._mask_arguments())
        if causal and q.shape[2] != k.shape[2]:
            refuse_causal_lengths(self.spec, q.shape[2], k.shape[2])
        bound = self.bound.replace(**sdpa_options(self.spec, {}, causal, None,
                                                   self.head_dim))
        if self._appended_keys:  # after the keys given, every query attending them
            if causal:
                self._refuse_appended_causal()
            if self_attention:  # the queries: the keys given, padded as they are
                rows = key_valid
            self._check_appended_length(k.shape[2])
            k, v = self._append_keys(k, v)
            if key_valid is not None:
                key_valid = _with_columns(key_valid, self._appended_keys, True)
        out, kept = call_maybe_with_weights(bound, q, k, v, weights,
                                            key_padding_mask=key_valid, query_padding_mask=rows,
                                            generator=generator, state=self.method_state)
        return out, kept

    def _mask_arguments(self) -> str:
        """This layer's arguments for the masks its method takes (torch's conventions),
        for a sentence that refuses an ``attn_mask`` it cannot read."""
        caps = self.spec.capabilities
        arguments = [a for a, able in (
            ("a bool key_padding_mask [B, S] (True = padding) for padding", caps.mask),
            ("is_causal=True beside a causal attn_mask", caps.causal)) if able]
        return ", or ".join(arguments) or "no mask"

    def _real_keys(self, additive: Tensor) -> Tensor:
        """A float ``key_padding_mask`` ``[B, S]`` (0 = real key, -inf or a large
        negative = padding) as ``[B, S]`` bool, True = real; a sentence for other values
        (a bias, which an approximate method would leave out): read on the host in eager
        code and under ``torch.func`` (the values the transforms wrap), checked on the
        device in a compiled graph (``torch._assert_async``; under other tracers 0 is
        real and anything else padding)."""
        real = additive == 0
        sentence = (
            f"{NAME} ({self.method}): key_padding_mask holds additive values other than 0 "
            f"(a real key) and -inf or a large negative (padding): a bias, which "
            f"{self.method} cannot apply (it takes key padding and causal masks); pass a "
            f"bool mask (True = padding), or use method='softmax' or 'kernelized', "
            f"which take any mask.")
        values = values_to_check(additive)
        if values is not None:
            if not bool(((values == 0) | (values <= BLOCKED_LOGIT)).all()):
                raise ValueError(sentence)
        elif torch.compiler.is_compiling():
            torch._assert_async((real | (additive <= BLOCKED_LOGIT)).all(),
                                f"skyformer: {sentence} (checked at run time in a compiled "
                                f"model)")
        return real

    def _nested(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any,
                attn_mask: Any, generator: Any) -> Tensor:
        """Self-attention of a nested batch ``[B, j, E]`` (what ``nn.TransformerEncoder``'s
        sparsity path hands its layers): padded, attended with the padding as key
        padding, nested again."""
        if not (query is key is value) or key_padding_mask is not None \
                or attn_mask is not None or not self.batch_first:
            raise ValueError(
                f"{NAME} takes a nested tensor only as torch's fast path does: one batch-first "
                f"nested tensor as query, key and value (self-attention), without masks; pass "
                f"a padded tensor with a key_padding_mask instead.")
        lengths = [t.shape[0] for t in query.unbind()]
        x = query.to_padded_tensor(0.0)  # [B, Lmax, E]
        positions = torch.arange(x.shape[1], device=x.device)
        padding = positions >= torch.tensor(lengths, device=x.device)[:, None]  # [B, Lmax]
        self._check_shapes(x, x, x, padding, None)
        out = self._attend(x, x, x, padding, None, False, False, True, generator)[0].transpose(0, 1)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, lengths, strict=True)],
                                             layout=query.layout)

    def merge_masks(self, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                    query: Tensor) -> tuple[Tensor | None, int | None]:
        """torch's ``merge_masks``: the masks as one ``[B, H, L, L]`` mask and its type
        (torch's fused paths call it; this layer never takes them, its users may)."""
        return nn.MultiheadAttention.merge_masks(self, attn_mask,  # type: ignore[arg-type]
                                                 key_padding_mask, query)

    def _check_positions(self, query: Tensor, key: Tensor, value: Tensor, batched: bool
                         ) -> None:
        """A sentence, naming the shapes as passed, where key and value differ in length
        or batch, or differ from the query's batch."""
        layout = ("[B, L, E] (batch_first)" if self.batch_first else "[L, B, E]") \
            if batched else "[L, E] (one sequence)"
        batch = (0 if self.batch_first else 1) if batched else None
        same_batch = batch is None or query.shape[batch] == key.shape[batch]
        if key.shape[:-1] != value.shape[:-1] or not same_batch:
            raise ValueError(
                f"{NAME}: key and value must hold the same positions, in the query's batch; "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                f"{tuple(value.shape)}, laid out {layout}.")

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any,
                      attn_mask: Any, batched: bool = True) -> None:
        """A sentence for batch-first inputs or masks of the wrong width, length, batch or
        dtype: ``query: [B, L, E]``, ``key: [B, S, kdim]``, ``value: [B, S, vdim]``,
        ``key_padding_mask: [B, S]``, ``attn_mask: [L, S]`` or ``[B * H, L, S]``.
        ``batched=False``: one sequence, given with B = 1 added to it and to
        ``key_padding_mask``, whose sentence names the ``[S]`` that the caller passes."""
        weight = self.out_proj.weight
        for name, t, width, option in (("query", query, self.embed_dim, "embed_dim"),
                                       ("key", key, self.kdim, "kdim"),
                                       ("value", value, self.vdim, "vdim")):
            if t.shape[-1] != width:
                raise ValueError(f"{NAME}: {name} has {t.shape[-1]} features but the layer "
                                 f"projects {width} ({option}).")
            if t.dtype != weight.dtype and not autocast_enabled(t.device.type):
                raise TypeError(f"{NAME}: {name} is {t.dtype} but the layer's weights are "
                                f"{weight.dtype}; convert one of them ({name}.to("
                                f"{weight.dtype}) or layer.to({t.dtype})).")
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        shapes = {"key_padding_mask": [(b, lk)],
                  "attn_mask": [(lq, lk), (b * self.num_heads, lq, lk)]}
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and tuple(mask.shape) not in shapes[name]:
                expected, got = shapes[name], tuple(mask.shape)
                if not batched and name == "key_padding_mask":  # as passed: without B
                    expected, got = [shape[1:] for shape in expected], got[1:]
                raise ValueError(f"{NAME}: {name} must have shape "
                                 f"{' or '.join(str(list(s)) for s in expected)}, got "
                                 f"{list(got)} (torch.nn.MultiheadAttention's shapes).")
            if mask is not None and mask.device != query.device:
                raise ValueError(f"{NAME}: {name} is on {mask.device} but the inputs are on "
                                 f"{query.device}; pass {name}.to(query.device).")
            if mask is not None and mask.dtype not in (torch.bool, torch.float32, query.dtype) \
                    and not autocast_enabled(query.device.type):  # torch's SDPA refuses it
                raise TypeError(f"{NAME}: {name} is {mask.dtype} but the query is "
                                f"{query.dtype}; torch's layer takes a float mask in float32 "
                                f"or the query's dtype: pass {name}.to({query.dtype}) (or a "
                                f"bool mask, True = not attended).")

    def _warn_no_weights(self, need_weights: bool) -> None:
        """Warn, once per layer, that ``need_weights=True`` gets no weights (a layer
        built without ``return_weights``); in eager calls only: compiled code reads no
        flag (it became a guard, and an eager call setting it recompiled the graph)."""
        if torch.compiler.is_compiling():
            return
        if need_weights and not self.return_weights and not self._weights_warned:
            self._weights_warned = True
            instead = (f"build the layer with return_weights=True for the matrix "
                       f"{self.method} applies (its memory, [B, H, L, S], and time), "
                       if self.spec.capabilities.weights else "")
            warn_from_user_frame(
                f"{NAME} ({self.method}) returns (output, None): no method materialises the "
                f"attention matrix, so need_weights=True (torch's default) gets no weights; "
                f"pass need_weights=False to silence this, {instead}or keep "
                f"torch.nn.MultiheadAttention where the weights are read.", UserWarning)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              *args: Any) -> None:
        """A ``torch.nn.MultiheadAttention``'s state dict has no entries for the method's
        state: the layer then keeps its own (given as the entries), so that a strict load
        of torch's weights works for every method."""
        own = prefix + "method_state."
        if self.method_state is not None and not any(k.startswith(own) for k in state_dict):
            for name, t in self.method_state.state_dict(keep_vars=True).items():
                state_dict[own + name] = t  # load_state_dict hands its own copy
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.bound.options().items())
        shape = (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                 + ("" if self._qkv_same_embed_dim else f", kdim={self.kdim}, vdim={self.vdim}")
                 + f", batch_first={self.batch_first}, method={self.method!r}"
                 + (", add_bias_kv=True" if self.bias_k is not None else "")
                 + (", add_zero_attn=True" if self.add_zero_attn else "")
                 + (", return_weights=True" if self.return_weights else ""))
        return shape + (f", {options}" if options else "")


# torch's name, for ``from skyformer.torch_attention import MultiheadAttention``
MultiheadAttention = TorchMultiheadAttention


def _torch_int(value: Any) -> Any:
    """An integer of any type (``np.int64``, a 0-d integer tensor) as a Python int, as
    torch's layer takes it; anything else as it is, for the checks to name."""
    if isinstance(value, Tensor) and value.ndim == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    return value


def _check_configuration(embed_dim: Any, num_heads: Any, dropout: Any, bias: Any,
                         kdim: Any, vdim: Any, where: str) -> None:
    """A sentence for a configuration the layer cannot take; ``where`` names the layer."""
    check_layer_configuration(where, "embed_dim", embed_dim, num_heads, dropout, bias)
    for name, value in (("kdim", kdim), ("vdim", vdim)):
        check_positive_int(f"{where}: {name}", value, optional=True)


def _appended_names(add_bias_kv: bool, add_zero_attn: bool) -> list[str]:
    """Those of ``add_bias_kv`` and ``add_zero_attn`` that are set, by name."""
    return [name for name, on in (("add_bias_kv", add_bias_kv),
                                  ("add_zero_attn", add_zero_attn)) if on]


def _appending(names: list[str]) -> str:
    """``"add_bias_kv appends"`` or ``"add_bias_kv and add_zero_attn append"``."""
    return f"{' and '.join(names)} append{'' if len(names) > 1 else 's'}"


def _refuse_process_group(method_options: dict[str, Any]) -> None:
    """A sentence for ``process_group``, which would read as a misspelt method option."""
    if "process_group" in method_options:
        raise TypeError(f"{NAME} attends within one process and takes no process_group; "
                        f"sequence parallelism is skyformer.MultiHeadAttention's "
                        f"(process_group=...; docs/distributed.md).")


def _check_appended_keys(bound: BoundMethod, names: list[str], where: str) -> None:
    """Appended keys (``names``) make the queries fewer than the keys: a sentence where
    the method, or its options (the config's ``not_cross_attention_because``), attend
    only as many queries as keys."""
    if not names:
        return
    spec, because = bound.method, getattr(bound.config, "not_cross_attention_because", None)
    if because is not None:
        raise CapabilityError(
            f"{where}: {_appending(names)} keys, so that the queries meet more keys than "
            f"there are queries, which {spec.name} cannot attend with these options "
            f"({because}); leave out that option or {' and '.join(names)}.")
    if not spec.capabilities.cross_attention:
        raise CapabilityError(
            f"{where}: {_appending(names)} keys, so that the queries meet more keys than "
            f"there are queries, which {spec.name} cannot attend (self-attention only); use "
            f"a method that takes other numbers of queries and keys: "
            f"{', '.join(methods_that_can('cross_attention'))}.")


def _check_return_weights(return_weights: Any, bound: BoundMethod, where: str) -> bool:
    """``return_weights`` where it is a bool the layer's method can honour, else a
    sentence."""
    if not isinstance(return_weights, bool):
        raise TypeError(f"{where}: return_weights must be True or False, got "
                        f"{return_weights!r}.")
    if return_weights:
        check_weights(bound.method.name, f"{where}: return_weights=True, but ")
    return return_weights


def _check_call(query: Any, key: Any, value: Any, key_padding_mask: Any, attn_mask: Any,
                is_causal: Any) -> bool:
    """A sentence for a call torch would refuse (dimensions, mask dtypes, ``is_causal``
    without a mask); returns whether the call is batched (3-D)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{NAME}: {name} must be a tensor, got {type(t).__name__}.")
    batched = query.dim() == 3
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"{NAME}: query, key and value must all be 3-D (batched: [L, B, E], "
                         f"or [B, L, E] with batch_first) or all 2-D (one sequence: [L, E]), "
                         f"got {query.dim()}-D, {key.dim()}-D and {value.dim()}-D.")
    for name, mask, dims in (("key_padding_mask", key_padding_mask, (2 if batched else 1,)),
                             ("attn_mask", attn_mask, (2, 3))):
        if mask is None:
            continue
        if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool
                                                or mask.is_floating_point()):
            what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{NAME}: {name} must be a bool tensor (True = not attended) or "
                            f"a float one (added to the scores), got {what}.")
        if mask.dim() not in dims:
            raise ValueError(f"{NAME}: {name} must be {' or '.join(map(str, dims))}-D for a "
                             f"{query.dim()}-D query, got {mask.dim()}-D.")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{NAME}: is_causal must be True or False, got {is_causal!r}.")
    if is_causal and attn_mask is None:
        raise ValueError(f"{NAME}: is_causal=True is a hint that attn_mask is the causal mask, "
                         f"and torch.nn.MultiheadAttention needs the mask with it; pass "
                         f"attn_mask=nn.Transformer.generate_square_subsequent_mask(L) too.")
    return batched


def _sdpa_masks(key_padding_mask: Tensor | None, attn_mask: Tensor | None, heads: int
                ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """torch.nn.MultiheadAttention's masks in SDPA's convention.

    Returns ``key_valid`` (``[B, S]`` bool, True = real token, from a bool
    ``key_padding_mask``), ``padding_bias`` (``[B, 1, 1, S]``, a float
    ``key_padding_mask``) and ``allowed`` (``[1, 1, L, S]`` or ``[B, H, L, S]``: bool,
    True = may attend, or float, added to the scores), each ``None`` where not given.
    """
    key_valid = padding_bias = allowed = None
    if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
        key_valid = ~key_padding_mask
    elif key_padding_mask is not None:
        padding_bias = key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        lq, lk = attn_mask.shape[-2:]
        allowed = attn_mask.reshape(-1 if attn_mask.dim() == 3 else 1,
                                    heads if attn_mask.dim() == 3 else 1, lq, lk)
        if allowed.dtype == torch.bool:
            allowed = ~allowed
    return key_valid, padding_bias, allowed


def _with_columns(mask: Tensor, n: int, fill: bool) -> Tensor:
    """``mask [..., S]`` with ``n`` columns of ``fill`` (``False``/``0`` or ``True``, in
    its dtype) appended: the appended keys' entries."""
    return torch.cat([mask, mask.new_full((*mask.shape[:-1], n), fill)], dim=-1)


def _joined(a: Tensor | None, b: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Two SDPA-style masks as one (both apply): ``&`` of bool masks, else the sum of
    their additive forms, as torch adds its masks."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return _additive(a, dtype) + _additive(b, dtype)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as 0 / -inf in ``dtype``; a float one as it is."""
    if mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def _from_torch(cls: type[TorchMultiheadAttention], mha: Any, where: str, method: str,
                seq_len: int | None, options: dict[str, Any]) -> TorchMultiheadAttention:
    """``TorchMultiheadAttention.from_torch``, its sentences naming ``where``; ``mha`` is
    torch's layer, or one of this module's, rebuilt in its own class with its weights
    kept, and its method's state too where the method and its options are unchanged
    (``return_weights`` switched), else left behind."""
    if not isinstance(mha, (nn.MultiheadAttention, TorchMultiheadAttention)):
        raise TypeError(f"{where}: expected a torch.nn.MultiheadAttention, got "
                        f"{type(mha).__name__}.")
    if isinstance(mha, nn.MultiheadAttention) and type(mha) is not nn.MultiheadAttention:
        kind = f"{type(mha).__module__}.{type(mha).__qualname__}"
        raise TypeError(
            f"{where}: {kind} is a subclass of torch.nn.MultiheadAttention whose forward may "
            f"differ from torch's; only if its forward is torch's, swap it by hand: "
            f"new = {NAME}(mha.embed_dim, mha.num_heads, mha.dropout, "
            f"mha.in_proj_bias is not None, mha.bias_k is not None, mha.add_zero_attn, "
            f"kdim=mha.kdim, vdim=mha.vdim, "
            f"batch_first=mha.batch_first, method=...); "
            f"new.load_state_dict(mha.state_dict()).")
    _check_configuration(_torch_int(mha.embed_dim), _torch_int(mha.num_heads), mha.dropout,
                         mha.in_proj_bias is not None, _torch_int(mha.kdim),
                         _torch_int(mha.vdim), where)  # torch took them as they are
    appended = _appended_names(mha.bias_k is not None, bool(mha.add_zero_attn))
    method_options = {k: v for k, v in options.items() if k != "return_weights"}
    _refuse_process_group(method_options)
    bound = get_method(method).bind(seq_len=seq_len, **method_options)
    _check_appended_keys(bound, appended, where)
    _warn_of_hooks(mha, where)
    if options.get("return_weights") is None:  # a layer swapped before keeps its own
        options = {**options, "return_weights": _kept_return_weights(mha, method, where)}
    _check_return_weights(options["return_weights"], bound, where)  # not the class's fault
    # one of these layers is rebuilt in its own class where that is cls or a subclass of
    # it: a subclass keeps its forward
    build = type(mha) if issubclass(type(mha), cls) else cls
    weight = mha.out_proj.weight
    try:
        layer = build(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None,
                      mha.bias_k is not None, mha.add_zero_attn, kdim=mha.kdim,
                      vdim=mha.vdim, batch_first=mha.batch_first,
                      device=weight.device, dtype=weight.dtype, method=method,
                      seq_len=seq_len, **options)
    except TypeError as err:
        if build is cls:
            raise
        raise TypeError(f"{where}: {build.__qualname__} could not be rebuilt with "
                        f"{NAME}'s arguments ({err}); give it a constructor that takes "
                        f"them, or swap it by hand.") from None
    # the output projection itself: hooks and parametrizations on it go on working
    layer.out_proj = mha.out_proj
    state = _kept_state(mha, layer, where)
    if state is not None:
        layer.method_state = state
    weights = {name: t for name, t in mha.state_dict().items()  # not another method's state
               if state is not None or not name.startswith("method_state.")}
    layer.load_state_dict(weights)  # checks the names and shapes
    # then takes the parameter objects themselves: an optimizer or a weight tied to
    # another module set up before the swap goes on training and sharing them
    for name, p in mha.named_parameters(remove_duplicate=False):
        if not name.startswith(("method_state.", "out_proj.")):
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner), attr, p)
    return layer.train(mha.training)


def _kept_state(mha: nn.Module, layer: TorchMultiheadAttention, where: str
                ) -> nn.Module | None:
    """The per-layer state of ``mha`` (the module itself: an optimizer goes on with it)
    where ``layer`` runs the same method with the same options; ``None`` otherwise, with
    a warning where the same method's learned parameters or random draws (Performer's
    features, which the model may have been trained with) are left behind."""
    old = getattr(mha, "method_state", None)
    if not isinstance(mha, TorchMultiheadAttention) or old is None:
        return None
    same = mha.bound.method.base_name == layer.bound.method.base_name
    if same and mha.bound.config == layer.bound.config:  # a variant's name or options alike
        return old
    learned = any(p.requires_grad for p in old.parameters())
    if same and (learned or any(True for _ in old.buffers())):
        what = "learned per-layer parameters" if learned else "per-layer random draws"
        warnings.warn(f"{where} ran {mha.bound.name} with other options: its {what} are "
                      f"left behind and the new layer's are drawn anew.", UserWarning,
                      stacklevel=4)
    return None


def _kept_return_weights(mha: nn.Module, method: str, where: str) -> bool:
    """The ``return_weights`` of a layer swapped before, where ``method`` has weights to
    return; a warning where it has none (the layer then returns ``None`` again)."""
    kept = bool(getattr(mha, "return_weights", False))
    if kept and not get_method(method).capabilities.weights:
        warnings.warn(f"{where} was built with return_weights=True, but {method} has no "
                      f"attention matrix (its output is not linear in V): the new layer "
                      f"returns (output, None).", UserWarning, stacklevel=4)
        return False
    return kept


def _warn_of_hooks(mha: nn.Module, where: str) -> None:
    """Hooks registered on a layer being swapped stay on it, not on its replacement."""
    own = 1 if isinstance(mha, TorchMultiheadAttention) else 0  # the fast-path decline
    if len(mha._forward_hooks) + len(mha._forward_pre_hooks) > own \
            or mha._backward_hooks or mha._backward_pre_hooks:
        warnings.warn(f"{where} has hooks registered on it; they stay on the layer swapped "
                      f"out: register them again on the new one.", UserWarning, stacklevel=4)


ModelT = TypeVar("ModelT", bound=nn.Module)


@overload
def replace_attention(model: nn.MultiheadAttention, method: str = ..., *,
                      seq_len: int | None = ..., return_weights: bool | None = ...,
                      **method_options: Any) -> TorchMultiheadAttention: ...


@overload
def replace_attention(model: ModelT, method: str = ..., *, seq_len: int | None = ...,
                      return_weights: bool | None = ..., **method_options: Any) -> ModelT: ...


def replace_attention(model: nn.Module, method: str = "skyformer", *,
                      seq_len: int | None = None, return_weights: bool | None = None,
                      **method_options: Any) -> nn.Module:
    """Swap every ``torch.nn.MultiheadAttention`` inside ``model`` for a
    ``TorchMultiheadAttention`` running ``method``, in place; one already swapped is
    rebuilt in its own class with ``method`` (its weights kept, and its method's state
    where the method and its options are the same), so a model can go from one method
    to another, ``"softmax"`` included.

    Each keeps its parameters (the same objects: an optimizer or a tied weight set up
    before the swap goes on with them; ``out_proj`` is the module itself, its hooks and
    parametrizations kept), training mode, device and dtype (``from_torch``); a layer
    shared by several parents is swapped for one new layer.
    Every layer is checked before any is swapped: one it cannot take (a subclass of
    torch's layer; appended keys for a self-attention-only method) fails in a sentence
    naming the module's path, and the model is left as it was. An unknown method fails
    at once; a model without such a layer is returned with a warning; hooks registered
    on a layer swapped out stay there (a warning), as learned per-layer parameters of
    the same method run with other options do (a warning).

    Args:
        model: any module (a ``torch.nn.MultiheadAttention`` itself is returned swapped).
        method, seq_len, return_weights, **method_options: as
            ``TorchMultiheadAttention``'s (``return_weights=None``: a layer swapped
            before keeps its own, a torch layer gets ``False``).
    Returns:
        ``model``.

    Example::

        model = replace_attention(model, "skyformer", num_features=128)
    """
    get_method(method)  # an unknown name fails even where there is nothing to swap
    method_options = {"return_weights": return_weights, **method_options}
    swappable = (nn.MultiheadAttention, TorchMultiheadAttention)
    if isinstance(model, swappable):
        return _from_torch(TorchMultiheadAttention, model, "replace_attention: model",
                           method, seq_len, method_options)
    sites = [(parent, name, f"{path}.{name}" if path else name, child)
             for path, parent in model.named_modules(remove_duplicate=False)
             for name, child in parent._modules.items()
             if isinstance(child, swappable)]
    if not sites:
        warnings.warn(f"replace_attention: {type(model).__name__} holds no "
                      f"torch.nn.MultiheadAttention; nothing was swapped.", UserWarning,
                      stacklevel=2)
    new: dict[int, TorchMultiheadAttention] = {}
    for _, _, path, child in sites:
        if id(child) not in new:
            new[id(child)] = _from_torch(TorchMultiheadAttention, child,
                                         f"replace_attention: model.{path}", method, seq_len,
                                         method_options)
    for parent, name, _, child in sites:
        setattr(parent, name, new[id(child)])
    _warn_mixed_queries_in_decoders(method, sites)
    return model


def _warn_mixed_queries_in_decoders(method: str, sites: list) -> None:
    """Warn where a method whose outputs mix the queries went into the cross-attention
    of ``nn.TransformerDecoderLayer``: in a causal decoder (teacher forcing) the later
    queries are later target tokens, so a position would see them. Whether a decoder is
    causal shows only in its call (``tgt_mask``), so this warns rather than refuses."""
    if get_method(method).capabilities.independent_queries:
        return
    paths = [f"model.{path}" for parent, name, path, _ in sites
             if isinstance(parent, nn.TransformerDecoderLayer) and name == "multihead_attn"]
    if not paths:
        return
    able = ", ".join(methods_that_can("independent_queries"))
    warnings.warn(
        f"replace_attention: {', '.join(paths)} {'is' if len(paths) == 1 else 'are'} the "
        f"cross-attention of nn.TransformerDecoderLayer, and {method}'s outputs mix the "
        f"queries (landmarks, clusters or samples drawn from all of them): in a causal "
        f"decoder (tgt_is_causal, teacher forcing) a position would see the target tokens "
        f"after it. There, swap the encoder and each decoder layer's self_attn alone "
        f"(replace_attention(model.encoder, ...); layer.self_attn = "
        f"replace_attention(layer.self_attn, ...)), or use a method whose outputs use their "
        f"own query alone ({able}). In a decoder whose queries are not in order (DETR's "
        f"object queries) it does no harm.", UserWarning, stacklevel=3)
