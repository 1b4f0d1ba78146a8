"""One layer's decoding state: attention of new tokens to every token seen so far.

A ``DecodingState`` is the cache of one attention layer during autoregressive decoding.
``step(q, k, v)`` takes the queries, keys and values of the next ``n`` positions
(``[B, H, n, D]``) and returns their outputs ``[B, H, n, Dv]``, equal (to rounding) to
rows ``t .. t + n - 1`` of the method's full causal forward over all ``t + n`` positions
with the same random key. The first step (the prompt) *is* that forward; later steps
extend what the state keeps. What it keeps, per form (``forms.py``):

- prefix-sum forms (``linear``, ``performer``): the m x (Dv + 1) sums of the keys'
  features times [v, 1]; constant in the length;
- ``skyformer``, ``nystrom_softmax``: the landmark rows, L^-1, the m x Dv kernel sums of
  the completed chunks
  and the keys of the current chunk (at most 63); constant once every landmark slot is
  revealed (m R tokens), before which it also keeps the earlier keys, which a slot
  revealed later needs (``ops/skyformer/README.md``, "Decoding");
- the exact methods (and any causal method without a form): the keys and values,
  O(length) (``keys.py``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from contextlib import nullcontext

import torch
from torch import Tensor

from ..linalg.tracing import may_read_values
from ..ops.shared.inputs import resolve_key
from ..registry.autocast import autocast_rule
from ..registry.guard import zero_padding


class DecodingState(ABC):
    """The decoding cache of one layer (module docstring).

    Subclasses name their batch-first tensors in ``batched`` (for ``reorder``) and
    implement ``_first`` (the prompt: the full causal forward, then the state) and
    ``_extend`` (later steps).
    """

    batched: tuple[str, ...] = ()
    # how the caller makes a new state, named where a step does not fit this one
    # (None: ``layer.new_cache()`` for a layer's cache, else ``new_decoding_state``)
    restart_advice: str | None = None

    def __init__(self, method: str, generator: torch.Generator | Tensor | None = None) -> None:
        self.method = method
        self.generator = generator
        self.key: Tensor | None = None  # the random key of every step, fixed at the first
        self.length = 0  # positions seen
        self.spoiled: Tensor | None = None  # [B, H] bool: a real key or value was non-finite
        self.layout: tuple | None = None  # (H, D, Dv, dtype, device) of the first step

    def __deepcopy__(self, memo: dict[int, object]) -> DecodingState:
        """A copy to continue one prompt twice; refused in a sentence (torch's names
        ``weight_norm``) where the state holds the graph of steps decoded with autograd
        on, since torch copies no tensor that is not a graph leaf."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            if isinstance(value, Tensor) and not value.is_leaf:
                raise RuntimeError(
                    f"this {self.method} decoding state cannot be copied: its steps ran "
                    f"with autograd on, and it holds their graph (torch copies no tensor "
                    f"that is not a graph leaf); decode under torch.inference_mode() (or "
                    f"torch.no_grad()) to copy it.")
            vars(copied)[name] = copy.deepcopy(value, memo)
        return copied

    def step(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None = None
             ) -> Tensor:
        """Outputs of the next ``n`` positions.

        Args:
            q, k: ``[B, H, n, D]``; v: ``[B, H, n, Dv]`` of positions
                ``length .. length + n - 1``.
            key_valid: ``[B, n]`` bool, True = real token (padding, e.g. of a left-padded
                prompt); ``None`` = all real. A padded position's output row is zero.
        Returns:
            ``[B, H, n, Dv]`` in the dtype of ``q`` (under ``torch.autocast``, q, k and v
            are cast to its dtype first and the step runs with autocast off, as the
            method's forward does: ``registry/autocast.py``). As in the forward
            (``registry/guard.py``): whatever padded positions hold changes no output,
            and the real rows that a non-finite real input reaches are NaN (its own row
            for a query, every row from its position on for a key or value).

        A step that raises leaves the state as it was (steps replace the state's
        tensors, never write into them, so the attributes before the step are kept by
        reference), with the random key it drew: the step can be given again.
        """
        precision = nullcontext()
        if isinstance(q, Tensor) and q.is_floating_point():  # a model's float32 rotary
            q, k, v, precision = autocast_rule(q, k, v)  # q, k beside autocast's v
        self._check(q, k, v, key_valid)
        before = dict(vars(self))
        try:
            with precision:
                return self._step(q, k, v, key_valid)
        except BaseException:
            key = self.key
            vars(self).clear()
            vars(self).update(before, key=key)
            raise

    def _step(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        if key_valid is not None and bool(key_valid.all()):
            key_valid = None
        q, k, v = zero_padding(q, k, v, key_valid, "auto")  # the states keep what they see
        if self.length == 0:
            if self.key is None:  # drawn once, kept by a first step that failed
                self.key = resolve_key(self.method, self.generator, q.device)
            out = self._first(q, k, v, key_valid)
            self.layout = _layout(q, v)
        else:
            out = self._extend(q, k, v, key_valid)
        self.length += q.shape[2]
        out = self._show_nonfinite(out, q, k, v, key_valid)
        self._own_storage()
        return out

    def _own_storage(self) -> None:
        """Copy out each kept tensor that is a view of a larger one (the last row of a
        step's ``[B, H, n, .]`` prefix sums, running maxima or non-finite marks): the view
        would keep the whole step's tensor alive, O(n) bytes that ``nbytes`` does not
        count, in a state whose size is promised independent of the steps' lengths."""
        for name, t in list(vars(self).items()):
            if isinstance(t, Tensor) and (t.untyped_storage().nbytes()
                                          > t.numel() * t.element_size()):
                setattr(self, name, t.clone())

    def _show_nonfinite(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                        key_valid: Tensor | None) -> Tensor:
        """``out`` with NaN in the real rows that a non-finite query of the row, or key or
        value of the row's position or an earlier one (of any step), reaches; the states'
        sums would hide some (a fallback to the mean of the values, a zero weight, one
        column). Padded inputs are zeros by then."""
        bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [B, H, n]
        spoiled = bad.cummax(-1).values
        if self.spoiled is not None:
            spoiled = spoiled | self.spoiled[..., None]
        self.spoiled = spoiled[..., -1]
        rows = spoiled | ~torch.isfinite(q).all(-1)
        if key_valid is not None:
            rows = rows & key_valid[:, None, :]
        return torch.where(rows[..., None], float("nan"), out)

    @abstractmethod
    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        """The first step: the full causal forward, then the state of its positions."""

    @abstractmethod
    def _extend(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        """A later step (``self.length`` positions already absorbed)."""

    def _check(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(f"{self.method} decoding: {name} must be a [B, H, n, D] "
                                 f"tensor, got {_shape(t)}.")
        if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"{self.method} decoding: q, k, v must share B, H and n (and q, k "
                             f"the head dim): got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}.")
        if q.shape[2] == 0:
            raise ValueError(f"{self.method} decoding: a step needs at least one position.")
        if key_valid is not None and (not isinstance(key_valid, Tensor)
                                      or key_valid.dtype != torch.bool
                                      or tuple(key_valid.shape) != (q.shape[0], q.shape[2])):
            got = (f"{key_valid.dtype} {_shape(key_valid)}" if isinstance(key_valid, Tensor)
                   else _shape(key_valid))
            raise ValueError(f"{self.method} decoding: key_valid must be a [B, n] = "
                             f"[{q.shape[0]}, {q.shape[2]}] bool tensor, got {got}.")
        if len({q.dtype, k.dtype, v.dtype}) > 1 or len({q.device, k.device, v.device}) > 1:
            raise TypeError(f"{self.method} decoding: q, k, v must share dtype and device, "
                            f"got {q.dtype}/{k.dtype}/{v.dtype} on "
                            f"{q.device}/{k.device}/{v.device}.")
        layout = getattr(self, "layout", None)  # None in a state pickled before it existed
        if self.length and layout is not None and _layout(q, v) != layout:
            h, d, dv, dtype, device = layout
            # a layer's cache (MultiHeadAttention.new_cache) holds the layer's token
            fresh = self.restart_advice or (
                "layer.new_cache()" if getattr(self, "layer", None) is not None
                else "new_decoding_state(...)")
            cause = (" (a dtype that changes between steps is most often autocast on for "
                     "some steps and off for others, or a layer moved with .to())"
                     if dtype != q.dtype else "")
            raise ValueError(
                f"{self.method} decoding: the state holds H={h} heads of D={d}, Dv={dv} in "
                f"{dtype} on {device}; this step has H={q.shape[1]}, D={q.shape[-1]}, "
                f"Dv={v.shape[-1]} in {q.dtype} on {q.device}. Give every step of a state "
                f"the same heads, head dims, dtype and device{cause}, or start a new one "
                f"({fresh}).")
        self.check_batch(q.shape[0])

    def check_batch(self, batch: int) -> None:
        """A sentence where a step of ``batch`` sequences does not fit the state's."""
        held = self.batch_size()
        if held is not None and batch != held:
            raise ValueError(f"{self.method} decoding: the state holds {held} sequences, the "
                             f"step has {batch}; reorder the state (reorder(index)) "
                             f"when the batch changes.")

    def batch_size(self) -> int | None:
        """B of the sequences held (None before the first step)."""
        for name in self.batched:
            t = getattr(self, name, None)
            if isinstance(t, Tensor):
                return t.shape[0]
        return None

    def reorder(self, index: Tensor) -> None:
        """Keep the sequences ``index`` (``[B']`` long, repeats allowed): beam search,
        several samples per prompt, dropping finished sequences."""
        if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in (
                torch.int64, torch.int32):
            raise ValueError(
                f"{self.method} decoding: reorder takes the indices of the sequences to keep, "
                f"a [B'] int64 tensor, got {_shape(index)}"
                f"{' ' + str(index.dtype) if isinstance(index, Tensor) else ''} (a boolean "
                f"selection: pass selection.nonzero().flatten()).")
        batch = self.batch_size()
        if batch is not None and index.numel() and may_read_values(index):
            low, high = int(index.min()), int(index.max())  # one read, before any change
            if low < 0 or high >= batch:
                bad = low if low < 0 else high
                raise ValueError(f"{self.method} decoding: the state holds {batch} sequences "
                                 f"(0 to {batch - 1}), got {bad} among the indices to keep.")
        for name in (*self.batched, "spoiled"):
            t = getattr(self, name, None)
            if isinstance(t, Tensor):
                setattr(self, name, t.index_select(0, index.to(t.device)))

    def nbytes(self) -> int:
        """Bytes of the tensors the state holds (the random key and fixed features
        included)."""
        return sum(t.numel() * t.element_size() for t in vars(self).values()
                   if isinstance(t, Tensor))


def _layout(q: Tensor, v: Tensor) -> tuple:
    """What every step of one state shares: (H, D, Dv, dtype, device)."""
    return q.shape[1], q.shape[-1], v.shape[-1], q.dtype, q.device


def _shape(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def padding_as_false(key_valid: Tensor | None, like: Tensor) -> Tensor:
    """``[B, n]`` bool, all True when ``key_valid`` is None."""
    if key_valid is not None:
        return key_valid
    return torch.ones(like.shape[0], like.shape[2], dtype=torch.bool, device=like.device)


def append(old: Tensor | None, new: Tensor, dim: int) -> Tensor:
    """``new`` after ``old`` along ``dim`` (``new`` alone when there is nothing yet)."""
    return new if old is None else torch.cat([old, new], dim)
