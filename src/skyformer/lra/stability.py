"""``skyformer lra stability``: the instability score of Skyformer Appendix F (Table 3).

After Liu et al. (2020), for the first ``steps`` (20) updates of training,

    tau_i = ||f(x_i, W_i) - f(x_i, W_{i-1})||_F^2 / ||W_i - W_{i-1}||_F^2 ,

with f the embedding after the two transformer layers (``LRAClassifier.embed``), x_i the
i-th training batch, W_0 the initial and W_i the parameters after step i. A method's
score on a task is the mean over the steps of tau_i(method) / tau_i(softmax); below 1
means more stable than softmax attention.

"The embedding after two layers" can be read two ways, and the reading matters:
``probe="normed"`` (default) takes the encoder's output as the reference model returns
it, after its final LayerNorm; ``probe="hidden"`` takes the raw output of the second
layer. Kernelized attention ``C V`` is not normalised (a sum over keys, not an
average), so its raw hidden states are far larger than softmax's and change
correspondingly more; the final LayerNorm removes that scale.

To compare like with like, every method starts from the same W_0 (every parameter it
shares with softmax's model of the same seed is that model's; a method's own, such as
Linformer's projections, are its own draws) and sees the same batches with the same dropout
masks, under the task's training settings (optimizer, learning-rate schedule, dropout,
gradient clipping; precision and grad_accum other than fp32 and 1 are refused). f is
evaluated without dropout, in float64 (early learning rates are tiny, and float32
rounding would swamp the change), and with the same attention randomness
(landmarks, features) and the same method state (buffers: Performer's features, redrawn
by training calls) before and after the step, so that tau measures the effect of the
parameter change only.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..devices import parse_device
from ..eval.methods import refuse_repeated_methods, setting_name
from ..io import environment, json_ready
from ..registry import get_method
from ..registry.variants import refuse_swept_option
from .batches import BatchOrder, Position, fetch
from .cache import data_fingerprint, load_cache
from .model import LRAClassifier, ModelConfig, resolve_attention_options
from .presets import TrainConfig, learning_rate, make_config
from .seeds import derive_seed
from .tasks import TASKS
from .train import model_config

BASELINE = "softmax"


def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


@torch.no_grad()
def _embedding(copy64: LRAClassifier, tokens, lengths, seed: int, probe: str) -> torch.Tensor:
    """f(x, W): ``copy64`` (a float64 copy in eval mode) on ``tokens: [B, S, N]``, with the
    attention draws of ``seed``."""
    generator = torch.Generator(device=tokens.device).manual_seed(seed)
    return copy64.embed(tokens, lengths, generator=generator, normed=probe == "normed")


@torch.no_grad()
def _set_parameters(copy64: LRAClassifier, model: LRAClassifier) -> LRAClassifier:
    """``copy64`` with the parameters of ``model`` and its own buffers: a method's state
    that training calls change (Performer's redrawn features) stays that of before the
    step, so f changes by the parameter change alone."""
    for mine, new in zip(copy64.parameters(), model.parameters(), strict=True):
        mine.copy_(new)
    return copy64


PROBES = ("normed", "hidden")


@torch.no_grad()
def initial_model(mcfg: ModelConfig, seed: int, device: torch.device) -> LRAClassifier:
    """The model of ``mcfg`` at W_0: every parameter it shares (name and shape) with the
    softmax model built from ``seed`` holds that model's value. Building a method can draw
    from torch's generator (Performer's features) or add parameters (Linformer's
    projections) before the later layers are initialised, which would otherwise start
    each method from other values."""
    torch.manual_seed(seed)
    model = LRAClassifier(mcfg)
    torch.manual_seed(seed)
    softmax = LRAClassifier(dataclasses.replace(mcfg, attention=BASELINE, attention_options={}))
    own = dict(model.named_parameters())
    for name, value in softmax.named_parameters():
        if name in own and own[name].shape == value.shape:
            own[name].copy_(value)
    return model.to(device)


def check_measurable(cfg: TrainConfig) -> None:
    """Refuse the training settings that the measured steps do not follow: they train in
    float32 on whole batches (gradient clipping, as Table 1's settings, does apply)."""
    if cfg.precision != "fp32":
        raise ValueError(f"precision {cfg.precision} is not applied by the instability score, "
                         "whose steps train in float32 (f is evaluated in float64); leave "
                         "precision at fp32.")
    if cfg.grad_accum != 1:
        raise ValueError(f"grad_accum {cfg.grad_accum} is not applied by the instability "
                         "score, whose steps take each batch whole (the same mean gradient); "
                         "leave grad_accum at 1.")


def _clip_gradients(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """Clip the gradients as a training step of ``cfg`` does (norm or each entry)."""
    if cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if cfg.grad_clip_value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), cfg.grad_clip_value)


def instability_taus(cfg: TrainConfig, cache_root: str | os.PathLike[str], *, steps: int = 20,
                     device: torch.device | str = "cpu", probe: str = "normed") -> list[float]:
    """tau_1 .. tau_steps of one method (``cfg.attention``) on ``cfg.task``."""
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {', '.join(PROBES)}, got {probe!r}.")
    check_measurable(cfg)
    device = torch.device(device)
    data = load_cache(cache_root, cfg.task)
    mcfg = model_config(cfg, data)
    split = data.splits["train"]
    model = initial_model(mcfg, cfg.seed, device)
    torch.manual_seed(derive_seed(cfg.seed, 0, 1))
    attention_generator = torch.Generator(device=device).manual_seed(derive_seed(cfg.seed, 0, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-6,
                                  weight_decay=cfg.weight_decay)
    order = BatchOrder(len(split), cfg.batch_size, cfg.seed)
    position = Position()
    taus = []
    for step in range(steps):
        tokens, lengths, labels = fetch(split, order.batch(position), device, mcfg.max_len)
        probe_seed = derive_seed(cfg.seed, 4, step)
        copy64 = copy.deepcopy(model).double().eval()
        before = _embedding(copy64, tokens, lengths, probe_seed, probe)
        w_before = _flat_parameters(model)
        model.train()
        loss = F.cross_entropy(model(tokens, lengths, generator=attention_generator), labels)
        loss.backward()
        _clip_gradients(model, cfg)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = _embedding(_set_parameters(copy64, model), tokens, lengths, probe_seed, probe)
        dw = (_flat_parameters(model) - w_before).square().sum().item()
        if dw == 0:
            raise ValueError(f"step {step + 1} did not change the parameters (learning rate "
                             f"{learning_rate(step, cfg)}); the instability score is undefined.")
        taus.append((after - before).square().sum().item() / dw)
        position = order.next(position)
    return taus


@dataclass
class StabilityReport:
    """Scores of Table 3 and the tau values behind them."""

    tasks: list[str]
    methods: list[str]
    seeds: list[int]
    steps: int
    probe: str = "normed"
    taus: dict[str, dict[str, dict[int, list[float]]]] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    num_features: int | None = None  # as asked for (None: each method's own)
    attention_options: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    data: dict[str, dict[str, Any]] = field(default_factory=dict)  # per task, its meta.json
    environment: dict[str, Any] = field(default_factory=dict)

    def ratio(self, task: str, method: str) -> float:
        """Mean over seeds of the mean over steps of tau(method) / tau(softmax)."""
        per_seed = []
        for seed in self.seeds:
            base = self.taus[task][BASELINE][seed]
            mine = self.taus[task][method][seed]
            per_seed.append(statistics.fmean(a / b for a, b in zip(mine, base, strict=False)))
        return statistics.fmean(per_seed)

    def measured(self, task: str, method: str) -> bool:
        """Whether every seed of ``method`` on ``task`` has its taus."""
        return all(seed in self.taus.get(task, {}).get(method, {}) for seed in self.seeds)

    @property
    def complete(self) -> bool:
        return all(self.measured(t, m) for t in self.tasks for m in [BASELINE, *self.methods])

    def to_dict(self) -> dict[str, Any]:
        """Everything the scores depend on: ``settings`` (training, per task; shared by the
        methods and seeds), ``num_features`` as asked for, ``attention_options`` (per task and
        method, every option the method ran with, defaults included), ``data`` (per task,
        the prepared data's ``meta.json`` without its source path and time) and the
        environment.
        A report still being measured (``complete`` false) has the ratios measured so far."""
        return {
            "tasks": self.tasks, "methods": self.methods, "seeds": self.seeds,
            "steps": self.steps, "probe": self.probe, "baseline": BASELINE,
            "num_features": self.num_features, "complete": self.complete,
            "ratios": {t: {m: self.ratio(t, m) for m in self.methods
                           if self.measured(t, m) and self.measured(t, BASELINE)}
                       for t in self.tasks},
            "taus": {t: {m: {str(s): v for s, v in per.items()} for m, per in methods.items()}
                     for t, methods in self.taus.items()},
            "settings": self.settings,
            "attention_options": self.attention_options,
            "data": self.data,
            "environment": self.environment,
        }


def run_stability(tasks: list[str], methods: list[str], *, cache_root: str | os.PathLike[str],
                  seeds: list[int] | tuple[int, ...] = (0,), steps: int = 20,
                  device: torch.device | str = "cpu", num_features: int | None = None,
                  probe: str = "normed", overrides: dict[str, Any] | None = None,
                  progress: Callable[[str], None] | None = None,
                  earlier: dict[str, Any] | None = None,
                  on_measured: Callable[[StabilityReport], None] | None = None
                  ) -> StabilityReport:
    """Instability scores of ``methods`` relative to softmax on ``tasks``.

    overrides: training settings applied to every task's preset (e.g. ``batch_size``,
    ``max_len`` to fit a CPU). num_features: set for every method that has the option.
    earlier: a report's ``to_dict()`` (an interrupted run's) whose taus are kept instead of
    measured again; it must have been measured with the same settings (each
    measurement seeds itself, so the result is that of an uninterrupted run).
    on_measured: called with the report after each new measurement (to save it).
    """
    if steps < 1:
        raise ValueError(f"{setting_name('steps')} must be at least 1, got {steps}.")
    device = parse_device(device)
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown LRA task {task!r}; tasks: {', '.join(TASKS)}.")
        if list(tasks).count(task) > 1:  # measured twice, the second replacing the first
            raise ValueError(f"tasks lists {task} more than once; give each task once.")
    refuse_repeated_methods(methods)
    compared = [m for m in methods if m != BASELINE]
    for method in compared:
        spec = get_method(method)
        if num_features is not None:  # the row would keep the variant's name
            refuse_swept_option(spec.name, spec.preset, "num_features",
                                "lra stability (--features)")
    if not compared:
        raise ValueError(f"no method to compare with {BASELINE}, the baseline of every ratio; "
                         "name at least one other method.")
    report = StabilityReport(list(tasks), compared, list(seeds), steps, probe,
                             num_features=num_features, environment=environment(device))
    plan = _configs(tasks, [BASELINE, *compared], seeds, num_features, overrides or {})
    report.attention_options, report.data = _check_configs(plan, cache_root)
    for (task, _, _), cfg in plan.items():
        report.settings.setdefault(task, {k: v for k, v in cfg.to_dict().items()
                                          if k not in ("attention", "attention_options", "seed")})
    kept = resumable_taus(report, earlier) if earlier is not None else {}
    for task in tasks:
        report.taus[task] = {}
        for method in [BASELINE, *compared]:
            report.taus[task][method] = {}
            for seed in seeds:
                if (task, method, seed) in kept:
                    report.taus[task][method][seed] = kept[task, method, seed]
                    continue
                cfg = plan[task, method, seed]
                taus = instability_taus(cfg, cache_root, steps=steps, device=device, probe=probe)
                report.taus[task][method][seed] = taus
                if progress:
                    progress(f"{task} {method} seed {seed}: mean tau {np.mean(taus):.4g}")
                if on_measured:
                    on_measured(report)
    return report


# What taus depend on besides the task's settings and the method's options.
RESUMABLE_ENVIRONMENT = ("device", "device_name", "torch")


def resumable_taus(report: StabilityReport, earlier: dict[str, Any]
                   ) -> dict[tuple[str, str, int], list[float]]:
    """The taus of ``earlier`` (a report's ``to_dict()``) that ``report`` (settings and
    options resolved, nothing measured) asks for: (task, method, seed) -> taus. Raises a
    sentence naming what differs where they were measured otherwise."""
    if not (isinstance(earlier, dict) and isinstance(earlier.get("taus"), dict)
            and earlier.get("baseline") == BASELINE):
        raise ValueError("not an lra stability result (an object with taus, settings and "
                         "attention_options, as --json writes).")
    now = report.to_dict()
    differ = [f"{name}: {earlier.get(name)!r} -> {now[name]!r}"
              for name in ("steps", "probe") if earlier.get(name) != now[name]]
    env = earlier.get("environment", {})
    differ += [f"{name}: {env.get(name)!r} -> {report.environment.get(name)!r}"
               for name in RESUMABLE_ENVIRONMENT if env.get(name) != report.environment.get(name)]
    kept = {}
    for task, methods in earlier["taus"].items():
        if task not in report.tasks:
            continue
        changed = _changed_settings(earlier.get("settings", {}).get(task),
                                    json_ready(now["settings"][task]))
        if changed:
            differ.append(f"the training settings of {task} ({changed})")
        then = earlier.get("data", {}).get(task)  # None: written before data was recorded
        if then is not None and then != json_ready(now["data"][task]):
            keys = sorted(k for k in {*then, *now["data"][task]}
                          if then.get(k) != json_ready(now["data"][task].get(k)))
            differ.append(f"the prepared data of {task} ({', '.join(keys)})")
        for method, per_seed in methods.items():
            if method != BASELINE and method not in report.methods:
                continue
            options = (earlier.get("attention_options", {}).get(task) or {}).get(method)
            current = json_ready(report.attention_options[task][method])
            if current != options:  # each option that differs, then -> now
                then = options if isinstance(options, dict) else {}
                said = ", ".join(f"{key}: {then.get(key)!r} -> {current.get(key)!r}"
                                 for key in sorted({*then, *current}, key=str)
                                 if then.get(key) != current.get(key))
                differ.append(f"the options of {method} on {task} "
                              f"({said if isinstance(options, dict) else 'none recorded'})")
            kept.update({(task, method, int(seed)):  # a NaN tau is written as null
                         [math.nan if tau is None else tau for tau in taus]
                         for seed, taus in per_seed.items()
                         if int(seed) in report.seeds})
    if differ:
        raise ValueError(f"the earlier taus were measured with other settings "
                         f"({', '.join(differ)}); resume with the same ones, or write to "
                         "another --json.")
    return kept


def stability_file_problem(earlier: Any) -> str | None:
    """What keeps ``earlier`` (a ``--json`` file read) from being a report's
    ``to_dict()``, in a phrase; None where its parts have their shapes: ``taus`` as
    {task: {method: {seed: [tau, ...]}}} (seeds integers, taus numbers or null), and
    ``settings``, ``attention_options``, ``data`` and ``environment`` objects."""
    if not isinstance(earlier, dict) or not isinstance(earlier.get("taus"), dict):
        return "not an object with taus"
    for name in ("settings", "attention_options", "data", "environment"):
        if not isinstance(earlier.get(name, {}), dict):
            return f"its {name} is no object"
    for name in ("settings", "attention_options", "data"):  # per task: an object or null
        for task, value in earlier.get(name, {}).items():
            if not isinstance(value, dict | None):
                return f"its {name} of {task} is no object"
    for task, per_method in earlier.get("attention_options", {}).items():
        for method, options in (per_method or {}).items():
            if not isinstance(options, dict | None):
                return f"its attention_options of {method} on {task} are no object"
    for task, methods in earlier["taus"].items():
        if not isinstance(methods, dict):
            return f"its taus of {task} are no object of methods"
        for method, per_seed in methods.items():
            if not isinstance(per_seed, dict):
                return f"its taus of {method} on {task} are no object of seeds"
            for seed, taus in per_seed.items():
                if not str(seed).lstrip("-").isdigit():
                    return f"its taus of {method} on {task} name the seed {seed!r}"
                if not isinstance(taus, list) or not all(
                        tau is None or (isinstance(tau, int | float)
                                        and not isinstance(tau, bool)) for tau in taus):
                    return f"its taus of {method} on {task}, seed {seed}, are no list of numbers"
    return None


def taus_left_out(earlier: dict[str, Any], tasks: list[str], methods: list[str],
                  seeds: list[int]) -> list[str]:
    """``task method seed N`` of every tau that ``earlier`` (a report's ``to_dict()``)
    holds and a run of ``tasks``, ``methods`` (softmax besides them) and ``seeds`` does not
    ask for: a file rewritten by that run would lose them."""
    asked = {BASELINE, *methods}
    return [f"{task} {method} seed {seed}"
            for task, per_method in earlier.get("taus", {}).items()
            for method, per_seed in per_method.items() for seed in per_seed
            if task not in tasks or method not in asked or int(seed) not in seeds]


def _changed_settings(then: Any, now: dict[str, Any]) -> str:
    """``batch_size: 16 -> 32, ...``: the training settings of a task that differ between an
    earlier report's (``then``, as its JSON holds them) and ``now``; empty when none do.
    The seed, which files written before held, is no setting of a task."""
    if not isinstance(then, dict):
        return f"none recorded -> {now!r}"
    then = {k: v for k, v in then.items() if k != "seed"}
    return ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in sorted({*then, *now})
                     if then.get(k) != now.get(k))


def _configs(tasks: list[str], methods: list[str], seeds: list[int] | tuple[int, ...],
             num_features: int | None, overrides: dict[str, Any]
             ) -> dict[tuple[str, str, int], TrainConfig]:
    """The training config of every (task, method, seed), in the order they run."""
    plan = {}
    for task in tasks:
        for method in methods:
            options = {}
            if num_features is not None and "num_features" in get_method(method).option_names():
                options["num_features"] = num_features
            for seed in seeds:
                plan[task, method, seed] = make_config(task, attention=method, seed=seed,
                                                       attention_options=options, **overrides)
    return plan


def _check_configs(plan: dict[tuple[str, str, int], TrainConfig],
                   cache_root: str | os.PathLike[str]
                   ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Fail before the first measurement, not after the earlier ones: every task is
    prepared, fits its length and the batch size, and every method takes its options.
    Returns, per task and method, every option the method runs with (defaults
    included), and per task the prepared data's record (``data_fingerprint``)."""
    data, ran_with = {}, {}
    for cfg in plan.values():
        check_measurable(cfg)
        if cfg.task not in data:
            data[cfg.task] = load_cache(cache_root, cfg.task)
        mcfg = model_config(cfg, data[cfg.task])
        BatchOrder(len(data[cfg.task].splits["train"]), cfg.batch_size, cfg.seed)  # fits?
        resolved = resolve_attention_options(cfg.attention, cfg.attention_options, mcfg.max_len)
        spec = get_method(cfg.attention)
        ran_with.setdefault(cfg.task, {})[cfg.attention] = spec.options_of(
            spec.make_config(**resolved))
    return ran_with, {task: data_fingerprint(d.meta) for task, d in data.items()}


def format_table(report: StabilityReport) -> str:
    """Table 3's layout: methods as rows, tasks as columns in the papers' order (that of
    Table 1), ratios to softmax."""
    tasks = [task for task in TASKS if task in report.tasks]
    titles = [TASKS[t].title for t in tasks]
    lines = ["Table 3: ratios of instability score (method / softmax, mean over "
             f"{report.steps} steps and {len(report.seeds)} seed(s); f = {report.probe} "
             "encoder output); < 1 = more stable.", "",
             "| model | " + " | ".join(titles) + " |",
             "|" + "|".join(" --- " for _ in range(len(titles) + 1)) + "|"]
    for method in report.methods:
        cells = [f"{report.ratio(t, method):.2f}" for t in tasks]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
