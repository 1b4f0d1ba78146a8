"""The command line a result file records, so that a result says how to make it again."""

from __future__ import annotations

import argparse
import shlex
import sys


def command_line(args: argparse.Namespace) -> str:
    """``skyformer ...`` as it was called: the arguments ``main`` was given (or the
    process's own), quoted for a POSIX shell."""
    return "skyformer " + shlex.join(getattr(args, "_argv", sys.argv[1:]))
