"""The process group and where this process's shard lies in the sequence.

Each rank holds a contiguous shard ``[B, H, N_r, D]`` of the sequence (ranks in group
order, shards of any lengths). Before anything else the ranks exchange, in two
all-gathers of a few integers each, whether their inputs passed the checks, their
shapes (which must agree but for N_r), a fingerprint of the method and its options and
one of a layer's fixed draws (which must agree), their random keys (the first rank's is
used by all), a fingerprint of their shards' first and last rows (equal on every rank
when each passed the whole sequence instead of its shard: a warning), and their
valid-row counts per batch element: from these every rank knows
the sequence's length and where its rows lie among the valid rows, which is all the
landmark draw needs (``landmarks.py``). A rank whose inputs fail a check still takes
part in the exchange (``failing_together``), so that every rank raises instead of
waiting for it forever.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from ..registry.guard import MASK_CONVENTION
from ..user_frame import warn_from_user_frame
from .collectives import all_gather

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("B", "H", "D", "Dv", "dtype")
# B, H, D, Dv, dtype, N_r, key (2), call and draws fingerprints, gradients, rows fingerprint
_HEADER = 12
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class ShardLayout:
    """This rank's shard of a sequence held by the ranks of ``group``."""

    group: Any
    rank: int  # in the group
    world: int
    rows_before: int  # rows of the sequence on the ranks before this one
    total_rows: int  # N, the whole sequence
    valid_before: Tensor  # [B] long: valid rows before this shard, per batch element
    key: Tensor  # [2] the random key every rank uses
    valid_counts: Tensor  # [P, B] long: each rank's valid rows, per batch element
    unpadded_before: bool  # every row of the ranks before this one is valid


def resolve_group(group: Any, caller: str,
                  alone: str = "run without sequence parallelism where one process holds "
                               "the sequence (skyformer.attention, or a layer built without "
                               "process_group)") -> Any:
    """``group`` (``None`` = the default group), checked to be usable by this process;
    ``alone``: what the caller does without torch.distributed, for the sentence where
    it is not initialised (never, or destroyed already)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialised (or its process group was "
            f"destroyed already); call torch.distributed.init_process_group(...) first "
            f"(torchrun sets the environment it reads), or {alone}.")
    group = dist.group.WORLD if group is None else group
    # new_group(ranks) hands a process outside ranks this marker, not a group
    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    if not outside and not isinstance(group, dist.ProcessGroup):  # a list of ranks, a rank
        raise TypeError(f"{caller}: group must be a torch.distributed process group "
                        f"(torch.distributed.new_group(ranks), or None for all processes), "
                        f"got {type(group).__name__} {group!r}.")
    if outside or dist.get_rank(group) < 0:
        raise ValueError(f"{caller}: this process is not a member of the process group it "
                         f"was given; pass a group that contains it (or None for all).")
    return group


def comm_device(group: Any) -> torch.device:
    """Where collective buffers live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_layout(
    caller: str, q: Tensor, v: Tensor, key_valid: Tensor | None, key: Tensor | None,
    error: Exception | None, group: Any, call: str = "", draws: Mapping[str, Tensor] = {},
    gradients: int = 0, rows: Tensor | None = None,
) -> ShardLayout:
    """Exchange checks, shapes, keys and valid counts; raise the same failure everywhere.

    ``error``: this rank's own failed check (re-raised here, after the exchange), else
    ``q: [B, H, N_r, D]``, ``v: [B, H, N_r, Dv]``, ``key_valid: [B, N_r]`` or None,
    ``key: [2]`` (or None for deterministic methods), ``call``: the method and its
    resolved options as text, and ``draws``: the fixed random draws the call runs with
    (a layer's Performer features), and ``gradients``: which of q, k, v the call records
    for a backward pass (``recorded_gradients``); all must be the same on every rank.
    ``rows``: the shard's ``rows_fingerprint`` (None: not compared).
    """
    device = comm_device(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    header = torch.full((_HEADER,), -1, dtype=torch.long)
    if error is None:
        b, h, n, d = q.shape
        header[:6] = torch.tensor([b, h, d, v.shape[-1], DTYPES.index(q.dtype), n])
        if key is not None:
            header[6:8] = key.cpu()
        header[8] = zlib.crc32(call.encode())
        header[10] = gradients
        header = header.to(device)
        header[9] = fingerprint(draws.values()).to(device)
        if rows is not None:
            header[11] = rows.to(device)
    headers = all_gather(header.to(device), group).cpu()  # [P, _HEADER]
    if error is not None:
        raise error
    failed = [r for r in range(world) if headers[r, 0] < 0]
    if failed:
        raise ValueError(f"{caller}: rank(s) {failed} of the group rejected their inputs "
                         f"(see the error raised there); every rank stops.")
    shapes = headers[:, :5]
    if not (shapes == shapes[0]).all():
        said = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(shapes.tolist()))
        raise ValueError(
            f"{caller}: every rank must pass shards with the same batch size B, heads H, head "
            f"dims D and Dv and dtype (only the sequence length may differ), got {said}.")
    if not (headers[:, 8] == headers[0, 8]).all():
        raise ValueError(
            f"{caller}: every rank must call the same method with the same options; rank(s) "
            f"{_differing(headers[:, 8])} differ from rank 0 (this rank, {rank}: {call}).")
    if not (headers[:, 9] == headers[0, 9]).all():
        raise ValueError(
            f"{caller}: the layer's fixed random draws ({', '.join(draws)}) differ between "
            f"ranks: rank(s) {_differing(headers[:, 9])} differ from rank 0. Build the layers "
            f"alike on every rank (the same seed) or broadcast their buffers as well as their "
            f"parameters (DistributedDataParallel does, with broadcast_buffers=True), and call "
            f"them in the same mode (a layer in training on one rank and in eval on another "
            f"redraws Performer's features at other calls).")
    _check_gradients_alike(caller, headers[:, 10])
    lengths = headers[:, 5]
    if world > 1 and rows is not None and (headers[:, 11] == headers[0, 11]).all() \
            and (lengths == lengths[0]).all():
        warn_from_user_frame(
            f"{caller}: every rank of the group passed the same {int(lengths[0])} rows of "
            f"q, k and v (their first and last rows are equal on all {world} ranks), as "
            f"when each passes the whole sequence: each rank passes its own contiguous "
            f"shard (skyformer.distributed.shard_bounds(N, world_size, rank) gives its "
            f"rows), and the output is that of the shards concatenated, here {world} copies "
            f"of these rows. (Shards of a sequence whose rows are all alike, torch.ones, "
            f"look the same: then nothing is wrong.)", RuntimeWarning)
    b = int(shapes[0, 0])
    counts = torch.full((b,), q.shape[2], dtype=torch.long) if key_valid is None \
        else key_valid.sum(dim=1).cpu()
    every = all_gather(counts.to(device), group).cpu()  # [P, B]
    if every.numel() and not every.any():  # read on the host already
        warn_from_user_frame(f"{caller}: key_padding_mask is False on every rank, so every "
                             f"key is padding and every output row is 0. {MASK_CONVENTION}",
                             UserWarning)
    return ShardLayout(
        group=group, rank=rank, world=world,
        rows_before=int(lengths[:rank].sum()), total_rows=int(lengths.sum()),
        valid_before=every[:rank].sum(dim=0).to(q.device), key=headers[0, 6:8].to(q.device),
        valid_counts=every.to(q.device),
        unpadded_before=bool((every[:rank] == lengths[:rank, None]).all()),
    )


def recorded_gradients(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Which of q, k, v the call records for a backward pass, as bits (q = 1, k = 2,
    v = 4): none under ``torch.no_grad`` or for inputs that do not require gradients."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate((q, k, v)) if t.requires_grad)


def _check_gradients_alike(caller: str, bits: Tensor) -> None:
    """A sentence where the ranks record different gradients (``recorded_gradients``):
    a rank whose backward pass all-reduces a sum the others did not record would wait
    for them, while they go on to the next call's exchange."""
    if (bits == bits[0]).all():
        return
    names = [", ".join(c for i, c in enumerate("qkv") if x >> i & 1) or "none"
             for x in bits.tolist()]
    ranks = "; ".join(f"rank {r}: {x}" for r, x in enumerate(names))
    raise ValueError(
        f"{caller}: the ranks differ in which of q, k, v require gradients ({ranks}): the "
        f"backward pass all-reduces on every rank that records it and would wait forever "
        f"for the others. Call every rank alike: all under torch.no_grad (evaluation), or "
        f"all with the same inputs requiring gradients.")


def reject_together(caller: str, error: Exception, group: Any) -> NoReturn:
    """Raise ``error`` after joining the first exchange as a rank that failed its checks,
    so that the other ranks, waiting there, raise too instead of waiting forever. With
    no initialised ``torch.distributed`` nobody waits: ``error`` is raised as it is."""
    if not dist.is_available() or not dist.is_initialized():
        raise error
    group = resolve_group(group, caller)
    agree_layout(caller, None, None, None, None, error, group)  # type: ignore[arg-type]
    raise AssertionError("unreachable: agree_layout re-raises the error")


@contextmanager
def failing_together(caller: str, group: Any) -> Iterator[None]:
    """Checks made before the exchange: where one raises on this rank only, this rank
    still joins the exchange (``reject_together``) before the error propagates."""
    try:
        yield
    except Exception as error:
        reject_together(caller, error, group)


def fingerprint(tensors: Any) -> Tensor:
    """A long scalar that changes with any bit of ``tensors`` (an exact, order-free
    integer sum of their bits weighted by position: equal on every rank and device for
    equal tensors, with no host read; int64 sums wrap alike everywhere)."""
    total = torch.zeros((), dtype=torch.long)
    for t in tensors:
        integers = _INTEGER_OF_SIZE.get(t.element_size(), torch.uint8)  # complex128: bytes
        bits = t.detach().contiguous().view(-1).view(integers)
        total = total.to(bits.device)
        # by slices: the int64 temporaries stay a few MiB for a parameter of any size
        for start in range(0, bits.numel(), _FINGERPRINT_SLICE):
            part = bits[start:start + _FINGERPRINT_SLICE].long()
            position = torch.arange(start + 1, start + 1 + part.numel(), device=bits.device)
            total = total + (part * (position * 2654435761 + 1)).sum()
    return total


_FINGERPRINT_SLICE = 1 << 18  # elements of one step of fingerprint


def rows_fingerprint(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``fingerprint`` of the first and last rows of q, k and v ``[B, H, N_r, *]``:
    shards of one sequence differ there, copies of it do not (6 rows read, whatever
    N_r)."""
    return fingerprint(torch.cat([t[:, :, :1], t[:, :, -1:]], dim=2) for t in (q, k, v))


def _differing(values: Tensor) -> list[int]:
    return [r for r, x in enumerate(values.tolist()) if x != values[0]]


def _describe(shape: list[int]) -> str:
    """``B=.., H=.., D=.., Dv=.., dtype=..`` from a header's first five fields."""
    values = [*map(str, shape[:4]), str(DTYPES[shape[4]]).removeprefix("torch.")]
    return ", ".join(f"{f}={x}" for f, x in zip(_FIELDS, values, strict=True))
