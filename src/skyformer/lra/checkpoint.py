"""Checkpoints: ``torch.save`` written atomically, read back with ``weights_only=True``.

A checkpoint holds only tensors and plain Python values (no pickled objects), so
loading one never runs code. Besides model, optimizer and scaler state it keeps every
random number generator a run draws from, so that a resumed run continues exactly as
an uninterrupted one would:

- torch's CPU generator (dropout on CPU) and, on CUDA, the device generator,
- the generator that feeds the attention methods' own randomness (landmarks,
  random features), kept apart from dropout,
- numpy's and Python's global generators (nothing here draws from them, but code a
  user adds might).

Data order needs no state beyond its position (see ``batches.py``).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..io import atomic_writer
from ..logs import first_line


def save_checkpoint(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """``torch.save(payload)`` through a temporary file in the same folder, then rename.
    A write that fails (a full disk) raises an ``OSError`` naming the file, the space left
    and what to do; the file there before stays as it was. Ctrl-C or SIGTERM during the
    write raises the interrupt it is (torch reports it as a failed write)."""
    try:
        with atomic_writer(path, "wb") as handle:
            try:
                torch.save(payload, handle)
            except BaseException as err:
                # torch's zip writer, held by the frames of the error, writes its end when
                # freed: after the file is closed that write ends the process (a C++
                # terminate), so it is freed now, into the file removed next
                traceback.clear_frames(err.__traceback__)
                raise
    except (OSError, RuntimeError) as err:
        interrupt = _interrupt_behind(err)
        if interrupt is not None:
            raise interrupt from None
        # torch's zip writer reports a short write as "unexpected pos ..." (a RuntimeError)
        raise OSError(_unwritable_sentence(Path(path), err)) from err
    return Path(path)


def _interrupt_behind(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (``cli.signals.Terminated``) that ``err`` was raised while
    handling: a signal's handler raising inside torch's write callback comes out of
    ``torch.save`` as a RuntimeError ("unexpected pos") whose context it is."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _unwritable_sentence(target: Path, err: Exception) -> str:
    """Why a checkpoint could not be written: torch's or the system's words, and the
    space left on the file system of its folder."""
    first = first_line(err)
    try:
        free = f"{shutil.disk_usage(target.parent).free / 2**20:.1f} MiB are free there"
    except OSError:
        free = "the space left there could not be read"
    return (f"cannot write checkpoint {target} ({first}); {free}. Free some space, or give "
            f"--out on another disk, and continue with --resume: the checkpoint written "
            f"before is kept.")


def load_checkpoint(path: str | os.PathLike[str], device: torch.device | str = "cpu"
                    ) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` (tensors mapped to ``device``)."""
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no checkpoint at {target}.")
    try:
        return torch.load(target, map_location=device, weights_only=True)
    except Exception as err:  # truncated or foreign files raise many different errors
        raise ValueError(_unreadable_sentence(target, err)) from None


def _unreadable_sentence(target: Path, err: Exception) -> str:
    """Why ``torch.load(target, weights_only=True)`` failed, and what to do: a file that
    holds Python objects (a class torch names as ``GLOBAL module.Name``) is no checkpoint
    ``save_checkpoint`` wrote, and is not loaded, since unpickling it could run code; any
    other failure is a file cut short, empty or not written by ``torch.save``."""
    fix = ("put the run's own file back (from a copy), or start a new run with another "
           "--out.")
    refused = re.search(r"GLOBAL ([\w.]+)", str(err))
    if isinstance(err, pickle.UnpicklingError) and refused:
        return (f"cannot read checkpoint {target}: it holds a Python object ({refused[1]}) "
                f"besides tensors and plain values, which is not loaded since loading it "
                f"could run code; checkpoints of skyformer lra train hold none, so it is not "
                f"one of them: {fix}")
    detail = type(err).__name__
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if first and "weights only" not in first.lower():  # not torch's advice to unpickle it
        detail += f": {first}"
    return (f"cannot read checkpoint {target}: the file is cut short, empty or not written "
            f"by torch.save ({detail}); {fix}")


def device_rng_state(device: torch.device, attention_generator: torch.Generator
                     ) -> dict[str, Tensor]:
    """The generators that differ between processes, as tensors."""
    state = {"torch": torch.get_rng_state(), "attention": attention_generator.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def device_rng_state_fits(state: dict[str, Tensor], device: torch.device,
                          attention_generator: torch.Generator) -> bool:
    """Whether ``state`` was recorded on ``device``'s type: a CPU generator's state and
    a CUDA one's differ in size (5056 bytes and 16), and only CUDA records ``cuda``.
    A run stopped on a CPU node and resumed on a GPU node failed in ``set_state``."""
    return (state["attention"].numel() == attention_generator.get_state().numel()
            and ("cuda" in state) == (device.type == "cuda"))


def set_device_rng_state(state: dict[str, Tensor], device: torch.device,
                         attention_generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"].cpu())
    attention_generator.set_state(state["attention"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def host_rng_state() -> dict[str, Any]:
    """numpy's and Python's global generators as plain values and tensors."""
    numpy_state = np.random.get_state(legacy=False)
    key = torch.from_numpy(np.asarray(numpy_state["state"]["key"]).astype(np.int64))
    return {
        "numpy": {"bit_generator": numpy_state["bit_generator"], "key": key,
                  "pos": int(numpy_state["state"]["pos"]),
                  "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "python": random.getstate(),
    }


def set_host_rng_state(state: dict[str, Any]) -> None:
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].cpu().numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"], "gauss": n["gauss"],
    })
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
