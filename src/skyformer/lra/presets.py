"""Training settings: one frozen ``TrainConfig`` and the papers' per-task presets.

Skyformer paper, section 5: batch size 16 (Text), 32 (ListOps), 16 (Retrieval),
128 (Pathfinder), 256 (Image); learning rate 1e-4 (Text, ListOps, Image) and 2e-4
(Retrieval, Pathfinder); 50k steps; the best dev checkpoint is evaluated on test.
Warm-up steps and evaluation intervals follow the configuration of the PyTorch LRA
code the paper used (AdamW, weight decay 0, linear warm-up then linear decay); that
configuration's Text batch is 32, not the paper's 16.
That configuration also lists a patience of 10 evaluations, but the paper trains every
model for the full 50k steps, so early stopping is off unless ``patience`` is set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_positive_int
from ..eval.methods import setting_name
from ..registry import get_method
from ..seeds import check_seed
from .tasks import get_task

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; written into every checkpoint and result.

    batch_size is the global batch (summed over processes and accumulation steps).
    eval_batches limits each dev evaluation to that many batches (None = the whole dev
    split); the final test evaluation always covers the whole test split.
    max_len: tokens per document used for training (None = the prepared length;
    smaller values truncate).
    grad_clip: largest gradient norm (``clip_grad_norm_``); grad_clip_value: largest
    absolute gradient entry (``clip_grad_value_``, as the reference code clips at 1).
    At most one of them is set.
    """

    task: str
    attention: str = "skyformer"
    attention_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    steps: int = 50_000
    batch_size: int = 32
    lr: float = 1e-4
    warmup: int = 1000
    weight_decay: float = 0.0
    eval_every: int = 500
    eval_batches: int | None = None
    patience: int | None = None
    grad_accum: int = 1
    grad_clip: float | None = None
    grad_clip_value: float | None = None
    precision: str = "fp32"
    dim: int = 64
    hidden: int = 128
    heads: int = 2
    layers: int = 2
    dropout: float = 0.1
    max_len: int | None = None
    log_every: int = 100
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        get_task(self.task)
        get_method(self.attention)
        if not isinstance(self.attention_options, dict):
            raise TypeError(f"attention_options must be a dict, got {self.attention_options!r}.")
        # NumPy scalars (a sweep's np.logspace learning rates) as Python numbers: the
        # config is saved in every checkpoint, and torch.load(weights_only=True) refuses
        # them, which failed the run at its end (its best.pt unreadable) and its resume
        for item in dataclasses.fields(self):
            object.__setattr__(self, item.name, _plain(getattr(self, item.name)))
        positive = ("steps", "batch_size", "eval_every", "grad_accum", "log_every", "dim",
                    "hidden", "heads", "layers")
        for name in positive:
            check_positive_int(setting_name(name), getattr(self, name))
        for name in ("eval_batches", "patience", "max_len", "checkpoint_every"):
            check_positive_int(setting_name(name), getattr(self, name), optional=True)
        check_seed(setting_name("seed"), self.seed)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"{setting_name('warmup')} must be an integer >= 0, got "
                             f"{self.warmup!r}.")
        if self.dim % self.heads:
            raise ValueError(f"{setting_name('dim')} must be divisible by "
                             f"{setting_name('heads')}, got {self.dim} and {self.heads}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{setting_name('dropout')} must be in [0, 1), got "
                             f"{self.dropout!r}.")
        if not (math.isfinite(self.lr) and self.lr > 0):  # inf trains NaN weights to the end
            raise ValueError(f"{setting_name('lr')} must be a positive finite number, got "
                             f"{self.lr!r}.")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"{setting_name('weight_decay')} must be a finite number >= 0, "
                             f"got {self.weight_decay!r}.")
        for name in ("grad_clip", "grad_clip_value"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # inf: no clipping (NaN is refused)
                raise ValueError(f"{setting_name(name)} must be positive or None, got "
                                 f"{value!r}.")
        if self.grad_clip is not None and self.grad_clip_value is not None:
            raise ValueError(f"{setting_name('grad_clip')} (the norm) and "
                             f"{setting_name('grad_clip_value')} (each entry) are both set; "
                             f"give one way to clip gradients.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{setting_name('precision')} must be one of "
                             f"{', '.join(PRECISIONS)}, got {self.precision!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _plain(value: Any) -> Any:
    """``value`` with every NumPy scalar or 0-d array (``np.array(3e-3)``), in dicts (keys
    too: ``np.str_``), lists and tuples, as the Python value it holds; anything else as
    it is."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if type(value) in (list, tuple):  # not a named tuple, built otherwise
        return type(value)(_plain(item) for item in value)
    return value


# Per task: the paper's batch size and learning rate; warm-up, evaluation interval and
# dev batches per evaluation from the reference configuration.
PRESETS: dict[str, dict[str, Any]] = {
    "text": {"batch_size": 16, "lr": 1e-4, "warmup": 80, "eval_every": 500, "eval_batches": 200},
    "listops": {
        "batch_size": 32,
        "lr": 1e-4,
        "warmup": 1000,
        "eval_every": 500,
        "eval_batches": 62,
    },
    "retrieval": {
        "batch_size": 16,
        "lr": 2e-4,
        "warmup": 800,
        "eval_every": 1000,
        "eval_batches": 300,
    },
    "pathfinder": {
        "batch_size": 128,
        "lr": 2e-4,
        "warmup": 312,
        "eval_every": 500,
        "eval_batches": 156,
    },
    "image": {"batch_size": 256, "lr": 1e-4, "warmup": 175, "eval_every": 50, "eval_batches": 20},
}

# A few minutes on a CPU: checks that everything runs and the loss moves, not accuracy.
QUICK: dict[str, Any] = {
    "steps": 200,
    "eval_every": 50,
    "warmup": 20,
    "eval_batches": 4,
    "log_every": 10,
}
QUICK_MAX_BATCH = 16


def make_config(task: str, *, quick: bool = False, **overrides: Any) -> TrainConfig:
    """The preset of ``task`` (optionally the ``quick`` one) with ``overrides`` applied.

    Overrides that are None are ignored, so CLI defaults can be passed straight through.
    """
    get_task(task)
    values: dict[str, Any] = dict(PRESETS[task])
    if quick:
        values.update(QUICK)
        values["batch_size"] = min(values["batch_size"], QUICK_MAX_BATCH)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"unknown training setting(s) {', '.join(unknown)}; settings: "
            f"{', '.join(sorted(names))}."
        )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(task=task, **values)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``lr`` over
    ``warmup`` steps, then linear decay to 0 at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    remaining = cfg.steps - step
    return cfg.lr * max(0.0, remaining / max(1, cfg.steps - cfg.warmup))
