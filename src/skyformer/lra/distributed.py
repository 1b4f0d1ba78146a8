"""Data-parallel training through PyTorch's own launcher (``torchrun``, DDP).

``torchrun --nproc-per-node K -m skyformer lra train ...`` starts K processes with
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set; without them the same command runs as
one process. Backend: NCCL on CUDA, gloo on CPU. Multi-node works the same way
(``torchrun --nnodes ...``); resuming then needs the run folder on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..devices import parse_device
from ..distributed import destroy_process_group
from ..io import json_ready


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(request: str, local_rank: int) -> torch.device:
    """``auto`` = this process's GPU if CUDA is available, else the CPU."""
    if request == "auto":
        if torch.cuda.is_available():
            return parse_device(f"cuda:{local_rank}")  # a sentence for more processes than GPUs
        return torch.device("cpu")
    device = parse_device(request, also="auto")
    if device.type == "cuda" and device.index is None:  # this process's GPU, if there is one
        device = parse_device(f"cuda:{local_rank}")
    return device


def init_distributed(device_request: str = "auto") -> tuple[DistInfo, torch.device]:
    """Join the process group that ``torchrun`` describes (if any) and pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return DistInfo(rank, world, local_rank, owns), device


def shutdown(info: DistInfo) -> None:
    """Destroy the group this run created (``skyformer.distributed.destroy_process_group``:
    collected first, so that no graph keeps it alive into interpreter shutdown)."""
    if info.owns_group and dist.is_initialized():
        destroy_process_group()


@contextmanager
def joined(device_request: str = "auto") -> Iterator[DistInfo]:
    """The process group ``torchrun`` describes (if any), joined once for several runs
    (``--seeds``) and left at the end; ``Trainer.run`` uses it and leaves it in place.

    Under ``torchrun`` a process that destroys torch's default group and initialises it
    again reuses the group's keys in the launcher's store: one that comes back before
    another has left the old group can find that process's old address and wait for it
    forever (the second seed hung)."""
    info, _ = init_distributed(device_request)
    try:
        yield info
    finally:
        shutdown(info)


def _comm_device() -> torch.device:
    """Where the collectives run: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: Tensor, info: DistInfo) -> Tensor:
    """Sum of ``tensor`` over processes (the tensor itself when alone)."""
    if not info.enabled:
        return tensor
    work = tensor.to(_comm_device())
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def all_gather(tensor: Tensor, info: DistInfo) -> list[Tensor]:
    """``tensor`` of every process (same shape everywhere), in rank order, on the CPU."""
    if not info.enabled:
        return [tensor.cpu()]
    work = tensor.to(_comm_device())
    out = [torch.empty_like(work) for _ in range(info.world_size)]
    dist.all_gather(out, work)
    return [t.cpu() for t in out]


def broadcast_state(module: nn.Module, info: DistInfo, src: int = 0) -> None:
    """Copy every parameter and buffer of ``module`` from process ``src`` to all."""
    if not info.enabled:
        return
    for tensor in module.state_dict().values():
        work = tensor.to(_comm_device())
        dist.broadcast(work, src)
        if work is not tensor:
            tensor.copy_(work)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def refuse_everywhere(info: DistInfo, refusal: Exception | None, what: str) -> None:
    """Raise ``refusal`` (found by process 0 alone, e.g. a run folder in use) on process
    0, and a sentence pointing to it on the others, which would otherwise wait forever in
    the next collective. ``what``: what process 0 checked, for the others' sentence."""
    if info.enabled:
        flags = all_gather(torch.tensor([refusal is not None], dtype=torch.long), info)
        if refusal is None and int(flags[0]):
            raise ValueError(f"process 0 refused the run ({what}); see its message.")
    if refusal is not None:
        raise refusal


def _checksum(value: Any) -> int:
    """A checksum of a JSON-able value, equal on every process for equal values."""
    text = json.dumps(json_ready(value), sort_keys=True, default=str)
    return zlib.crc32(text.encode())


def check_processes_agree(info: DistInfo, settings: dict[str, Any], data: Any,
                          stop_after: int | None, step: int, finished: bool,
                          folder: Path) -> None:
    """Refuse, on every process, a run whose processes were given other settings, other
    prepared data or another ``stop_after``, or find its folder at another ``step`` or
    ``finished`` on one only (a run folder not every process sees): each process would
    train its own number of steps and wait forever in a collective another never
    reaches. One all-gather of a checksum per setting and of the rest."""
    if not info.enabled:
        return
    names = sorted(settings)
    codes = [*(_checksum(settings[n]) for n in names), _checksum(data), _checksum(stop_after),
             2 * step + finished]
    rows = torch.stack(all_gather(torch.tensor(codes, dtype=torch.long), info))  # [P, C]
    differ = (rows != rows[0]).any(dim=0).tolist()

    def others(columns: slice) -> list[int]:
        return [r for r in range(info.world_size) if (rows[r, columns] != rows[0, columns]).any()]

    keys = [n for n, d in zip(names, differ, strict=False) if d]
    if keys:
        raise ValueError(f"the settings differ between the processes ({', '.join(keys)}: "
                         f"process(es) {others(slice(0, len(names)))} differ from process 0); "
                         "start every process with the same command.")
    if differ[-3]:
        raise ValueError(f"the processes read other prepared data (meta.json: process(es) "
                         f"{others(slice(-3, -2))} differ from process 0); prepare the data "
                         "once on a filesystem every process reads, or alike on every node.")
    if differ[-2]:
        raise ValueError(f"--stop-after differs between the processes (process(es) "
                         f"{others(slice(-2, -1))} differ from process 0); give every process "
                         "the same one.")
    if differ[-1]:
        states = ", ".join(f"process {r} at step {int(c) // 2}" + (" (finished)" if c % 2 else "")
                           for r, c in enumerate(rows[:, -1].tolist()))
        raise ValueError(f"the processes find the run in {folder} in different states "
                         f"({states}): resuming needs the run folder on a filesystem every "
                         "process sees.")
