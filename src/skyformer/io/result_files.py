"""Result files as JSON and CSV: strict JSON (a non-finite number is ``null``), written
atomically, and an earlier result read back to resume from."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import atomic_write_text


def json_ready(data: Any) -> Any:
    """``data`` as the result files store it: every non-finite float (NaN, +-inf), in
    dicts, lists and tuples too, as None (JSON ``null``), tuples as lists, a NumPy scalar
    or a 0-d tensor as the Python value it holds (not its ``str``)."""
    if isinstance(data, (np.generic, torch.Tensor)) and data.ndim == 0:
        data = data.item()
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_ready(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_ready(value) for value in data]
    return data


def json_text(data: Any, *, indent: int | None = None,
              separators: tuple[str, str] | None = None) -> str:
    """``data`` as strict JSON: non-finite numbers as ``null`` (``json_ready``), never
    the ``NaN``/``Infinity`` tokens that strict readers (jq, JavaScript) refuse; anything
    else that is not JSON raises ``ValueError``. Objects JSON has no type for (paths,
    dtypes) are written as their ``str``."""
    return json.dumps(json_ready(data), indent=indent, separators=separators,
                      sort_keys=False, default=str, allow_nan=False)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    """Atomically write ``data`` as strict JSON (``indent=None``: compact, for long
    arrays). A NaN or infinite number, nested or not, is written as ``null``: readers of
    the result files take ``null`` where a number is expected as "no value"."""
    separators = (",", ":") if indent is None else None
    return atomic_write_text(path, json_text(data, indent=indent, separators=separators) + "\n")


def write_csv(
    path: str | os.PathLike[str], rows: list[dict[str, Any]], *,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Atomically write ``rows`` (dicts; columns = union of their keys, first-seen order)
    as CSV. ``metadata`` (e.g. the resolved config and environment) goes first, one
    ``# key: <json>`` comment line per key (``pandas.read_csv(path, comment="#")``;
    strict JSON, see ``json_text``)."""
    import csv
    import io

    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    for key, value in (metadata or {}).items():
        buffer.write(f"# {key}: {json_text(value)}\n")
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return atomic_write_text(path, buffer.getvalue())


def read_to_resume(path: Path, kind: str, flag: str) -> Any:
    """The JSON a ``--resume`` continues, read (None, said on stderr, where ``path`` does
    not exist yet); ``kind`` names what it should be ("a bench result file") and ``flag``
    the option that names it, for the sentence an unreadable file gets."""
    if not path.exists():
        print(f"nothing to resume: {path} does not exist; measuring everything",
              file=sys.stderr)
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot resume from {path}: not {kind}, or one cut short or "
                         f"damaged ({err}); remove it to start over there, or write to "
                         f"another {flag}.") from None
