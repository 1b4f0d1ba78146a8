"""``skyformer bench --resume``: which rows of an earlier result file a run may keep,
the runs that measured them, and, where the settings differ, what to pass instead."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import torch

from ...io import json_ready, read_to_resume
from .run import ROW_KEYS, BenchConfig, _length_key, run_environment

# the settings a row's numbers depend on (``BenchConfig``'s fields; the methods are
# compared as the lists that run, see ``_methods_differ``)
RESUMABLE_SETTINGS = ("dtypes", "device", "num_features", "repeats", "warmup", "backward",
                      "memory", "error", "seed", "max_seconds", "reference", "clock",
                      "causal", "timing", "pause")
RESUMABLE_ENVIRONMENT = ("device_name", "torch", "torch_threads")
# the option that sets a setting, to say what to pass: valued options...
OPTIONS = {"dtypes": "--dtypes", "device": "--device", "num_features": "--features",
           "repeats": "--repeats", "warmup": "--warmup", "seed": "--seed",
           "max_seconds": "--max-seconds", "clock": "--clock", "timing": "--timing",
           "pause": "--pause"}
# ... and switches, with the value of the setting they give
SWITCHES = {"backward": ("--forward-only", False), "memory": ("--no-memory", False),
            "error": ("--no-error", False), "causal": ("--causal", True)}
# settings whose order is only that of the table's rows: the same ones in another
# order resume the run
ORDERLESS_SETTINGS = ("dtypes",)


def is_bench_result(data: object) -> bool:
    """Whether ``data`` has the shape of ``write_results``'s JSON."""
    return (isinstance(data, dict) and isinstance(data.get("config"), dict)
            and isinstance(data.get("environment"), dict) and isinstance(data.get("rows"), list)
            and all(isinstance(row, dict) for row in data["rows"]))


def read_earlier_result(path: Path) -> dict[str, Any] | None:
    """The result file ``path`` that ``--resume`` continues (None where there is none),
    refused in a sentence where it is not one of bench's or its rows lack what bench
    writes."""
    earlier = read_to_resume(path, "a bench result file", "--out")
    if earlier is None:
        return None
    if not is_bench_result(earlier):
        raise ValueError(f"cannot resume from {path}: not a bench result file (an object with "
                         "config, environment and a list of rows); write to another --out.")
    # files written before rows said which run measured them are resumed as one run
    missing = [key for key in ROW_KEYS
               if key != "run" and any(key not in row for row in earlier["rows"])]
    if missing:
        raise ValueError(f"cannot resume from {path}: its rows lack {', '.join(missing)}, "
                         "which bench writes (a file edited or of another version); write to "
                         "another --out.")
    return earlier


def refuse_to_replace_an_interrupted_run(path: Path) -> None:
    """A sentence where ``path`` holds a run that stopped before its end (``complete:
    false``): the interrupt note says to rerun with --resume, and a rerun from the shell
    history without it replaced the measured rows."""
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no file, or not one of bench's: written over as before
    if not (is_bench_result(earlier) and earlier.get("complete") is False):
        return
    lengths = _measured_lengths(earlier)
    measured = f"N = {', '.join(map(str, lengths))} measured" if lengths else "nothing measured"
    raise ValueError(f"{path} holds a run that stopped before its end ({measured}): pass "
                     f"--resume to continue it, or remove it (or give another --out) to start "
                     f"again.")


def replacing_a_finished_run(path: Path) -> str | None:
    """The note a run without ``--resume`` prints where ``path`` holds a finished run,
    whose rows it replaces (lengths it does not measure again are gone): which lengths,
    and how to keep them. None where there is no such file."""
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (is_bench_result(earlier) and earlier.get("complete") is not False):
        return None
    lengths = _measured_lengths(earlier)
    held = f"N = {', '.join(map(str, lengths))}" if lengths else "no rows"
    return (f"note: replacing {path} (a finished run, {held}); --resume adds to it "
            f"instead, another --out keeps it.")


def _measured_lengths(earlier: dict[str, Any]) -> list[int]:
    """The sequence lengths an earlier result file holds rows of, in order."""
    return sorted({row.get("n") for row in earlier["rows"] if isinstance(row.get("n"), int)})


def resumable_rows(config: BenchConfig, earlier: dict[str, Any]
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows ``config`` may reuse, rows it does not ask for) of an earlier result file
    (``write_results``'s JSON), each with its ``run`` (0 where the file has none).
    Lengths and shapes may differ (rows are kept per shape and length); other settings,
    the methods that run, the device, torch and the thread count may not: raises a
    sentence naming each difference with the option and the value to pass."""
    # a setting added after the file was written ran as its default then
    defaults = {f.name: f.default for f in dataclasses.fields(BenchConfig)}
    before = {**defaults, **earlier.get("config", {})}
    env_before = earlier.get("environment", {})
    differ = [*_settings_differ(config, before), *_methods_differ(config, before, env_before),
              *_environment_differs(config, env_before)]
    if "runs" not in earlier and config.memory and config.backward and earlier.get("rows"):
        raise ValueError(
            "the earlier results were written before backward peaks left out the output "
            "gradient: theirs include one output-sized buffer, which new rows would not, and "
            "one table must not hold two definitions of peak memory; write to another --out "
            "(or resume them with --no-memory if they were measured without it).")
    if differ:
        raise ValueError(f"the earlier results were measured with other settings or on "
                         f"another machine ({'; '.join(differ)}); resume with the earlier "
                         "ones, or write to another --out.")
    asked = {(str(torch.device(config.device)), dtype, *shape, n) for shape in config.shapes
             for dtype in config.dtypes for n in config.seq_lens}
    rows = [{**row, "run": row.get("run", 0)} for row in earlier.get("rows", [])]
    return ([r for r in rows if _length_key(r) in asked],
            [r for r in rows if _length_key(r) not in asked])


def earlier_runs(earlier: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The runs whose rows the earlier result file ``source`` holds: its ``runs``, or,
    for a file written before they were kept, one run made of its environment, matmul
    rates and command. A sentence where the rows name runs the file does not hold."""
    runs = earlier.get("runs")
    if runs is None:
        runs = [{"started": None, "environment": earlier.get("environment", {}),
                 "matmul_gflops": earlier.get("matmul_gflops", {}),
                 "command": earlier.get("command")}]
    if not (isinstance(runs, list) and runs and all(isinstance(r, dict) for r in runs)):
        raise ValueError(f"cannot resume from {source}: its runs are not a list of the "
                         "runs that measured its rows (a file edited?); write to another "
                         "--out.")
    named = {row.get("run", 0) for row in earlier.get("rows", [])}
    unknown = [i for i in named if not (type(i) is int and 0 <= i < len(runs))]
    if unknown:
        raise ValueError(f"cannot resume from {source}: its rows name runs {unknown!r} of "
                         f"{len(runs)} it records (a file edited?); write to another --out.")
    return runs


def _settings_differ(config: BenchConfig, before: dict[str, Any]) -> list[str]:
    """A phrase per setting of ``RESUMABLE_SETTINGS`` that differs from ``before``."""
    now = dataclasses.asdict(config)
    # the pause changes nothing where the calls are interleaved
    compared = [name for name in RESUMABLE_SETTINGS if name != "pause"
                or "blocked" in (before.get("timing"), now["timing"])]
    return [_setting_phrase(name, before.get(name), now[name]) for name in compared
            if _comparable(before.get(name), name) != _comparable(now[name], name)]


def _setting_phrase(name: str, before: Any, now: Any) -> str:
    """``name``'s earlier and present values, with the option and the value to pass."""
    if name in SWITCHES:
        flag, value = SWITCHES[name]
        return (f"the earlier run had {flag}: pass it" if before == value
                else f"the earlier run had no {flag}: leave it out")
    if name not in OPTIONS:  # the library's setting alone (reference)
        return f"{name} {before!r} -> {now!r}: set {name}={before!r}"
    flag = OPTIONS[name]
    if before is None and name == "num_features":
        return f"the earlier run had no {flag} (each method's default): leave it out"
    shown = _shown(json_ready(before))
    return f"{flag} {shown} -> {_shown(json_ready(now))}: pass {flag} {shown}"


def _shown(value: Any) -> str:
    """A setting's value as typed on the command line (None: an infinite number)."""
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "inf" if value is None else str(value)


def _methods_differ(config: BenchConfig, before: dict[str, Any],
                    env_before: dict[str, Any]) -> list[str]:
    """A phrase where the methods that run differ from those the earlier run measured:
    compared as lists (``--methods softmax skyformer`` runs what ``--methods skyformer``
    runs), in any order; without --methods, --plugin or another version of the library
    changes them."""
    ran = env_before.get("methods")
    if not isinstance(ran, list):  # a file from before they were kept: its config's
        ran = None if before.get("methods") is None else _with_reference(before)
    if ran is None:
        return [] if config.methods is None else [
            "the earlier run had no --methods (every registered method): leave it out"]
    now = config.method_names()
    if sorted(map(str, ran)) == sorted(now):
        return []
    return [f"--methods {shlex.join(map(str, ran))} -> {shlex.join(now)}: pass --methods "
            f"{shlex.join(map(str, ran))}"]


def _with_reference(before: dict[str, Any]) -> list[str]:
    """The methods an earlier config ran: its list, with the reference added first."""
    names = list(before["methods"])
    if before.get("reference") not in names:
        names.insert(0, before.get("reference"))
    return names


def _environment_differs(config: BenchConfig, env_before: dict[str, Any]) -> list[str]:
    """A phrase per item of ``RESUMABLE_ENVIRONMENT`` that differs from ``env_before``."""
    env_now = run_environment(torch.device(config.device))
    phrases = {"torch_threads": "--threads {b} -> {a}: pass --threads {b}",
               "torch": "torch {b} -> {a}: resume with torch {b}",
               "device_name": "device {b!r} -> {a!r}: resume on the machine that measured them"}
    return [phrases[name].format(b=env_before.get(name), a=env_now.get(name))
            for name in RESUMABLE_ENVIRONMENT if env_before.get(name) != env_now.get(name)]


def _comparable(value: Any, name: str = "") -> Any:
    """``value`` as the JSON file holds it (tuples as lists, a non-finite number such as
    ``--max-seconds inf`` as None), so that a setting read back compares equal; the
    ``ORDERLESS_SETTINGS`` sorted."""
    value = json_ready(value)
    if name in ORDERLESS_SETTINGS and isinstance(value, list):
        return sorted(value, key=str)
    return value
