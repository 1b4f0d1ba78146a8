"""Every approximate method against exact SDPA: a preset of ``skyformer bench``.

    python benchmarks/methods.py [more skyformer-bench options, e.g. --clock cpu --threads 1]

runs ``skyformer bench`` with exact softmax attention and every registered
approximate method (``list_methods()`` minus the exact ones, so methods registered
later appear by themselves), N = 1024 ... 16384, B=1, H=2, D=32 (the Long Range Arena
setting of the Skyformer paper), float32, each method at its default options and
called as inside ``MultiHeadAttention`` (Linformer with its learned projections,
``max_seq_len = N``), and writes ``benchmarks/results/methods.{json,csv,png}``.
Options given on the command line override the preset's (``--seq-lens`` its lengths).
"""

from __future__ import annotations

import sys

from run_metadata import RESULTS  # benchmarks/, beside this script

from skyformer.cli import main as skyformer_main
from skyformer.registry import get_method, list_methods


def preset(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The arguments of ``skyformer bench``: the preset's, then ``extra`` (the later of
    two settings wins); the preset's --min-n and --max-n only where ``extra`` lists no
    lengths of its own (bench takes --seq-lens or the two bounds, not both)."""
    approximate = [m for m in list_methods() if not get_method(m).capabilities.exact]
    lengths = [] if any(_is_flag(arg, "--seq-lens") for arg in extra) else [
        "--min-n", str(min(1024, _given(extra, "--max-n") or 1024)),
        "--max-n", str(max(16384, _given(extra, "--min-n") or 16384))]
    return ["bench", "--methods", "softmax", *approximate, *lengths,
            "--out", str(RESULTS / "methods"), "--markdown", *extra]


def _given(extra: list[str] | tuple[str, ...], flag: str) -> int | None:
    """The integer value of ``flag`` in ``extra`` (its last, as argparse keeps), or None:
    a bound given alone moves the preset's other one past it (``--max-n 512`` alone ran
    into the preset's --min-n 1024, which the user never gave)."""
    value = None
    for i, arg in enumerate(extra):
        if _is_flag(arg, flag):
            text = arg.partition("=")[2] if "=" in arg else \
                (extra[i + 1] if i + 1 < len(extra) else "")
            value = int(text) if text.lstrip("-").isdigit() else value
    return value


def _is_flag(arg: str, flag: str) -> bool:
    """Whether ``arg`` is ``flag``, as given or abbreviated (argparse takes ``--seq`` for
    --seq-lens, ``--max`` for --max-n)."""
    name = arg.partition("=")[0]
    return len(name) > 2 and name.startswith("--") and flag.startswith(name)


if __name__ == "__main__":
    sys.exit(skyformer_main(preset(sys.argv[1:])))
