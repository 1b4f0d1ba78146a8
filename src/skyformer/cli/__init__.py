"""The ``skyformer`` command. Thin: each subcommand module parses arguments and calls
the library; this file only wires them up and turns user errors into one-line messages.

Subcommand modules define ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args)``
(and a ``DESCRIPTION`` for ``--help`` where ``HELP`` is too short for it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

from ..io import FULL_DISK
from ..logs import enable_console
from . import (
    approx_cmd,
    bench_cmd,
    check_cmd,
    compare_cmd,
    hf_eval_cmd,
    list_cmd,
    lra_cmd,
)
from .signals import Terminated, terminating_as_interrupt
from .streams import surviving_closed_pipes

SUBCOMMANDS: list[ModuleType] = [
    list_cmd, check_cmd, compare_cmd, bench_cmd, approx_cmd, hf_eval_cmd, lra_cmd,
]

USER_ERRORS = (ValueError, TypeError, OSError, ImportError, RuntimeError, MemoryError)
# errors that may as well come from a bug as from the input: their line says how to get
# the traceback (SKYFORMER_DEBUG=1 lets every error through with its traceback)
MAYBE_A_BUG = (TypeError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skyformer",
        description="Efficient attention for long sequences: Skyformer and the methods it is "
        "compared with.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"skyformer {__version__}")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE before the command: a module of your own that "
                        "registers attention methods (skyformer.registry.register), which "
                        "every command then knows by name; the current folder is searched "
                        "too; give it once per module")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        p = sub.add_parser(module.NAME, help=module.HELP,
                           description=getattr(module, "DESCRIPTION", module.HELP))
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # for result files
    args._started = time.time()  # what an interrupted run wrote is newer
    _expand_home(args)
    if not getattr(args, "_run", None):  # no command: an error, so its help on stderr
        parser.print_help(sys.stderr)
        return 2
    enable_console()
    # A reader that goes away (``skyformer approx | head -3``) ends no run: the rest of
    # its output is dropped and its result files are written as without the pipe.
    # SIGTERM (a scheduler pre-empting the job) ends a run as Ctrl-C does: locks given
    # back, temporary files removed, what was kept said; exit status 128 + 15.
    with surviving_closed_pipes(), terminating_as_interrupt():
        try:
            import_plugins(args.plugin)
            return int(args._run(args) or 0)
        except USER_ERRORS as err:
            if os.environ.get("SKYFORMER_DEBUG", "") not in ("", "0"):
                raise
            command = " ".join(filter(None, (args.command, getattr(args, "lra_command", None))))
            said = f"out of memory ({err or 'no detail'})" if isinstance(err, MemoryError) \
                else str(err)
            print(f"skyformer {command}: error: {said}", file=sys.stderr)
            if isinstance(err, OSError) and err.errno in FULL_DISK:
                print("(free space on that disk, or write elsewhere: the result files are "
                      "written whole, so those there are as they were; a command that takes "
                      "--resume goes on from them when run again with it)", file=sys.stderr)
            if isinstance(err, MAYBE_A_BUG):
                print(f"(a {type(err).__name__}: where the line above names nothing you "
                      f"gave, run again with SKYFORMER_DEBUG=1 for the traceback)",
                      file=sys.stderr)
            return 2
        except Terminated:
            print(interrupted_note(args, "terminated (SIGTERM)"), file=sys.stderr)
            return 128 + signal.SIGTERM
        except KeyboardInterrupt:
            print(interrupted_note(args), file=sys.stderr)
            return 130


def import_plugins(modules: list[str]) -> None:
    """Import each module of ``--plugin``, from the current folder too (searched after
    the installed packages, so that a file there shadows none of them)."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in modules:
        if name.endswith(".py") or os.sep in name:  # a file's path, not a module's name
            folder, stem = os.path.split(name.removesuffix(".py"))
            where = f" from {folder} (or with it on PYTHONPATH)" if folder else ""
            raise ImportError(f"--plugin {name}: give the module's name, {stem}, not its "
                              f"file, and run{where or ' from the folder that holds it'}.")
        imported_before = name in sys.modules
        methods_before = _registered()
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise ImportError(f"--plugin {name}: importing it failed{_where(err, name)}: "
                                  f"{err}") from err
            raise ImportError(
                f"--plugin {name}: cannot import it ({err}); give a module importable from "
                f"here (a file of the current folder without .py, or an installed package's "
                f"module), or put its folder on PYTHONPATH.") from None
        except Exception as err:  # its own code failed: a mistake in it, named where
            raise ImportError(f"--plugin {name}: importing it failed{_where(err, name)}: "
                              f"{type(err).__name__}: {err}") from err
        _refuse_shadowed(name, module)
        if not imported_before and _registered() == methods_before:
            print(f"note: --plugin {name} registered no attention method: its "
                  f"skyformer.registry.register calls run when it is imported (not under "
                  f"'if __name__ == \"__main__\":'); skyformer --plugin {name} list shows "
                  f"what it adds", file=sys.stderr)


def _registered() -> dict[str, object]:
    """The registered methods by name (a plugin registers new ones or replaces some)."""
    from ..registry import get_method, list_methods

    return {name: get_method(name) for name in list_methods()}


def _where(err: BaseException, name: str) -> str:
    """`` at file:line``: where in the plugin's code its import failed: a syntax error's
    own line, else the innermost frame in the plugin's file (a mistake in its register
    call fails inside skyformer, whose line would not help), else outside skyformer."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    chosen = [f for f in frames if spec is not None and f.filename == spec.origin] or \
        [f for f in frames if not os.path.abspath(f.filename).startswith(own + os.sep)
         and "importlib" not in f.filename] or frames
    return f" at {chosen[-1].filename}:{chosen[-1].lineno}" if chosen else ""


def _refuse_shadowed(name: str, module: object) -> None:
    """A file of the current folder that ``name`` did not import: a module of that name
    comes first (the standard library's ``imp``, an installed package), so its methods
    were never registered."""
    here = os.path.join(os.getcwd(), *name.split(".")) + ".py"
    found = getattr(module, "__file__", None)
    if os.path.isfile(here) and (found is None or not os.path.samefile(found, here)):
        raise ImportError(
            f"--plugin {name}: that name imports {found or 'a built-in module'}, not "
            f"{here} (a module of that name comes first); rename your file.")


def _expand_home(args: argparse.Namespace) -> None:
    """Paths given as ``--out=~/runs``: the shell expands ``~`` only at the start of a
    word, so after ``=`` it reached the command as is and made a folder named ``~`` in
    the working directory. A value that is ``~`` or starts with ``~/`` is the home folder
    (no option takes such a value as anything but a path)."""
    def expanded(value: object) -> object:
        if isinstance(value, str) and (value == "~" or value.startswith("~/")):
            return os.path.expanduser(value)
        if isinstance(value, list):
            return [expanded(item) for item in value]
        return value

    for name, value in vars(args).items():
        if not name.startswith("_"):
            setattr(args, name, expanded(value))


def interrupted_note(args: argparse.Namespace, how: str = "interrupted") -> str:
    """The line a Ctrl-C (or SIGTERM: ``how`` says which) prints: for a command that saves
    as it goes (it has ``--resume``), what is kept and how to continue; for one without its
    save option, that nothing was."""
    if not hasattr(args, "resume"):
        return how
    # The commands whose saving is optional: (their flag, its attribute).
    optional = {"bench": ("--out", "out"), "stability": ("--json", "json_path")}
    command = getattr(args, "lra_command", None) or args.command
    flag, name = optional.get(command, ("", ""))
    if flag and getattr(args, name) is None:
        return f"{how}; nothing was saved (give {flag} to keep what a run measures)"
    if _nothing_written_yet(args, command):
        return f"{how} before its first result was saved: run the same command again to start"
    folder = getattr(args, "_training_in", None)  # train: the run (of --seeds) under way
    last = "last.pt" if folder is None else Path(folder) / "last.pt"
    kept = (f"its last checkpoint ({last}), if one was written yet, is kept" if command == "train"
            else "what it measured is saved")
    again = "again with --resume" if not args.resume else "again"
    return f"{how}; {kept}: run the same command {again} to continue"


def _nothing_written_yet(args: argparse.Namespace, command: str) -> bool:
    """Whether a measurement that saves as it goes stopped before its first save (``approx``
    saves blocks to its progress file, ``bench`` its results after each length, ``lra
    stability`` its taus after each method and seed): then
    --resume would find nothing of it to continue (an earlier run's complete results
    are not this run's, unless it resumed them)."""
    if command == "approx":
        from ..eval.approx.progress import PROGRESS_FILE

        return not (Path(args.out) / PROGRESS_FILE).exists()
    if command in ("bench", "stability"):
        from ..eval.bench.report import result_path

        path = result_path(args.out, ".json") if command == "bench" else Path(args.json_path)
        return not path.exists() or (
            not args.resume and path.stat().st_mtime < getattr(args, "_started", 0.0))
    return False


if __name__ == "__main__":
    sys.exit(main())
