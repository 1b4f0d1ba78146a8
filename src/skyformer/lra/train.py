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
    portable_name,
    remove_interrupted_writes,
    write_json,
)
from ..logs import get_logger
from ..ops.performer import features_held
from ..registry import get_method
from ..registry.variants import canonical_variant, variant_name
from .batches import BatchOrder, Position, fetch, micro_batches
from .cache import TaskData, data_fingerprint, load_cache
from .checkpoint import (
    device_rng_state,
    device_rng_state_fits,
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
from .evaluate import correct_predictions, evaluate
from .metrics import Running, cpu_peak_resets, peak_memory_bytes, reset_peak_memory
from .model import LRAClassifier, ModelConfig
from .presets import TrainConfig, learning_rate
from .resume import (
    ATOMIC_FILES,
    CHECKPOINT_FORMAT,
    best_checkpoint_step,
    best_dev_entry,
    check_best_checkpoint,
    check_same_data,
    finished_result,
    finished_without_checkpoint,
    open_checkpoint,
)
from .runlog import RunLog
from .seeds import derive_seed

_log = get_logger("lra")


def default_run_dir(cfg: TrainConfig) -> Path:
    """``runs/lra/TASK/METHOD/seedN``, METHOD carrying the attention options in its
    brackets (``skyformer[num_features=32]``: runs of two options do not share a folder),
    in one form however they were written (``canonical_variant``: sorted, no spaces, in
    the brackets or as ``--option``), and made a portable file name (double quotes as
    single ones, ``portable_name``)."""
    method = variant_name(*canonical_variant(cfg.attention, dict(cfg.attention_options)))
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

    def _warn(self, text: str) -> None:
        """What ``--quiet`` still prints: a resume that differs from what was asked."""
        if self.info.is_main:
            _log.warning(text)

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
        if len(per_process) != self.info.world_size:
            other = (f"with {self.info.world_size} processes instead of {len(per_process)}: "
                     f"data order is kept but dropout and attention draws are reseeded, and "
                     f"evaluations of randomised attention draw on other batches")
        elif not device_rng_state_fits(per_process[self.info.rank], self.device,
                                       self.attention_generator):
            other = (f"on {self.device.type} a run whose checkpoint was written on another "
                     f"device type: data order is kept but dropout and attention draws "
                     f"are reseeded")
        else:
            other = None
        if other is None:
            set_device_rng_state(per_process[self.info.rank], self.device, self.attention_generator)
        else:
            self._warn(f"resuming {other}, so the run will not match an uninterrupted one "
                       f"exactly")
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
            # Performer's features: counted (and redrawn) once per step, as by K processes
            held = features_held(self.model) if j else contextlib.nullcontext()
            with sync, held:
                with self.autocast():
                    logits = self.net(tokens, lengths, generator=self.attention_generator)
                loss = F.cross_entropy(logits.float(), labels)
                self.scaler.scale(loss / cfg.grad_accum).backward()
            self.running.add(loss.detach() * labels.numel(),
                             correct_predictions(logits.detach(), labels), labels.numel())
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
        # first: the result's peak kind reads whether a reset took (a run resumed after
        # stopping early trains no step, and its peak is the checkpoint's)
        reset_peak_memory(self.device)
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
            else "peak RSS of the training steps" if cpu_peak_resets() else "max RSS",
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
        if self.info.is_main:
            remove_interrupted_writes(self.folder, ATOMIC_FILES, say=self._say)
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
            _log.warning(f"the warm-up of {self.cfg.warmup} steps (--warmup where given, "
                         f"else the task's preset or --quick's) is not shorter than the "
                         f"run's {self.cfg.steps} steps: the learning rate rises for the "
                         f"whole run, reaching "
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
