"""What a benchmark's result files record besides their rows: the resolved settings, the
environment (versions, threads, device name) and the command that ran, one dict for a
JSON file and for a CSV's ``# key: <json>`` lines (``skyformer.io.write_csv``); a
script whose table is text writes it with a JSON beside (``write_report``)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from skyformer.io import atomic_write_text, environment, write_json

# where the committed results live, whatever the current folder: a default --out under
# it ("benchmarks/results/...") made benchmarks/benchmarks/results when run from benchmarks/
RESULTS = Path(__file__).resolve().parent / "results"


def run_metadata(script: str, argv: list[str] | None, config: dict[str, Any],
                 device: torch.device | str | None = None) -> dict[str, Any]:
    """``{"config", "environment", "command"}`` of a run of ``script`` (the script's
    ``__file__``) with the arguments ``argv`` (None: this process's own) and the resolved
    settings ``config``, on ``device`` (a CUDA device's name is recorded)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return {"config": config, "environment": environment(device),
            "command": _command(script, argv)}


def _command(script: str, argv: list[str]) -> str:
    """The command as run from the repository's root; run from a folder inside it, that
    folder first (``cd benchmarks && python host_time.py --out results/x.md``), so that
    the relative paths typed read the same when the command is run again."""
    root = RESULTS.parent.parent
    here = Path.cwd().resolve()
    try:
        inside = here.relative_to(root)
    except ValueError:  # run from elsewhere: the paths typed are that folder's
        inside = Path()
    if inside == Path():
        return shlex.join(["python", f"benchmarks/{Path(script).name}", *argv])
    target = os.path.relpath(Path(script).resolve(), here)
    return (f"cd {shlex.quote(inside.as_posix())} && "
            + shlex.join(["python", Path(target).as_posix(), *argv]))


def write_report(out: str | Path, text: str, metadata: dict[str, Any], **data: Any) -> None:
    """The text table ``text`` atomically to ``out`` and, beside it (``out`` with the
    suffix ``.json``), ``metadata`` (``run_metadata``) and the numbers ``data`` (rows) as
    JSON: the text alone said neither every setting nor the environment. ``out``
    without a suffix names both: ``out.md`` and ``out.json``."""
    out = Path(out)
    report = out if out.suffix not in (".json", "") else out.with_suffix(".md")
    result = out.with_suffix(".json")  # --out x.json: the JSON, its table beside
    write_json(result, {**metadata, **data}, indent=1)
    atomic_write_text(report, text)
