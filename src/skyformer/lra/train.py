"""``skyformer lra train``: train the LRA model with one attention method on one task.

The loop follows the paper's protocol: AdamW with the task's preset schedule, a dev
evaluation every ``eval_every`` steps, the best dev checkpoint kept (``best.pt``) and,
at the end, evaluated on the test split (evaluating the last checkpoint instead is a
known reproduction trap). ``last.pt`` is written every ``checkpoint_every`` steps and
at every new best, just before ``best.pt``: ``best.pt`` never holds a step beyond
``last.pt``, which a resumed run that takes another path (another number of processes)
would never retrace. ``resume=True`` continues from ``last.pt`` and reproduces the
uninterrupted run exactly (same data order, dropout masks and attention randomness).

Files in the run folder: ``config.json`` (resolved config, data, environment),
``metrics.jsonl``, ``train.csv``, ``dev.csv``, ``tensorboard/``, ``last.pt``,
``best.pt`` and ``result.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..io import (
    environment,
    folder_lock,
    json_ready,
    json_text,
    portable_name,
    remove_interrupted_writes,
    write_json,
)
from ..logs import get_logger
from ..registry import get_method
from ..registry.variants import variant_name
from .batches import BatchOrder, Position, fetch, micro_batches
from .cache import TaskData, data_fingerprint, load_cache
from .checkpoint import (
    device_rng_state,
    host_rng_state,
    load_checkpoint,
    save_checkpoint,
    set_device_rng_state,
    set_host_rng_state,
)
from .distributed import (
    DistInfo,
    all_gather,
    all_reduce_sum,
    barrier,
    broadcast_state,
    check_processes_agree,
    init_distributed,
    refuse_everywhere,
    shutdown,
)
from .evaluate import evaluate
from .metrics import Running, peak_memory_bytes, reset_peak_memory
from .model import LRAClassifier, ModelConfig
from .presets import TrainConfig, learning_rate
from .runlog import KINDS, RunLog, read_entries
from .seeds import derive_seed

_log = get_logger("lra")

CHECKPOINT_FORMAT = 1


def default_run_dir(cfg: TrainConfig) -> Path:
    """``runs/lra/TASK/METHOD/seedN``, METHOD carrying the attention options in its
    brackets (``skyformer[num_features=32]``: runs of two options do not share a folder)
    and made a portable file name (double quotes as single ones, ``portable_name``)."""
    method = variant_name(cfg.attention, dict(cfg.attention_options))
    return Path("runs") / "lra" / cfg.task / portable_name(method) / f"seed{cfg.seed}"


def model_config(cfg: TrainConfig, data: TaskData) -> ModelConfig:
    """The model for ``cfg`` on the prepared ``data``."""
    max_len = cfg.max_len or data.max_len
    if max_len > data.max_len:
        raise ValueError(f"max_len {max_len} exceeds the prepared length {data.max_len} of "
                         f"{cfg.task}; prepare the task again with --max-len {max_len}.")
    task = data.task
    return ModelConfig(
        vocab_size=task.vocab_size, num_classes=task.num_classes, max_len=max_len,
        segments=task.segments, dim=cfg.dim, hidden=cfg.hidden, heads=cfg.heads,
        layers=cfg.layers, dropout=cfg.dropout, attention=cfg.attention,
        attention_options=dict(cfg.attention_options),
    )


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """Context manager factory for the forward pass (bf16/fp16 autocast, or nothing)."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("fp16 autocast needs a CUDA device; use --precision bf16 or fp32 on CPU.")
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return lambda: torch.autocast(device.type, dtype=dtype)


@dataclass
class TrainState:
    """What the loop carries from step to step besides model and optimizer."""

    step: int = 0
    position: Position = field(default_factory=Position)
    best_accuracy: float = -1.0
    best_step: int = 0
    evals_since_best: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    peak_memory: int = 0


def diverged_at(history: list[dict[str, Any]]) -> int | None:
    """The step of the first logged training loss that is not a finite number (written
    as null: strict JSON), or None: the run's losses stayed finite."""
    for entry in history:
        loss = entry.get("loss", 0.0)
        if entry.get("kind") == "train" and (loss is None or not math.isfinite(loss)):
            return int(entry["step"])
    return None


def own_running_sums(saved: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """This process's partial log sums from a checkpoint's ``running`` ([processes, 3];
    older checkpoints hold one row). With another number of processes, process 0 takes
    the total and the others start from zero, so the next logged entry counts every
    example once."""
    rows = saved.reshape(-1, 3)
    if rows.shape[0] == info.world_size:
        return rows[info.rank]
    return rows.sum(dim=0) if info.is_main else torch.zeros_like(rows[0])


# Written only once a run has reached its first checkpoint (best.pt after last.pt) or
# finished (result.json, with the test entry of metrics.jsonl): without last.pt they are
# what an earlier run left after its checkpoints were deleted. An attempt that died
# before its first checkpoint leaves config.json, train and dev entries (the first dev
# evaluation is logged before the first last.pt is written) and TensorBoard events,
# which a new run replaces.
EARLIER_RUN_FILES = ("result.json", "best.pt")


def _has_test_entry(metrics: Path) -> bool:
    """Whether ``metrics`` (a run's ``metrics.jsonl``) holds a test entry, which a
    finished run writes with its result.json; lines that do not parse (cut short by a
    kill) are skipped."""
    return any(entry.get("kind") == "test" for _, entry in read_entries(metrics))


# The files a run writes through a temporary file and a rename (``io.atomic_write_text``,
# ``checkpoint.save_checkpoint``), whose leftovers a new start removes.
ATOMIC_FILES = ("last.pt", "best.pt", "result.json", "config.json", "metrics.jsonl",
                *(f"{kind}.csv" for kind in KINDS))


def earlier_run_files(folder: Path) -> list[str]:
    """The files of an earlier run in ``folder`` that a new run there would leave beside its
    own (``result.json``, read by ``lra report``) or mix with its own."""
    found = [name for name in EARLIER_RUN_FILES if (folder / name).exists()]
    if _has_test_entry(folder / "metrics.jsonl"):
        found.append("metrics.jsonl")
    return found


def check_fresh_folder(folder: Path) -> None:
    """Refuse to start a new run in ``folder`` when it holds an earlier run's files but no
    ``last.pt`` to continue that run from."""
    found = earlier_run_files(folder)
    if found:
        raise ValueError(f"{folder} holds files of an earlier run ({', '.join(found)}) but no "
                         "last.pt to continue it from; choose another --out (to discard that "
                         "run instead, remove those files).")


def _config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


# Settings a resume may change: when the run logs and writes last.pt, which changes no
# step's arithmetic (the run ends as an uninterrupted one with the new values would).
CHANGEABLE_AT_RESUME = ("log_every", "checkpoint_every")


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded config without ``CHANGEABLE_AT_RESUME``: what a resume must match."""
    return {k: v for k, v in config.items() if k not in CHANGEABLE_AT_RESUME}


# What an absent (None) setting or data record means, in the sentences naming differences.
_NONE_SAID = {"eval_batches": "every batch (--full-dev)",
              "tokens": "the release's (no --listops-tokens)"}


def _describe_differences(saved: dict[str, Any], current: dict[str, Any], *,
                          nested: bool = False) -> str:
    """``key: A then, B now`` for plain values, the key alone for nested ones (lists and
    dicts), or with ``nested`` those too, as JSON (the attention options of a config)."""
    parts = []
    for key in _config_differences(saved, current):
        then, now = saved.get(key), current.get(key)
        plain = all(v is None or isinstance(v, int | float | str) for v in (then, now))
        if plain:
            then_said, now_said = (_NONE_SAID.get(key, "unset") if v is None else v
                                   for v in (then, now))
            parts.append(f"{key}: {then_said} then, {now_said} now")
        elif nested:
            parts.append(f"{key}: {json_text(then)} then, {json_text(now)} now")
        else:
            parts.append(key)
    return ", ".join(parts)


def open_checkpoint(folder: Path, cfg: TrainConfig, resume: bool,
                    device: torch.device | str = "cpu") -> dict[str, Any] | None:
    """The checkpoint ``folder/last.pt`` to resume ``cfg`` from, or None to start a new
    run; refuses a run present without ``resume``, an earlier run's files without
    ``last.pt``, and a checkpoint that is foreign, damaged or of other settings."""
    last = folder / "last.pt"
    if not last.exists():
        if not (resume and finished_without_checkpoint(folder, cfg)):
            check_fresh_folder(folder)
        return None
    if not resume:
        raise ValueError(f"{folder} already holds a run (last.pt); pass --resume to "
                         "continue it, or choose another --out.")
    ckpt = load_checkpoint(last, device)
    fmt = ckpt.get("format") if isinstance(ckpt, dict) else None
    if fmt != CHECKPOINT_FORMAT:
        raise ValueError(f"{last} is not a training checkpoint of format {CHECKPOINT_FORMAT} "
                         f"(found {type(ckpt).__name__}, format {fmt!r}); start without "
                         f"--resume or point --out at the run's own folder.")
    missing = [k for k in ("config", "model", "optimizer", "scaler", "state") if k not in ckpt]
    if missing:
        raise ValueError(f"{last} lacks {', '.join(missing)}: the checkpoint is damaged; "
                         f"resume from another copy or start again.")
    saved, current = _settings(ckpt["config"]), _settings(cfg.to_dict())
    if _config_differences(saved, current):
        raise ValueError(f"cannot resume {last}: the settings differ from the run's ("
                         f"{_describe_differences(saved, current, nested=True)}); resume "
                         "with the same settings, or start a new run with another --out.")
    return ckpt


def check_same_data(ckpt: dict[str, Any], last: Path, data: TaskData,
                    model_cfg: ModelConfig) -> None:
    """Refuse to resume on prepared data other than the run's. Checkpoints without a
    data fingerprint (older versions) are checked for the model's shape only."""
    where = f"the prepared {data.task.name} data in {data.root}"
    saved = ckpt.get("data")
    if saved is not None:
        current = _as_recorded(data_fingerprint(data.meta), saved)
        problem = f"{where} differs from the data the run started with (meta.json: "
    else:
        saved = ckpt.get("model_config") or {}
        current = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k in saved}
        problem = f"the model built for {where} differs from the run's ("
    if saved == current:
        return
    hint = "".join(f" with {flag} {saved[key]}" for key, flag in
                   (("max_len", "--max-len"), ("tokens", "--listops-tokens"))
                   if saved.get(key) is not None and saved[key] != current.get(key))
    raise ValueError(f"cannot resume {last}: {problem}"
                     f"{_describe_differences(saved, current)}); prepare it again as it "
                     f"was{hint}, or start a new run with another --out.")


def _as_recorded(current: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``current``, a data record, without the split digests (``splits.<name>.sha256``)
    that ``saved`` lacks: a run recorded before ``meta.json`` held them resumes on the
    same files prepared again, checked on the sizes and counts it recorded."""
    splits, then = current.get("splits"), saved.get("splits")
    if not (isinstance(splits, dict) and isinstance(then, dict)):
        return current
    kept = {name: {k: v for k, v in split.items()
                   if k != "sha256" or "sha256" in (then.get(name) or {})}
            if isinstance(split, dict) else split for name, split in splits.items()}
    return {**current, "splits": kept}


def _stored_result(folder: Path) -> dict[str, Any] | None:
    """``folder/result.json`` read, or None where there is none; one that is not a
    result is refused in a sentence."""
    path = folder / "result.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problem = f"not JSON ({err})"
    else:
        problem = None if isinstance(result, dict) else f"a JSON {type(result).__name__}"
    if problem is not None:
        raise ValueError(f"cannot resume {folder}: its result.json is {problem}, not a result "
                         f"of skyformer lra train; remove it (the run writes it again when it "
                         f"finishes), or choose another --out.")
    return result


def finished_result(folder: Path, cfg: TrainConfig, step: int) -> dict[str, Any] | None:
    """The stored ``result.json`` of ``folder`` when it is the end of ``cfg``'s run resumed
    at ``step``, else None."""
    result = _stored_result(folder)
    config = json_ready(cfg.to_dict())  # as written: an infinite setting is null
    if result is None or result.get("config") != config or result.get("steps") != step:
        return None
    return result


def finished_without_checkpoint(folder: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The stored ``result.json`` of ``folder`` when it is the result of ``cfg``'s run (the
    same settings but ``CHANGEABLE_AT_RESUME``) and ``last.pt`` is gone, as after the
    checkpoints of finished runs were deleted to save space; else None. Resumed, such a
    run is finished: nothing to train again."""
    if (folder / "last.pt").exists():
        return None
    result = _stored_result(folder)
    recorded = None if result is None else result.get("config")
    if not isinstance(recorded, dict) \
            or _settings(recorded) != _settings(json_ready(cfg.to_dict())):
        return None
    return result


def best_dev_entry(step: int, best_step: int,
                   history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The dev entry of the resumed ``step`` when it is the best one: interrupted between
    ``last.pt`` and ``best.pt``, the model of ``last.pt`` is that best."""
    if best_step != step:
        return None
    return next((e for e in reversed(history) if e["kind"] == "dev" and e["step"] == step),
                None)


def check_best_checkpoint(folder: Path, step: int, best_step: int,
                          history: list[dict[str, Any]]) -> None:
    """Refuse to resume at ``step`` when ``best.pt``, which the run evaluates on test at
    its end, is missing and ``last.pt`` cannot stand in for it (its best step is
    another): the run would train to the end and fail there."""
    if best_step == 0 or (folder / "best.pt").is_file() \
            or best_dev_entry(step, best_step, history) is not None:
        return
    raise ValueError(f"cannot resume {folder / 'last.pt'}: best.pt, the checkpoint of its best "
                     f"dev result (step {best_step}) that the run evaluates on test at its end, "
                     f"is missing; put it back into {folder}, or start a new run with another "
                     "--out.")


def best_checkpoint_step(folder: Path, cfg: TrainConfig, data: dict[str, Any],
                         step: int, best_step: int, history: list[dict[str, Any]]
                         ) -> int | None:
    """The step ``folder/best.pt`` holds (None: there is none), refusing a file that is no
    best-dev checkpoint of ``cfg``'s run on ``data`` (a ``data_fingerprint``) resumed at
    ``step``: another seed's, method's or data's put in its place, or one of another
    step than the run's best (``best_step``), which the end of the run would evaluate on
    test and report as its own. ``last.pt`` is written before ``best.pt``, so a best
    step without its ``best.pt`` is only ever ``last.pt``'s own step, written again from
    the model it restores (``best_dev_entry``). Before its first evaluation
    (``best_step`` 0) a run replaces whatever ``best.pt`` holds at that evaluation."""
    path = folder / "best.pt"
    if not path.is_file():
        return None
    best = load_checkpoint(path)
    fix = f"put this run's own best.pt back into {folder}, or start a new run with another --out."
    if not (isinstance(best, dict) and best.get("format") == CHECKPOINT_FORMAT
            and isinstance(best.get("config"), dict) and "model" in best
            and isinstance(best.get("step"), int)):
        raise ValueError(f"cannot resume {folder / 'last.pt'}: {path} is not a best-dev "
                         f"checkpoint of format {CHECKPOINT_FORMAT} (config, model and step); "
                         f"{fix}")
    saved, current = _settings(best["config"]), _settings(cfg.to_dict())
    if _config_differences(saved, current):
        said = _describe_differences(saved, current, nested=True)
        raise ValueError(f"cannot resume {folder / 'last.pt'}: {path} is the best checkpoint "
                         f"of a run with other settings ({said}), which the end of this run "
                         f"would evaluate on test as its own; {fix}")
    # written since best.pt records its data; compared as last.pt's (a record without
    # the split digests of a later preparation of the same files is the same data)
    if "data" in best and _as_recorded(data, best["data"]) != best["data"]:
        raise ValueError(f"cannot resume {folder / 'last.pt'}: {path} is the best checkpoint "
                         f"of a run on other prepared data, which the end of this run would "
                         f"evaluate on test as its own; {fix}")
    if best["step"] != best_step and best_step > 0 \
            and best_dev_entry(step, best_step, history) is None:
        raise ValueError(f"cannot resume {folder / 'last.pt'}: {path} holds step "
                         f"{best['step']}, not step {best_step} where this run has its best dev "
                         f"accuracy (a checkpoint of another run, or an earlier one of this "
                         f"run), which the end of this run would evaluate on test as its own; "
                         f"{fix}")
    return best["step"]


def check_run(cfg: TrainConfig, folder: Path, cache_root: str | os.PathLike[str],
              resume: bool) -> None:
    """Fail now with the sentence ``Trainer.run`` would fail with when ``cfg`` cannot
    start or resume in ``folder``, without building or training anything: ``--seeds``
    checks every seed's folder before the first seed trains."""
    ckpt = open_checkpoint(folder, cfg, resume)
    if ckpt is not None:
        data = load_cache(cache_root, cfg.task)
        check_same_data(ckpt, folder / "last.pt", data, model_config(cfg, data))
        s = ckpt["state"]
        if finished_result(folder, cfg, s["step"]) is None:
            check_best_checkpoint(folder, s["step"], s["best_step"], ckpt["history"])
            best_checkpoint_step(folder, cfg, data_fingerprint(data.meta), s["step"],
                                 s["best_step"], ckpt["history"])


class Trainer:
    """One training run; ``run()`` returns the result, or None when stopped by
    ``stop_after`` (to be resumed from ``last.pt``; ``state.step`` is the step it stopped
    at, and ``resumed_at`` the step it resumed from, None for a new run: equal when the
    run was already at or past ``stop_after`` and nothing was trained)."""

    def __init__(self, cfg: TrainConfig, *, cache_root: str | os.PathLike[str],
                 out_dir: str | os.PathLike[str] | None = None, resume: bool = False,
                 stop_after: int | None = None, device: str = "auto", tensorboard: bool = True,
                 quiet: bool = False, command: str | None = None) -> None:
        if stop_after is not None and (isinstance(stop_after, bool)
                                       or not isinstance(stop_after, int) or stop_after < 0):
            raise ValueError(f"stop_after (--stop-after) must be a number of steps >= 0, "
                             f"got {stop_after!r}.")
        self.cfg = cfg
        self.command = command  # the command line that runs it, recorded in result.json
        self.cache_root = Path(cache_root).expanduser()
        self.folder = Path(out_dir) if out_dir is not None else default_run_dir(cfg)
        self.resume = resume
        self.stop_after = stop_after
        self.device_request = device
        self.tensorboard = tensorboard
        self.quiet = quiet
        self.resumed_at: int | None = None

    # -- set-up -------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.info.is_main and not self.quiet:
            _log.info(text)

    def _build(self) -> None:
        cfg = self.cfg
        self.autocast = autocast_factory(cfg.precision, self.device)  # before the data's check
        self.data = load_cache(self.cache_root, cfg.task)
        self.model_cfg = model_config(cfg, self.data)
        parts = self.info.world_size * cfg.grad_accum
        if cfg.batch_size % parts:
            raise ValueError(f"batch size {cfg.batch_size} is not divisible by processes x "
                             f"accumulation steps = {self.info.world_size} x {cfg.grad_accum}.")
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        np.random.seed(cfg.seed % 2**32)
        random.seed(cfg.seed)
        self.model = LRAClassifier(self.model_cfg).to(self.device)
        # Dropout and attention randomness: separate streams, different per process.
        torch.manual_seed(derive_seed(cfg.seed, self.info.rank, 1))
        self.attention_generator = torch.Generator(device=self.device)
        self.attention_generator.manual_seed(derive_seed(cfg.seed, self.info.rank, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.999),
                                           eps=1e-6, weight_decay=cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.order = BatchOrder(len(self.data.splits["train"]), cfg.batch_size, cfg.seed)
        self.state = TrainState()
        self.running = Running(self.device)

    def check(self) -> None:
        """Fail now if this run cannot start or resume in its folder (``check_run``)."""
        check_run(self.cfg, self.folder, self.cache_root, self.resume)

    def _restore(self) -> bool:
        ckpt = open_checkpoint(self.folder, self.cfg, self.resume, self.device)
        if ckpt is None:
            if self.resume and not finished_without_checkpoint(self.folder, self.cfg):
                self._say(f"no checkpoint in {self.folder}; starting a new run")
            return False
        check_same_data(ckpt, self.folder / "last.pt", self.data, self.model.cfg)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scaler.load_state_dict(ckpt["scaler"])
        s = ckpt["state"]
        self.state = TrainState(
            step=s["step"], position=Position(*s["position"]), best_accuracy=s["best_accuracy"],
            best_step=s["best_step"], evals_since_best=s["evals_since_best"],
            history=list(ckpt["history"]), train_seconds=s["train_seconds"],
            wall_seconds=s["wall_seconds"], peak_memory=s["peak_memory"],
        )
        self.running.sums.copy_(own_running_sums(ckpt["running"], self.info).to(self.device))
        set_host_rng_state(ckpt["rng"]["host"])
        per_process = ckpt["rng"]["processes"]
        if len(per_process) == self.info.world_size:
            set_device_rng_state(per_process[self.info.rank], self.device, self.attention_generator)
        else:
            self._say(f"resuming with {self.info.world_size} processes instead of "
                      f"{len(per_process)}: data order is kept but dropout and attention draws "
                      "are reseeded, and evaluations of randomised attention draw on other "
                      "batches, so the run will not match an uninterrupted one exactly")
            torch.manual_seed(derive_seed(self.cfg.seed, self.info.rank, 1, self.state.step))
            self.attention_generator.manual_seed(derive_seed(self.cfg.seed, self.info.rank, 2,
                                                       self.state.step))
        return True

    def _check_best(self) -> None:
        """``best.pt`` should hold the restored state's best step. Interrupted between
        ``last.pt`` and ``best.pt`` at a new best, the model just restored is that best:
        it is written again. Missing otherwise, the run is refused (every process)."""
        s = self.state
        check_best_checkpoint(self.folder, s.step, s.best_step, s.history)
        saved = best_checkpoint_step(self.folder, self.cfg, data_fingerprint(self.data.meta),
                                     s.step, s.best_step, s.history)  # every process refuses
        if not self.info.is_main or s.best_step == 0 or saved == s.best_step:
            return
        entry = best_dev_entry(s.step, s.best_step, s.history)  # not None: refused otherwise
        self._save_best({"accuracy": entry["accuracy"], "loss": entry["loss"],
                         "count": entry["examples"]})

    # -- checkpoints --------------------------------------------------------------------
    def _save_last(self) -> None:
        rng = device_rng_state(self.device, self.attention_generator)
        gathered = {k: all_gather(v, self.info) for k, v in rng.items()}  # collective
        running = all_gather(self.running.sums, self.info)  # collective: partial log sums
        if not self.info.is_main:
            return
        s = self.state
        save_checkpoint(self.folder / "last.pt", {
            "format": CHECKPOINT_FORMAT,
            "config": self.cfg.to_dict(),
            "data": data_fingerprint(self.data.meta),
            "model_config": dataclasses.asdict(self.model.cfg),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "state": {"step": s.step, "position": [s.position.epoch, s.position.batch],
                      "best_accuracy": s.best_accuracy, "best_step": s.best_step,
                      "evals_since_best": s.evals_since_best, "train_seconds": s.train_seconds,
                      "wall_seconds": s.wall_seconds, "peak_memory": s.peak_memory},
            "history": self.log.history,
            "running": torch.stack(running),  # [processes, 3]
            "rng": {"host": host_rng_state(),
                    "processes": [{k: gathered[k][r] for k in gathered}
                                  for r in range(self.info.world_size)]},
            "world_size": self.info.world_size,
        })

    def _save_best(self, dev: dict[str, float]) -> None:
        if self.info.is_main:
            save_checkpoint(self.folder / "best.pt", {
                "format": CHECKPOINT_FORMAT, "config": self.cfg.to_dict(),
                "data": data_fingerprint(self.data.meta),
                "model_config": dataclasses.asdict(self.model.cfg),
                "model": self.model.state_dict(), "step": self.state.step, "dev": dev,
            })

    # -- the loop -----------------------------------------------------------------------
    def _eval_kwargs(self) -> dict[str, Any]:
        return {"batch_size": self.cfg.batch_size // self.info.world_size, "device": self.device,
                    "info": self.info, "seed": derive_seed(self.cfg.seed, 3),
                    "max_len": self.model_cfg.max_len, "autocast": self.autocast}

    def _train_step(self) -> None:
        cfg, state = self.cfg, self.state
        indices = self.order.batch(state.position)
        parts = micro_batches(indices, self.info.rank, self.info.world_size, cfg.grad_accum)
        train = self.data.splits["train"]
        for j, part in enumerate(parts):
            tokens, lengths, labels = fetch(train, part, self.device, self.model_cfg.max_len)
            last = j == len(parts) - 1
            sync = contextlib.nullcontext() if last or not self.info.enabled else self.net.no_sync()
            with sync:
                with self.autocast():
                    logits = self.net(tokens, lengths, generator=self.attention_generator)
                loss = F.cross_entropy(logits.float(), labels)
                self.scaler.scale(loss / cfg.grad_accum).backward()
            self.running.add(loss.detach() * labels.numel(),
                             (logits.detach().argmax(dim=-1) == labels).sum(), labels.numel())
        lr = learning_rate(state.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if cfg.grad_clip is not None or cfg.grad_clip_value is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if cfg.grad_clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), cfg.grad_clip_value)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.position = self.order.next(state.position)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _log_train(self, steps: int, seconds: float) -> None:
        loss_sum, correct, count = all_reduce_sum(self.running.sums, self.info).tolist()
        self.running.reset()
        if not math.isfinite(loss_sum) and self.info.is_main \
                and diverged_at(self.log.history) is None:
            _log.warning(  # once: later entries find the first in the history
                f"the training loss is {loss_sum / max(count, 1.0)} by step "
                f"{self.state.step}: the run diverged (a lower --lr, a longer --warmup or "
                f"--grad-clip may keep it finite). It trains on to --steps; result.json "
                f"(diverged_at_step) and the report say so.")
        self.log.record("train", step=self.state.step, loss=loss_sum / max(count, 1.0),
                        accuracy=correct / max(count, 1.0),
                        lr=learning_rate(self.state.step - 1, self.cfg),
                        seconds=round(self.state.train_seconds, 3),
                        steps_per_second=steps / seconds if seconds > 0 else None)

    def _evaluate_dev(self) -> dict[str, float] | None:
        """Evaluate on dev; the result when it is a new best (to be saved), else None."""
        cfg, state = self.cfg, self.state
        limit = None if cfg.eval_batches is None else cfg.eval_batches * cfg.batch_size
        dev = evaluate(self.model, self.data.splits["dev"], limit=limit, **self._eval_kwargs())
        self.log.record("dev", step=state.step, accuracy=dev["accuracy"], loss=dev["loss"],
                        seconds=round(state.train_seconds, 3), examples=dev["count"])
        if dev["accuracy"] > state.best_accuracy:
            state.best_accuracy, state.best_step = dev["accuracy"], state.step
            state.evals_since_best = 0
            best = dev
        else:
            state.evals_since_best += 1
            best = None
        self._say(f"step {state.step}/{cfg.steps}  dev acc {dev['accuracy']:.4f}  loss "
                  f"{dev['loss']:.4f}  (best {state.best_accuracy:.4f} at {state.best_step})  "
                  f"{state.train_seconds:.0f}s, {state.step / max(state.train_seconds, 1e-9):.2f} "
                  "steps/s")
        return best

    def _patience_exhausted(self) -> bool:
        """True once ``patience`` evaluations in a row brought no dev improvement."""
        patience = self.cfg.patience
        return patience is not None and self.state.evals_since_best >= patience

    def _loop(self) -> bool:
        """Train until ``steps`` or early stopping (True), or until ``stop_after`` (False)."""
        cfg, state = self.cfg, self.state
        if self._patience_exhausted():  # resumed after stopping early, before result.json
            self._say(f"the run stopped early at step {state.step} (no dev improvement in "
                      f"{cfg.patience} evaluations): evaluating the best checkpoint")
            return True
        if self.stop_after is not None and self.stop_after <= state.step < cfg.steps:
            if self.resumed_at is None:  # a new run stopped at step 0: a checkpoint to resume
                self._save_last()
            return False  # nothing to train; the caller says so (run() returns None)
        checkpoint_every = cfg.checkpoint_every or cfg.eval_every
        self.model.train()
        reset_peak_memory(self.device)
        segment = time.perf_counter()
        log_steps, log_seconds = 0, 0.0  # training time only: evaluations do not count
        while state.step < cfg.steps:
            self._train_step()
            log_steps += 1
            at_log = state.step % cfg.log_every == 0
            at_eval = state.step % cfg.eval_every == 0 or state.step == cfg.steps
            stop_here = self.stop_after is not None and state.step >= self.stop_after
            at_ckpt = state.step % checkpoint_every == 0 or state.step == cfg.steps or stop_here
            if not (at_log or at_eval or at_ckpt):
                continue
            self._sync()
            now = time.perf_counter()
            state.train_seconds += now - segment
            state.wall_seconds += now - segment
            log_seconds += now - segment
            state.peak_memory = max(state.peak_memory, peak_memory_bytes(self.device))
            if at_log:
                self._log_train(log_steps, log_seconds)
                log_steps, log_seconds = 0, 0.0
            best = self._evaluate_dev() if at_eval else None
            done_early = at_eval and self._patience_exhausted()
            if at_ckpt or done_early or best is not None:
                self._save_last()  # before best.pt: never a best.pt beyond last.pt
            if best is not None:
                self._save_best(best)
            reset_peak_memory(self.device)  # the peak is the training's, not the evaluation's
            resumed = time.perf_counter()
            state.wall_seconds += resumed - now
            segment = resumed
            if done_early:
                self._say(f"no dev improvement in {cfg.patience} evaluations: stopping")
                return True
            if stop_here and state.step < cfg.steps:
                return False
        return True

    def _finish(self) -> dict[str, Any]:
        """Evaluate the best dev checkpoint on dev (whole split) and test; write result.json."""
        barrier(self.info)
        if self.info.is_main:
            best = load_checkpoint(self.folder / "best.pt", self.device)
            self.model.load_state_dict(best["model"])
        broadcast_state(self.model, self.info)
        kwargs = self._eval_kwargs()
        dev = evaluate(self.model, self.data.splits["dev"], **kwargs)
        test = evaluate(self.model, self.data.splits["test"], **kwargs)
        peaks = all_gather(torch.tensor([self.state.peak_memory], dtype=torch.int64), self.info)
        s = self.state
        # At the last step (not the best): a resumed run purges TensorBoard from the step
        # of last.pt, so the entry an interruption before result.json left goes with it.
        self.log.record("test", step=s.step, best_step=s.best_step, accuracy=test["accuracy"],
                        loss=test["loss"], dev_accuracy=dev["accuracy"], examples=test["count"])
        result = {
            "task": self.cfg.task,
            "attention": self.cfg.attention,
            "seed": self.cfg.seed,
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "dev_accuracy": dev["accuracy"],
            "best_step": s.best_step,
            "best_dev_accuracy_during_training": s.best_accuracy,
            "steps": s.step,
            "train_seconds": s.train_seconds,
            "wall_seconds": s.wall_seconds,
            "steps_per_second": s.step / s.train_seconds if s.train_seconds > 0 else None,
            "peak_memory_bytes": int(max(int(p) for p in peaks)),
            "peak_memory_kind": "cuda max_memory_allocated" if self.device.type == "cuda"
            else "max RSS",
            "world_size": self.info.world_size,
            "diverged_at_step": diverged_at(self.log.history),
            "synthetic_data": self.data.synthetic,
            "dev_is_test": bool(self.data.meta.get("dev_is_test", False)),
            "config": self.cfg.to_dict(),
            "model": dataclasses.asdict(self.model.cfg),
            # every option the attention ran with, a variant's and the defaults included:
            # the report groups by them without the method (a plugin) being registered
            "attention_ran_with": get_method(self.model.cfg.attention).bind(
                **self.model.cfg.attention_options).options(),
            "data": self.data.meta,  # the splits' sizes and digests tell the data apart
            "environment": environment(self.device),
            "command": self.command,  # the invocation that finished the run (None: Python)
        }
        if self.info.is_main:
            write_json(self.folder / "result.json", result)
        self._say(f"best dev step {s.best_step}: dev acc {dev['accuracy']:.4f}, test acc "
                  f"{test['accuracy']:.4f}  ({self.folder / 'result.json'})")
        return result

    def run(self) -> dict[str, Any] | None:
        self.info, self.device = init_distributed(self.device_request)
        try:
            with contextlib.ExitStack() as stack:
                refusal = None
                if self.info.is_main:  # one run at a time in a folder (io.folder_lock)
                    try:
                        stack.enter_context(folder_lock(self.folder))
                    except (ValueError, OSError) as err:  # in use, or cannot be made
                        refusal = err
                refuse_everywhere(self.info, refusal, f"taking the lock of {self.folder}")
                return self._run_in_folder()
        finally:
            shutdown(self.info)

    def _run_in_folder(self) -> dict[str, Any] | None:
        """``run`` once the folder is this run's alone."""
        self._build()
        resumed = self._restore()
        self.resumed_at = self.state.step if resumed else None
        removed = remove_interrupted_writes(self.folder, ATOMIC_FILES) \
            if self.info.is_main else []
        if removed:
            self._say(f"removed {len(removed)} temporary file(s) of writes an interruption "
                      f"cut short: {', '.join(p.name for p in removed)}")
        finished = finished_result(self.folder, self.cfg, self.state.step) if resumed \
            else finished_without_checkpoint(self.folder, self.cfg) if self.resume else None
        check_processes_agree(self.info, self.cfg.to_dict(), data_fingerprint(self.data.meta),
                              self.stop_after, self.state.step, finished is not None,
                              self.folder)
        if finished is not None:
            self._say(f"{self.folder} is finished (result.json); nothing to do")
            return finished
        if resumed:
            self._check_best()
            self._say(f"resumed {self.folder} at step {self.state.step}")
        elif self.info.is_main and 0 < self.cfg.steps <= self.cfg.warmup:
            _log.warning(f"the warm-up of {self.cfg.warmup} steps (the task's preset unless "
                         f"--warmup is given) is not shorter than the run's {self.cfg.steps} "
                         f"steps: the learning rate rises for the whole run, reaching "
                         f"{self.cfg.lr:g} at its last step at most, and never decays; give a "
                         f"shorter --warmup, e.g. {self.cfg.steps // 10} (0: no warm-up)")
        self.net = self.model
        if self.info.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids)
        if self.info.is_main:
            write_json(self.folder / "config.json", {
                "train": self.cfg.to_dict(), "model": dataclasses.asdict(self.model.cfg),
                "data": dict(self.data.meta.items()),
                "world_size": self.info.world_size, "environment": environment(self.device),
            })
        self.log = RunLog(self.folder, enabled=self.info.is_main, history=self.state.history,
                          tensorboard=self.tensorboard,
                          purge_step=self.state.step)  # 0 for a new run
        try:
            finished = self._loop()
            return self._finish() if finished else None
        finally:
            self.log.close()


def train(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any] | None:
    """Train ``cfg`` (see ``Trainer`` for the keyword arguments)."""
    return Trainer(cfg, **kwargs).run()
