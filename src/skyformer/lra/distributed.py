"""Data-parallel training through PyTorch's own launcher (``torchrun``, DDP).

``torchrun --nproc-per-node K -m skyformer lra train ...`` starts K processes with
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set; without them the same command runs as
one process. Backend: NCCL on CUDA, gloo on CPU. Multi-node works the same way
(``torchrun --nnodes ...``); resuming then needs the run folder on a shared filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..devices import parse_device
from ..distributed import destroy_process_group


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


def _comm_device(info: DistInfo, tensor: Tensor) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: Tensor, info: DistInfo) -> Tensor:
    """Sum of ``tensor`` over processes (the tensor itself when alone)."""
    if not info.enabled:
        return tensor
    work = tensor.to(_comm_device(info, tensor))
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def all_gather(tensor: Tensor, info: DistInfo) -> list[Tensor]:
    """``tensor`` of every process (same shape everywhere), in rank order, on the CPU."""
    if not info.enabled:
        return [tensor.cpu()]
    work = tensor.to(_comm_device(info, tensor))
    out = [torch.empty_like(work) for _ in range(info.world_size)]
    dist.all_gather(out, work)
    return [t.cpu() for t in out]


def broadcast_state(module: nn.Module, info: DistInfo, src: int = 0) -> None:
    """Copy every parameter and buffer of ``module`` from process ``src`` to all."""
    if not info.enabled:
        return
    for tensor in module.state_dict().values():
        work = tensor.to(_comm_device(info, tensor))
        dist.broadcast(work, src)
        if work is not tensor:
            tensor.copy_(work)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
