"""``skyformer approx``: approximation error against m on real and synthetic Q/K/V, with
rank-m floors, trivial baselines, spectra and statistical dimension."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from ..checks import positive_int_argument
from ..eval.approx.progress import (
    PROGRESS_FILE,
    data_changes,
    finished_alike,
    kept_note,
    refuse_to_replace,
)
from ..eval.approx.report import FILES, analysis_table, format_table, rounded_floats, write_outputs
from ..eval.approx.run import QUICK, ApproxConfig, resolve_methods, run_approx
from ..eval.data.sources import SOURCES
from ..io import (
    check_output_path,
    folder_lock,
    json_text,
    remove_interrupted_writes,
)

NAME = "approx"
HELP = (
    "approximation study: relative spectral error of every method against its exact target "
    "as the number of features grows, on MiniLM-L6 Q/K/V (pretrained and randomly "
    "initialised), GloVe vectors or Gaussian data, with rank-m SVD floors, trivial "
    "baselines, spectra and Theorem 2 statistical dimension; writes JSON, CSV, PNG and a "
    "markdown report"
)

# Options that map one-to-one onto ApproxConfig fields (None = not given).
_FIELDS = {
    "sources": "sources", "seq_lens": "seq_lens", "features": "features", "seeds": "seeds",
    "methods": "methods", "layer": "layer", "model": "model", "text": "text", "glove": "glove",
    "qkv": "qkv",
    "gaussian_norm": "gaussian_norm", "gaussian_dim": "gaussian_dim", "data_seed": "data_seed",
    "analysis_len": "analysis_seq_len", "residual_block": "residual_block",
    "lsh_bits": "lsh_bits", "eps": "eps",
    "delta": "delta", "floor_power_iterations": "floor_power_iterations",
    "floor_oversample": "floor_oversample",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ApproxConfig()
    parser.add_argument("--quick", action="store_true",
                        help="small preset that runs in well under a minute: N=256, m in "
                        "16 32 64, seeds 0 1 2, heads 0 1, the analyses at N=256 with "
                        "--eps 0.1 only (explicit options still apply)")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=None,
                        help=f"Q/K/V sources (default: {' '.join(d.sources)})")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=None, metavar="N",
                        help=f"sequence lengths N (default: {' '.join(map(str, d.seq_lens))})")
    parser.add_argument("--features", nargs="+", type=int, default=None, metavar="M",
                        help=f"numbers of features m (default: {' '.join(map(str, d.features))}); "
                        "values >= N are dropped for that N")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, metavar="SEED",
                        help="random seeds of the methods (default: "
                        f"{' '.join(map(str, d.seeds))})")
    parser.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                        help="subset of methods, each a name or a variant with options set, "
                        "'skyformer[pinv_gradient=implicit]' (default: every approximate "
                        "method)")
    parser.add_argument("--layer", type=int, default=None, help=f"model layer (default {d.layer})")
    parser.add_argument("--heads", nargs="+", default=None, metavar="H",
                        help="head indices, or 'all' (default: 0 3 6 9); for glove/gaussian "
                        "one independent slice per index given (4 by default, 12 for 'all')")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="local BERT-type Hugging Face model folder (default: MiniLM-L6)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="UTF-8 text file (default: shipped text)")
    parser.add_argument("--glove", default=None, metavar="FILE",
                        help="GloVe-format word vector file")
    parser.add_argument("--qkv", default=None, metavar="FILE",
                        help="your own Q/K/V for --sources qkv: a torch.save file of a dict "
                        "q, k, v (each [B, H, N, D]; optionally mask [B, N], True = real "
                        "token) or an .npz with those keys; the first N tokens of each "
                        "sequence, its B x H heads numbered b * H + h (--heads chooses among "
                        "them; by default 0 3 6 9 where there are 10 or more, else all)")
    parser.add_argument("--gaussian-norm", type=float, default=None,
                        help=f"root-mean-square row norm sqrt(E|q|^2) of synthetic Q, K "
                        f"(default {d.gaussian_norm:g})")
    parser.add_argument("--gaussian-dim", type=int, default=None,
                        help=f"head dim of synthetic Q/K/V (default {d.gaussian_dim})")
    parser.add_argument("--data-seed", type=int, default=None,
                        help="seed of the random init and the synthetic data (default 0)")
    parser.add_argument("--no-analysis", action="store_true",
                        help="skip the spectra and leverage analysis")
    parser.add_argument("--no-sweep", action="store_true",
                        help="only the analysis: no method runs, no error plot")
    parser.add_argument("--analysis-len", type=int, default=None, metavar="N",
                        help=f"sequence length of the analysis (default {d.analysis_seq_len})")
    parser.add_argument("--residual-block", type=int, default=None,
                        help=f"keys per LSH bucket (and entries per row of the oracle mask) of "
                        f"the sparse part (default {d.residual_block})")
    parser.add_argument("--lsh-bits", type=int, default=None,
                        help=f"hyperplanes of the angular LSH (default {d.lsh_bits})")
    parser.add_argument("--eps", nargs="+", type=float, default=None, metavar="EPS",
                        help="relative errors eps for Theorem 2 (default: 0.1 0.01)")
    parser.add_argument("--delta", type=float, default=None,
                        help=f"failure probability delta for Theorem 2 (default {d.delta:g})")
    parser.add_argument("--floor-power-iterations", type=int, default=None,
                        help=f"subspace iterations of the rank-m floors (default "
                        f"{d.floor_power_iterations})")
    parser.add_argument("--floor-oversample", type=int, default=None,
                        help=f"oversampling of the rank-m floors (default {d.floor_oversample})")
    parser.add_argument("--threads", type=positive_int_argument, default=None,
                        help="torch CPU threads (default: torch's own choice); on a machine "
                        "busier than its cores, 1 avoids threads spinning on each other")
    parser.add_argument("--out", default="results/approx", metavar="DIR",
                        help="output folder (default results/approx)")
    parser.add_argument("--no-plots", "--no-plot", action="store_true",
                        help="write no PNG plots (and remove those an earlier run left in --out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue an interrupted run: take what it measured from "
                        f"OUT/{PROGRESS_FILE} (saved after every source and length) and "
                        f"measure the rest; the other settings and data files must be the "
                        f"same (--seq-lens and --sources may differ: blocks of others stay "
                        f"in the file); a finished run of the same settings is left as it is")


def config_from_args(args: argparse.Namespace) -> ApproxConfig:
    """The resolved config: defaults, then the --quick preset, then explicit options."""
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for arg, name in _FIELDS.items():
        value = getattr(args, arg)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    if args.heads is not None:
        if [h.lower() for h in args.heads] == ["all"]:
            values["heads"] = None
        else:
            try:
                values["heads"] = tuple(int(h) for h in args.heads)
            except ValueError:
                raise ValueError(f"--heads takes integers or 'all', got {' '.join(args.heads)}.") \
                    from None
    if args.no_analysis:
        values["analysis"] = False
    if args.no_sweep:
        values["sweep"] = False
    if args.no_progress:
        values["progress"] = False
    return ApproxConfig(**values)


# flags read by one part of the study only: (what reads them, whether the run has it)
_READ_BY = (
    (("glove",), "--sources glove", lambda c: "glove" in c.sources),
    (("qkv",), "--sources qkv", lambda c: "qkv" in c.sources),
    (("model", "text", "layer"), "--sources pretrained or init",
     lambda c: bool({"pretrained", "init"} & set(c.sources))),
    (("gaussian_norm", "gaussian_dim"), "--sources gaussian", lambda c: "gaussian" in c.sources),
    (("seq_lens", "features", "seeds", "methods", "floor_oversample",
      "floor_power_iterations"), "the sweep (--no-sweep skips it)", lambda c: c.sweep),
    (("analysis_len", "eps", "delta", "residual_block", "lsh_bits"),
     "the analysis (--no-analysis skips it)", lambda c: c.analysis),
)


def unused_flags(args: argparse.Namespace, config: ApproxConfig) -> list[str]:
    """A note for each flag given that this run never reads (``--glove`` without the
    glove source, ``--methods`` with ``--no-sweep``, ...): it changes nothing."""
    notes = []
    for names, reader, runs in _READ_BY:
        given = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None]
        if given and not runs(config):
            one = len(given) == 1
            notes.append(f"note: {', '.join(given)} {'changes' if one else 'change'} nothing "
                         f"in this run: only {reader} reads {'it' if one else 'them'}.")
    return notes


def _command(args: argparse.Namespace) -> str:
    """The command that runs this again (``--resume`` left out); the top level's
    ``--plugin`` modules go before ``approx``, where the command line takes them."""
    plugins = [part for module in getattr(args, "plugin", None) or ()
               for part in ("--plugin", module)]
    parts = ["skyformer", *plugins, "approx"]
    for key, value in vars(args).items():
        if key.startswith("_") or key in ("command", "resume", "plugin") or value is None \
                or value is False:
            continue
        if key == "out" and value == "results/approx":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            parts += [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    check_output_path(args.out, folder=True)
    config = config_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.no_plots:
        from ..eval.approx.plots import require_matplotlib

        # fail before the run, not after it, when matplotlib is missing
        require_matplotlib("pass --no-plots")
    for note in unused_flags(args, config):
        print(note, file=sys.stderr)
    with folder_lock(args.out):  # one run at a time in a folder
        remove_interrupted_writes(Path(args.out), (*FILES.values(), PROGRESS_FILE),
                                  say=functools.partial(print, file=sys.stderr))
        return _run_in_folder(args, config)


def _finished_here(out: Path, config: ApproxConfig) -> bool:
    """Whether ``out`` holds the results a run of ``config`` wrote at its end
    (``approx.json``; its progress file is removed then): ``--resume`` once it
    finished measured everything again and replaced them. Refused in a sentence where
    the data files changed since (their stamps in the results; none in older files)."""
    try:
        results = json.loads((out / FILES["json"]).read_text(encoding="utf-8"))
        saved = results["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    ours = rounded_floats(json.loads(json_text(dataclasses.asdict(config))))
    stamps = results.get("data")
    if not (isinstance(saved, dict) and finished_alike(saved, stamps, ours, config)):
        return False
    measured = (results.get("environment") or {}).get("methods")
    if isinstance(measured, list):  # --methods unset is every method: a plugin adds some
        now = _methods_now(config)
        gone = [name for name in measured if name not in now]
        if gone:
            raise ValueError(f"cannot resume: {out} holds the finished results of "
                             f"{', '.join(gone)}, which this run does not measure (a "
                             f"--plugin not given?); give the same --plugin and --methods, "
                             f"run without --resume to measure this run's methods "
                             f"(replacing them), or give another --out.")
        if measured != now:
            return False
    changed = data_changes(stamps, config) if isinstance(stamps, dict) else []
    if changed:
        raise ValueError(f"cannot resume: {out} holds the finished results of these settings, "
                         f"and since they were measured, {', '.join(changed)}; run without "
                         f"--resume to measure them again (replacing them), or give another "
                         f"--out.")
    return True


def _methods_now(config: ApproxConfig) -> list[str]:
    """The names of the methods a run of ``config`` measures, in order."""
    return [spec.name for spec in resolve_methods(config.methods, [])]


def _run_in_folder(args: argparse.Namespace, config: ApproxConfig) -> int:
    """The measurement of ``run``, its progress file and results in ``args.out``."""
    progress_file = Path(args.out) / PROGRESS_FILE
    if not args.resume:
        refuse_to_replace(progress_file)
    elif not progress_file.exists() and _finished_here(Path(args.out), config):
        print(f"nothing to resume: {args.out} holds the finished results of these settings "
              f"({FILES['json']}); run without --resume to measure them again.",
              file=sys.stderr)
        return 0
    result = run_approx(config, progress_file=progress_file, resume=args.resume)
    print("Q/K/V:")
    for s in result.sources:
        print(f"  {s['source']} N={s['seq_len']}: {s['description']}")
    if result.rows:
        print("the table's error is the relative spectral norm ||O - O_exact||_2 / "
              "||O_exact||_2 against the method's target, mean over seeds and heads")
        print(format_table(result.rows))
    if result.analysis:
        print()
        print(analysis_table(result.analysis))
    written = write_outputs(result, args.out, plots=not args.no_plots, command=_command(args))
    if result.progress_left:  # blocks of other lengths or sources: only the file has them
        print(kept_note(progress_file, config, result.progress_left), file=sys.stderr)
    else:
        progress_file.unlink(missing_ok=True)  # the results hold it all now
    print()
    for _kind, path in written.items():
        print(f"wrote {path}")
    print(f"took {result.seconds['total']:.1f} s")
    return 0
