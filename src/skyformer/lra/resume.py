"""Whether a ``skyformer lra train`` run may start or resume in its folder.

A run resumes from ``last.pt`` only with the settings, the prepared data and the
``best.pt`` it was written with; a new run starts only in a folder without an earlier
run's results. Each refusal names the difference and the way out (``--resume``,
another ``--out``, the files to put back or remove). Nothing here trains or builds a
model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..io import json_ready, json_text
from ..registry.variants import canonical_variant
from .cache import TaskData, data_fingerprint
from .checkpoint import load_checkpoint
from .model import ModelConfig
from .presets import TrainConfig
from .runlog import KINDS, read_entries

CHECKPOINT_FORMAT = 1


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


# The files a new run writes over or removes (an attempt without checkpoint left them)
REPLACED_FILES = ("config.json", "metrics.jsonl", *(f"{kind}.csv" for kind in KINDS))


def _is_run_config(path: Path) -> bool:
    """Whether ``path`` is the ``config.json`` a run writes (its train and model
    settings), not a file of another tool's that shares the name."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and all(isinstance(config.get(key), dict)
                                            for key in ("train", "model"))


def files_not_of_a_run(folder: Path) -> list[str]:
    """The files in ``folder`` that a new run would write over or remove
    (``REPLACED_FILES``) where they are not a run's: a run writes its config.json first,
    so without one of its own they are the user's (``train.csv`` of a dataset, another
    tool's ``config.json``)."""
    present = [name for name in REPLACED_FILES if (folder / name).is_file()]
    if not present or _is_run_config(folder / "config.json"):
        return []
    return present


def check_fresh_folder(folder: Path) -> None:
    """Refuse to start a new run in ``folder`` when it holds an earlier run's files but no
    ``last.pt`` to continue that run from, or files of the names a run writes that no run
    wrote."""
    found = earlier_run_files(folder)
    if found:
        raise ValueError(f"{folder} holds files of an earlier run ({', '.join(found)}) but no "
                         "last.pt to continue it from; choose another --out (to discard that "
                         "run instead, remove those files).")
    foreign = files_not_of_a_run(folder)
    if foreign:
        raise ValueError(f"{folder} holds {', '.join(foreign)}, which a run writes over or "
                         f"removes, and no config.json of a run: they are not a run's; "
                         f"choose another --out (a new or empty folder).")


def _config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


# Settings a resume may change: when the run logs and writes last.pt, which changes no
# step's arithmetic (the run ends as an uninterrupted one with the new values would).
CHANGEABLE_AT_RESUME = ("log_every", "checkpoint_every")


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded config without ``CHANGEABLE_AT_RESUME``: what a resume must match, its
    attention in one form however it was written (``canonical_variant``: a variant's
    brackets or ``--option``, in any order)."""
    out = {k: v for k, v in config.items() if k not in CHANGEABLE_AT_RESUME}
    if isinstance(out.get("attention"), str) and isinstance(out.get("attention_options"),
                                                            dict | None):
        out["attention"], out["attention_options"] = canonical_variant(
            out["attention"], out.get("attention_options") or {})
    return out


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
                         f"(found {type(ckpt).__name__}, format {fmt!r}); point --out at "
                         f"the run's own folder, or move that file away (or choose another "
                         f"--out) to start a new run.")
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
    same files prepared again, checked on the sizes and counts it recorded; and with
    the difficulty ``saved`` recorded for generated Pathfinder data (its folder's name,
    before the reader recorded "synthetic")."""
    if saved.get("synthetic") is True and current.get("difficulty") == "synthetic":
        # generated Pathfinder recorded its folder's name before: any name is this data
        current = {**current, "difficulty": saved.get("difficulty")}
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
    at ``step`` (its settings but ``CHANGEABLE_AT_RESUME``), else None."""
    result = _stored_result(folder)
    config = json_ready(cfg.to_dict())  # as written: an infinite setting is null
    recorded = None if result is None else result.get("config")
    # the same settings but those a resume may change (another --log-every leaves a
    # finished run as it is, where it was evaluated and written again)
    if not isinstance(recorded, dict) or _settings(recorded) != _settings(config) \
            or result.get("steps") != step:
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
