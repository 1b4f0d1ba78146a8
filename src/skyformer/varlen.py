"""Packed variable-length batches <-> padded batches with padding masks.

A packed batch holds B sequences one after the other, ``[1, H, T, E]`` (or ``[H, T, E]``;
not FlashAttention's ``[T, H, E]``, which ``.transpose(0, 1)`` turns into it: where
T == H that layout cannot be told from this one), with cumulative
lengths ``cu_seqlens = [0, n_0, n_0 + n_1, ..., T]`` (``[B + 1]``, as FlashAttention's
varlen API and transformers' packed-sequence path pass them). The methods run on the
padded form ``[B, H, max_len, E]`` with a key padding mask, where padding equals
truncation for every method, so each sequence attends only to itself.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import Tensor


def _check(cu_seqlens: object, x: Tensor, method: str, name: str = "cu_seqlens") -> Tensor:
    """``cu_seqlens`` (argument ``name``) as int64, checked against the packed tokens of
    ``x: [1, H, T, E]`` (their number and device)."""
    total = x.shape[2]
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = (f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
               if isinstance(cu_seqlens, Tensor) else repr(cu_seqlens))
        raise ValueError(
            f"{method}: {name} must be an int32 or int64 tensor [B + 1] of cumulative "
            f"sequence lengths starting at 0, got {got}."
        )
    if cu_seqlens.device != x.device:  # as FlashAttention's: the lengths index the tokens
        raise ValueError(
            f"{method}: {name} is on {cu_seqlens.device} but the inputs are on {x.device}; "
            f"pass {name}.to(q.device).")
    if torch.compiler.is_compiling():  # no host read while traced: checked on the device
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) \
            & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
        _assert_on_device(ok, f"{method}: {name} must rise from 0 to the packed length T")
    elif int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total \
            or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        layout = ""
        if int(cu_seqlens[-1]) == x.shape[1] > total:  # more "heads" than tokens
            layout = (f" The packed tokens lie along dim -2 ([1, H, T, E], or [H, T, E]): "
                      f"if the inputs are FlashAttention's packed [T, H, E] (here T = "
                      f"{x.shape[1]}, H = {total}), pass q.transpose(0, 1) (the same for k "
                      f"and v), or for [1, T, H, E] q.transpose(1, 2).")
        raise ValueError(f"{method}: {name} must rise from 0 to the packed length {total}, "
                         f"got {cu_seqlens.tolist()}.{layout}")
    return cu_seqlens.long()


def _assert_on_device(condition: Tensor, what: str) -> None:
    """``condition`` (a 0-d bool tensor) checked at run time by a compiled model, where
    the eager checks' host reads would break the graph (``torch._assert_async``: on CUDA
    a device-side assert, fatal to the process's CUDA context: docs/pytorch2.md)."""
    torch._assert_async(condition, f"skyformer: {what} (checked at run time in a compiled "
                        "model)")


def length_argument(value: object, method: str, argument: str, lengths: str) -> int | None:
    """``max_seqlen`` as an int: a Python or NumPy int, or a 0-d integer tensor (what
    transformers' packed path hands FlashAttention, ``cu_seqlens.diff().max()``). An int
    is taken as it is: under ``torch.compile`` ``operator.index`` would fix a symbolic
    one to its value (every new length compiled again)."""
    if value is None or isinstance(value, torch.SymInt):
        return value
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    elif not isinstance(value, bool | Tensor | int):
        with contextlib.suppress(TypeError):  # a NumPy int; anything else is refused below
            value = operator.index(value)  # type: ignore[arg-type]
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{method}: {argument} must be at least 0 (the longest "
                             f"sequence's length), got {value}.")
        return value
    raise ValueError(f"{method}: {argument} must be an int (the longest sequence's "
                     f"length) or None (read from {lengths}), got {value!r}.")


def _slots(cu_seqlens: Tensor, total: int, max_len: int) -> Tensor:
    """The padded slot ``b * max_len + offset`` of every packed token ``[T]``."""
    position = torch.arange(total, device=cu_seqlens.device)
    ends = cu_seqlens[1:].contiguous()  # torch warns of a strided boundary (a [::2] view)
    seq = torch.searchsorted(ends, position, right=True)  # [T]
    return seq * max_len + position - cu_seqlens[seq]


def check_longest(cu: Tensor, max_len: int, method: str, argument: str = "max_seqlen"
                  ) -> None:
    """Refuse a ``max_len`` (argument ``argument``) shorter than a sequence of the
    checked cumulative lengths ``cu``, whose tokens would overwrite the next sequence's
    padded slots: read on the host in eager code (as ``_check`` reads them), on the
    device while traced."""
    advice = "pass the longest length (or None to read it from them)"
    if torch.compiler.is_compiling():
        _assert_on_device((cu[1:] - cu[:-1]).max() <= max_len,  # no symbol in the text
                          f"{method}: {argument} is shorter than a sequence of the "
                          f"cumulative lengths; {advice}")
        return
    longest = int((cu[1:] - cu[:-1]).max())
    if longest > max_len:
        raise ValueError(f"{method}: {argument} is {max_len} but the cumulative lengths hold "
                         f"a sequence of {longest} tokens; {advice}.")


def unpack(x: Tensor, cu_seqlens: Tensor, max_len: int | None, method: str,
           argument: str = "max_seqlen", lengths: str = "cu_seqlens") -> tuple[Tensor, Tensor]:
    """``x: [1, H, T, E]`` -> ``([B, H, max_len, E], valid [B, max_len])``; ``max_len``
    ``None`` reads the longest length from ``cu_seqlens`` (a host sync). ``argument`` and
    ``lengths``: the names of ``max_len`` and ``cu_seqlens`` that errors give."""
    if x.shape[0] != 1:
        raise ValueError(f"{method}: a packed batch has batch size 1 ([1, H, T, E]), got "
                         f"{tuple(x.shape)}.")
    h, total, e = x.shape[1:]
    cu = _check(cu_seqlens, x, method, lengths)
    batch = cu.numel() - 1
    max_len = length_argument(max_len, method, argument, lengths)
    if max_len is None:
        max_len = max(1, int((cu[1:] - cu[:-1]).max()))
    else:
        check_longest(cu, max_len, method, argument)
    max_len = torch.sym_max(1, max_len)  # every sequence empty: one slot, as None gives
    slots = _slots(cu, total, max_len)
    rows = x[0].transpose(0, 1)  # [T, H, E]
    padded = rows.new_zeros(batch * max_len, h, e).index_copy(0, slots, rows)
    valid = torch.zeros(batch * max_len, dtype=torch.bool, device=x.device)
    valid = valid.index_fill(0, slots, True)
    return padded.view(batch, max_len, h, e).transpose(1, 2), valid.view(batch, max_len)


def pack(out: Tensor, cu_seqlens: Tensor, total: int) -> Tensor:
    """``[B, H, max_len, E]`` -> the packed ``[1, H, T, E]`` (inverse of ``unpack``)."""
    b, h, max_len, e = out.shape
    slots = _slots(cu_seqlens.long(), total, max_len)
    rows = out.transpose(1, 2).reshape(b * max_len, h, e).index_select(0, slots)  # [T, H, E]
    return rows.transpose(0, 1)[None]
