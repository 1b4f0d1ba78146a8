"""Sequence-parallel attention: one sequence sharded along N over a process group.

Each rank passes its contiguous shard of the sequence and gets its shard of the output;
the ranks exchange only tensors whose size does not depend on N (``forms.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..ops.shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    check_generator,
    resolve_key,
)
from ..registry import BoundMethod, get_method
from ..registry.autocast import autocast_rule
from ..registry.guard import show_nonfinite, zero_padding
from .forms import form_of
from .layout import (
    agree_layout,
    failing_together,
    recorded_gradients,
    resolve_group,
    rows_fingerprint,
)
from .reduction import GroupReduction


def sequence_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str = "skyformer",
    *,
    group: Any = None,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Self-attention of a sequence whose rows are sharded over the ranks of ``group``.

    Equal, for the same generator seed, to ``skyformer.attention`` on the whole
    sequence (the concatenation of the shards in rank order), up to the order of
    floating-point sums; so are the gradients. Every rank of the group must call it,
    and backpropagate through its output when any rank does (the backward pass
    all-reduces too; a rank whose rows are not in the loss adds ``0 * out.sum()``).

    Args:
        q, k, v: this rank's shard ``[B, H, N_r, D]`` (``v``: ``[B, H, N_r, Dv]``) of the
            sequence; shards are contiguous, in rank order, of any lengths N_r >= 1; B, H,
            D, Dv and dtype the same on every rank.
        method: ``skyformer``, ``nystrom_softmax``, ``linear`` or ``performer``
            (``causal=True`` too).
        group: a ``torch.distributed`` process group (``None`` = the default group).
        key_padding_mask: this rank's shard ``[B, N_r]`` of the mask (True = real token),
            or None; it marks padded queries too.
        generator: the method's randomness, seeded alike on every rank (each rank draws
            from its own; the group's first rank's draw is used by all).
        **options: the method's options (e.g. ``num_features=128``).
    Returns:
        ``[B, H, N_r, Dv]``: this rank's rows of the output.
    """
    with failing_together(f"{method} (sequence parallel)", group):
        form_of(method)
        bound = get_method(method).bind(**options)
    return run_sequence_parallel(bound, q, k, v, group=group,
                                 key_padding_mask=key_padding_mask, generator=generator)


def run_sequence_parallel(
    bound: BoundMethod, q: Tensor, k: Tensor, v: Tensor, *, group: Any = None,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | Tensor | None = None, **state_arguments: Any,
) -> Tensor:
    """``sequence_parallel_attention`` for a bound method (``MultiHeadAttention`` calls
    this); ``state_arguments`` from the layer's method state (e.g. Performer's features),
    which must be the same on every rank. Under ``torch.autocast`` the inputs are cast
    and the method runs with its own precision choices, as in one process
    (``registry/autocast.py``)."""
    name = bound.name
    caller = f"{name} (sequence parallel)"
    group = resolve_group(group, caller)
    info: AttentionInputs | None = None
    key = error = rows = None
    gradients = 0
    try:  # a rank that fails a check still joins the exchange (layout.py)
        form = form_of(name)
        form.check(bound.config)
        bound.method.check_call(q, k, key_padding_mask)
        if isinstance(q, Tensor) and q.dim() == 4 and q.shape[2] == 0:  # not "skip the call"
            raise ValueError(f"{caller}: this rank's shard of the sequence is empty; every "
                             f"rank of the group needs at least one row (shard_bounds(N, P, "
                             f"rank) splits N >= P rows).")
        info = check_attention_inputs(q, k, v, key_padding_mask, method=name)  # a DTYPES one
        if info.query_len != info.key_len:
            raise ValueError(
                f"{caller}: q and k must be shards of one sequence (self-attention), got "
                f"{info.query_len} query rows and {info.key_len} key rows on this rank.")
        if bound.method.capabilities.randomized:  # a layer's fixed draws need no key
            key = resolve_key(name, generator, q.device, needed=not state_arguments)
            if key is not None and key.shape != (2,):
                raise ValueError(f"{caller}: pass one random key [2] (or a generator), got "
                                 f"shape {tuple(key.shape)}.")
        else:
            check_generator(name, generator, q.device)
        gradients = recorded_gradients(q, k, v)
        q, k, v, precision = autocast_rule(q, k, v)
        rows = rows_fingerprint(q, k, v)
    except Exception as failure:
        error = failure
    layout = agree_layout(caller, q, v, None if info is None else info.key_valid, key, error,
                          group, call=f"{bound.method.base_name} {bound.config!r}",
                          draws=state_arguments, gradients=gradients, rows=rows)
    assert info is not None
    with precision:
        # padded rows never matter, whatever they hold, and non-finite real inputs mark
        # the rows they reach on every process (registry/guard.py), as in every call
        q, k, v = zero_padding(q, k, v, key_padding_mask, "auto")
        reduction = GroupReduction(group)
        out = form.run(q, k, v, bound.config, info, layout, reduction, **state_arguments)
        causal = getattr(bound.config, "causal", False) is True
        return show_nonfinite(out, q, k, v, key_padding_mask, "auto", causal=causal,
                              key_sums=reduction.sum,
                              keys_before=lambda sums: reduction.earlier(sums).sum(0))
