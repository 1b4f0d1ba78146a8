"""``skyformer lra``: Long Range Arena data, training, reports and the instability score.

Subcommands: ``prepare``, ``generate``, ``train``, ``report``, ``stability``, ``presets``.
Thin: each parses its arguments and calls ``skyformer.lra``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..checks import positive_int_argument
from ..io import check_output_path, read_to_resume, refuse_overwriting_inputs
from ..registry.variants import option_value
from .recorded import command_line

NAME = "lra"
HELP = "Long Range Arena: prepare data, train, report the papers' tables, instability score"

# skyformer.lra.tasks.TASKS' names, written here: the parser is built for every command,
# and importing skyformer.lra would load the trainer (tests check that the two agree)
TASK_NAMES = ("text", "listops", "retrieval", "pathfinder", "image")


def _option(text: str) -> tuple[str, Any]:
    """``key=value`` with a JSON value, or else a value as a variant's brackets take it
    (``True``, ``None``; other bare words stay strings), so that ``--option KEY=VALUE``
    and ``METHOD[KEY=VALUE]`` set the same."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}.")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = option_value(raw)
    return key.strip(), value


def _prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=TASK_NAMES)
    p.add_argument("--src", required=True,
                   help="the task's files in the LRA release layout (see docs/lra.md)")
    p.add_argument("--cache", default=None, help="cache root (default: $SKYFORMER_LRA_CACHE or "
                   "~/.cache/skyformer/lra)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens kept per document (default: the task's LRA length)")
    p.add_argument("--dev-fraction", type=float, default=None,
                   help="text: share of the training reviews held out as dev (default 0.1; "
                   "0 = validate on test as LRA does)")
    p.add_argument("--difficulty", default=None,
                   help="pathfinder: sub-folder of --src (default curv_contour_length_14); "
                   "with a difficulty folder as --src, that folder's name or nothing")
    p.add_argument("--split-seed", type=int, default=None,
                   help="text, pathfinder: seed of the dev/test split (default 0)")
    p.add_argument("--listops-tokens", dest="tokens", choices=("lra", "reference"), default=None,
                   help="listops: 'lra' (default) keeps operators, digits and ']' as LRA's "
                   "tokenizer does; 'reference' drops ']' too, as the pipeline of the "
                   "Skyformer code did")


def _generate_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="KIND", required=True)
    lo = sub.add_parser("listops", help="ListOps by LRA's rules, as basic_{train,val,test}.tsv")
    lo.add_argument("--out", required=True, help="folder to write the tsv files to")
    lo.add_argument("--train", type=int, default=96_000, help="training examples (default "
                    "%(default)s, LRA's)")
    lo.add_argument("--dev", type=int, default=2_000, help="dev examples (default %(default)s)")
    lo.add_argument("--test", type=int, default=2_000,
                    help="test examples (default %(default)s)")
    lo.add_argument("--max-depth", type=int, default=10,
                    help="deepest nesting of operators (default %(default)s)")
    lo.add_argument("--max-args", type=int, default=10,
                    help="most arguments of one operator (default %(default)s)")
    lo.add_argument("--min-length", type=int, default=500,
                    help="exclusive lower length bound, in tokens (default %(default)s)")
    lo.add_argument("--max-length", type=int, default=2000,
                    help="exclusive upper length bound, in tokens (default %(default)s)")
    lo.add_argument("--seed", type=int, default=0, help="seed of the examples (default 0)")
    lo.add_argument("--replace", action="store_true",
                    help="replace the ListOps data generated in --out before")
    pf = sub.add_parser("pathfinder", help="synthetic Pathfinder-like images (release layout)")
    pf.add_argument("--out", required=True, help="folder to write imgs/ and metadata/ to")
    pf.add_argument("--count", type=int, default=10_000,
                    help="images (default %(default)s)")
    pf.add_argument("--resolution", type=int, default=32,
                    help="image side in pixels (default %(default)s)")
    pf.add_argument("--dashes", type=int, default=6,
                    help="dashes per path (default %(default)s)")
    pf.add_argument("--distractors", type=int, default=1,
                    help="paths without dots (default %(default)s)")
    pf.add_argument("--seed", type=int, default=0, help="seed of the images (default 0)")
    pf.add_argument("--replace", action="store_true",
                    help="replace the images generated in --out before")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=TASK_NAMES)
    p.add_argument("--attn", default="skyformer",
                   help="attention method (skyformer list; default skyformer)")
    p.add_argument("--option", dest="options", type=_option, action="append", default=[],
                   metavar="KEY=VALUE", help="option of the method, e.g. num_features=64 "
                   "(repeatable)")
    p.add_argument("--quick", action="store_true",
                   help="a short CPU-sized run (200 steps) to check that everything works")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None, help="one run with this seed (default 0)")
    seeds.add_argument("--seeds", type=int, nargs="+", default=None,
                       help="one run per seed, one after another, in OUT/seedN (the papers "
                       "average 3 seeds: --seeds 0 1 2)")
    preset = " (default: the task's preset, skyformer lra presets)"
    p.add_argument("--steps", type=int, default=None, help="training steps" + preset)
    p.add_argument("--batch-size", type=int, default=None, help="global batch size" + preset)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (AdamW, linear warm-up then linear decay)"
                   + preset)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps" + preset)
    p.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW's weight decay" + preset)
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between dev evaluations" + preset)
    dev = p.add_mutually_exclusive_group()  # --full-dev would drop --eval-batches silently
    dev.add_argument("--eval-batches", type=int, default=None,
                     help="dev batches per evaluation (default: the preset's)")
    dev.add_argument("--full-dev", action="store_true", help="evaluate on the whole dev split")
    p.add_argument("--patience", type=int, default=None,
                   help="stop after this many evaluations without dev improvement")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches a step accumulates (the batch size stays global)"
                   + preset)
    clip = p.add_mutually_exclusive_group()
    clip.add_argument("--grad-clip", type=float, default=None,
                      help="clip the gradient norm to this value (default: no clipping)")
    clip.add_argument("--grad-clip-value", type=float, default=None,
                      help="clip each gradient entry to [-V, V], as the reference code does "
                      "with V = 1")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="autocast dtype (fp16 needs CUDA)")
    p.add_argument("--dropout", type=float, default=None, help="dropout rate" + preset)
    p.add_argument("--dim", type=int, default=None, help="model width (preset 64)")
    p.add_argument("--hidden", type=int, default=None, help="MLP hidden width (preset 128)")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (preset 2); must divide --dim")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (preset 2)")
    p.add_argument("--max-len", type=int, default=None,
                   help="truncate documents to this many tokens")
    p.add_argument("--log-every", type=int, default=None,
                   help="steps between training-loss lines of metrics.jsonl" + preset)
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between writes of last.pt, which --resume continues from "
                   "(default: --eval-every's; it is also written at each new best)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:K")
    p.add_argument("--threads", type=positive_int_argument, default=None,
                   help="CPU threads per process (shared machines: 1 avoids contention)")
    p.add_argument("--cache", default=None, help="cache root that prepare wrote (default: "
                   "$SKYFORMER_LRA_CACHE or ~/.cache/skyformer/lra)")
    p.add_argument("--out", default=None,
                   help="run folder (default runs/lra/TASK/METHOD/seedN, METHOD with the --option "
                   "values in brackets: skyformer[num_features=64]); with --seeds the "
                   "folder holding seedN/ (default runs/lra/TASK/METHOD)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/last.pt (finished runs are left as they are)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and exit after this step (continue with --resume); a "
                   "run already there trains no further")
    p.add_argument("--no-tensorboard", action="store_true",
                   help="write no TensorBoard logs (metrics.jsonl is written either way)")
    p.add_argument("--quiet", action="store_true",
                   help="print no progress lines (the run's files are written either way)")


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="folders holding run folders (result.json)")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")
    p.add_argument("--plot", default=None, help="write Figure 2 (dev accuracy vs time) here")


def _stability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", choices=TASK_NAMES, default=["listops"],
                   help="tasks to measure on (default listops)")
    p.add_argument("--methods", nargs="+",
                   default=["nystromformer", "kernelized", "skyformer"],
                   help="methods compared with softmax (default: Table 3's rows)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="seeds, each a run of every method (default 0)")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps a tau is measured over (default %(default)s)")
    p.add_argument("--probe", choices=("normed", "hidden"), default="normed",
                   help="f = the encoder output after its final LayerNorm (default) or the raw "
                   "output of the last layer")
    p.add_argument("--features", type=int, default=None,
                   help="num_features of every method that has it (default: each method's)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size (default: the task's preset)")
    p.add_argument("--max-len", type=int, default=None,
                   help="truncate documents to this many tokens (default: the prepared length)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:K")
    p.add_argument("--threads", type=positive_int_argument, default=None,
                   help="CPU threads (shared machines: 1 avoids contention)")
    p.add_argument("--cache", default=None, help="cache root that prepare wrote (default: "
                   "$SKYFORMER_LRA_CACHE or ~/.cache/skyformer/lra)")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write all tau values here (after every measurement)")
    p.add_argument("--resume", action="store_true",
                   help="with --json: keep the taus that file holds (an interrupted run's) and "
                   "measure only what is missing; the settings must be the same")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lra_command", metavar="SUBCOMMAND")
    for name, helptext, adder in (
        ("prepare", "convert a task's release files into the array cache", _prepare_args),
        ("generate", "write ListOps or synthetic Pathfinder data in the release format",
         _generate_args),
        ("train", "train the LRA model with one attention method on one task (settings not "
         "given come from the task's preset: skyformer lra presets)", _train_args),
        ("report", "collect finished runs into Tables 1-2 and Figure 2", _report_args),
        ("stability", "instability score relative to softmax (Appendix F, Table 3)",
         _stability_args),
        ("presets", "print the per-task training presets", lambda p: None),
    ):
        adder(sub.add_parser(name, help=helptext, description=helptext))
    parser.set_defaults(_lra_parser=parser)


def _cache(args: argparse.Namespace) -> Path:
    from ..lra.cache import default_cache_root

    return Path(args.cache).expanduser() if args.cache else default_cache_root()


def _threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


def _distinct(flag: str, values: list[Any] | None) -> None:
    """Refuse a value listed twice: a seed's second run would find the first's folder, a
    task's second measurement would replace the first's (and show twice in the table)."""
    repeated = sorted({v for v in values or [] if values.count(v) > 1}, key=str)
    if repeated:
        raise ValueError(f"{flag} lists {', '.join(map(str, repeated))} more than once; give "
                         f"each {flag.removeprefix('--').removesuffix('s')} once.")


def _run_prepare(args: argparse.Namespace) -> int:
    from ..lra import prepare

    options = {k: v for k, v in (("dev_fraction", args.dev_fraction),
                                 ("difficulty", args.difficulty),
                                 ("split_seed", args.split_seed),
                                 ("tokens", args.tokens)) if v is not None}
    allowed = {"text": {"dev_fraction", "split_seed"}, "pathfinder": {"difficulty", "split_seed"},
               "listops": {"tokens"}}
    extra = set(options) - allowed.get(args.task, set())
    if extra:
        flags = ", ".join("--listops-tokens" if e == "tokens" else "--" + e.replace("_", "-")
                          for e in sorted(extra))
        verb = "does" if len(extra) == 1 else "do"
        raise ValueError(f"{flags} {verb} not apply to {args.task}.")
    if args.max_len is not None and args.max_len <= 0:  # before reading the release files
        raise ValueError(f"--max-len must be a positive integer, got {args.max_len}.")
    check_output_path(_cache(args), folder=True)
    folder = prepare(args.task, args.src, _cache(args), max_len=args.max_len, **options)
    meta = json.loads((folder / "meta.json").read_text())
    counts = ", ".join(f"{s} {meta['splits'][s]['count']}" for s in ("train", "dev", "test"))
    print(f"prepared {args.task} in {folder}: {counts}; max length {meta['max_len']}"
          + (f"; {meta['tokens']} tokens" if "tokens" in meta else "")
          + ("; SYNTHETIC data" if meta.get("synthetic") else ""))
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    check_output_path(args.out, folder=True)
    if args.what == "listops":
        from ..lra import ListOpsRules, write_listops

        rules = ListOpsRules(max_depth=args.max_depth, max_args=args.max_args,
                             min_length=args.min_length, max_length=args.max_length)
        paths = write_listops(args.out, train=args.train, dev=args.dev, test=args.test,
                              rules=rules, seed=args.seed, replace=args.replace)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    else:
        from ..lra import PathfinderRules, write_pathfinder

        rules = PathfinderRules(resolution=args.resolution, dashes=args.dashes,
                                distractors=args.distractors)
        folder = write_pathfinder(args.out, args.count, rules=rules, seed=args.seed,
                                  replace=args.replace)
        print(f"wrote {args.count} synthetic images to {folder}")
    return 0


def _run_train(args: argparse.Namespace) -> int:
    import dataclasses

    from ..lra import make_config
    from ..lra.distributed import joined
    from ..lra.train import Trainer, default_run_dir

    _distinct("--seeds", args.seeds)
    _distinct("--option", [key for key, _ in args.options])  # dict() keeps the last silently
    _refuse_options_in_brackets(args.attn, [key for key, _ in args.options])
    _threads(args.threads)
    cfg = make_config(
        args.task, quick=args.quick, attention=args.attn, attention_options=dict(args.options),
        seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, eval_every=args.eval_every,
        eval_batches=args.eval_batches, patience=args.patience, grad_accum=args.grad_accum,
        grad_clip=args.grad_clip, grad_clip_value=args.grad_clip_value,
        precision=args.precision, dropout=args.dropout,
        dim=args.dim, hidden=args.hidden, heads=args.heads, layers=args.layers,
        max_len=args.max_len, log_every=args.log_every, checkpoint_every=args.checkpoint_every,
    )
    if args.full_dev:
        cfg = dataclasses.replace(cfg, eval_batches=None)
    if args.seeds is None:
        runs = [(cfg, args.out)]
    else:
        parent = Path(args.out) if args.out else default_run_dir(cfg).parent
        runs = [(dataclasses.replace(cfg, seed=s), parent / f"seed{s}") for s in args.seeds]
    for run_cfg, out in runs:
        check_output_path(out if out is not None else default_run_dir(run_cfg), folder=True)
    trainers = [Trainer(run_cfg, cache_root=_cache(args), out_dir=out, resume=args.resume,
                        stop_after=args.stop_after, device=args.device,
                        tensorboard=not args.no_tensorboard, quiet=args.quiet,
                        command=command_line(args))
                for run_cfg, out in runs]
    if len(trainers) > 1:  # a seed's folder refused only after the seeds before it trained
        for trainer in trainers:
            trainer.check()
    with joined(args.device):  # one process group for every seed (see joined)
        for trainer in trainers:
            args._training_in = trainer.folder  # what a Ctrl-C names (interrupted_note)
            if trainer.run() is None:  # the one line about --stop-after (the trainer says none)
                _say_stopped(trainer, args.stop_after, len(trainers) > 1)
                if trainer.resumed_at != trainer.state.step:
                    return 0  # a run trained and stopped: the job ends (the next seed waits)
                # one already at --stop-after trains nothing: the next seed may go on
    return 0


def _refuse_options_in_brackets(attention: str, keys: list[str]) -> None:
    """An option given both in ``--attn``'s brackets and with ``--option``: the run used
    the --option value while its default folder, named after --attn, showed the other."""
    from ..registry import get_method

    preset = dict(get_method(attention).preset)
    both = [key for key in keys if key in preset]
    if both:
        raise ValueError(f"--option {both[0]} sets what --attn {attention} sets in its "
                         f"brackets ({both[0]}={preset[both[0]]!r}); give it one way.")


def _say_stopped(trainer: Any, stop_after: int, seeds: bool) -> None:
    """Where a run stopped by ``--stop-after`` is, once (process 0) under torchrun; with
    several seeds, naming its folder."""
    step = trainer.state.step
    said = f"stopped after step {step}; continue with --resume"
    if trainer.resumed_at == step:
        where = f", past --stop-after {stop_after}" if step > stop_after \
            else f" (--stop-after {stop_after})"
        said = (f"nothing trained: the run is already at step {step}{where}; to go on, "
                f"resume with a later --stop-after or none")
    if trainer.info.is_main:
        print(f"{trainer.folder}: {said}" if seeds else said)


def _run_report(args: argparse.Namespace) -> int:
    from ..io import atomic_write_text
    from ..lra.report import collect_runs, plot_dev_curves, tables, unfinished_runs

    check_output_path(args.markdown)
    check_output_path(args.plot)
    if args.plot:
        from ..eval.approx.plots import require_figure_format

        require_figure_format(args.plot, "--plot")
    runs = collect_runs(args.runs)
    read = [path for run in runs for path in (run.source, run.folder / "metrics.jsonl")]
    refuse_overwriting_inputs({"--markdown": args.markdown, "--plot": args.plot},
                              {f"{path}, a file the report reads": path for path in read})
    text = tables(runs, unfinished_runs(args.runs))
    print(text)
    if args.markdown:
        print(f"wrote {atomic_write_text(args.markdown, text)}")
    if args.plot:
        print(f"wrote {plot_dev_curves(runs, args.plot)}")
    return 0


def _run_stability(args: argparse.Namespace) -> int:
    from ..io import (
        remove_interrupted_writes,
        results_lock,
        write_json,
    )
    from ..lra.stability import StabilityReport

    check_output_path(args.json_path)
    _distinct("--tasks", args.tasks)
    _distinct("--seeds", args.seeds)
    _threads(args.threads)
    overrides = {k: v for k, v in (("batch_size", args.batch_size), ("max_len", args.max_len))
                 if v is not None}
    command = command_line(args)

    def save(report: StabilityReport) -> Path:  # the command, as bench and approx record theirs
        return write_json(args.json_path, {**report.to_dict(), "command": command})

    with results_lock(args.json_path, "--json") if args.json_path else nullcontext():
        if args.json_path:
            written = Path(args.json_path)
            remove_interrupted_writes(written.parent, (written.name,), say=_say_now)
        return _measure_stability(args, overrides, save)


def _measure_stability(args: argparse.Namespace, overrides: dict,
                       save: Callable[[Any], Path]) -> int:
    """The run of ``_run_stability``: measure (``save`` after each), print, write."""
    from ..lra.stability import format_table, run_stability

    report = run_stability(args.tasks, args.methods, cache_root=_cache(args), seeds=args.seeds,
                           steps=args.steps, device=args.device, num_features=args.features,
                           probe=args.probe, overrides=overrides, progress=_say_now,
                           earlier=_earlier_taus(args),
                           on_measured=save if args.json_path else None)
    print(format_table(report))
    if args.json_path:
        print(f"wrote {save(report)}")
    return 0


def _say_now(line: str) -> None:
    """A progress line on stderr, as bench's: stdout keeps the table alone (``> table.txt``),
    flushed so that a log file shows it now."""
    print(line, file=sys.stderr, flush=True)


def _refuse_replacing_taus(json_path: str | None) -> None:
    """An existing ``--json`` is rewritten after the first new measurement: without
    ``--resume`` that dropped every earlier tau (hours of training), even where the run
    was interrupted at once. Refused instead, with the two ways on."""
    if json_path is None or not Path(json_path).is_file() or Path(json_path).stat().st_size == 0:
        return
    raise FileExistsError(
        f"{json_path} holds the taus of an earlier run, which this run would replace: pass "
        f"--resume to continue them, or write to another --json (delete the file to start "
        f"again).")


def _earlier_taus(args: argparse.Namespace) -> dict | None:
    """The file ``--resume`` continues, read (None: nothing to resume); refused when it
    holds taus the run would drop from it."""
    from ..lra.stability import stability_file_problem, taus_left_out

    if not args.resume:
        _refuse_replacing_taus(args.json_path)
        return None
    if args.json_path is None:
        raise ValueError("--resume continues the taus written to --json; give --json.")
    path = Path(args.json_path)
    earlier = read_to_resume(path, "an lra stability result", "--json")
    if earlier is None:
        return None
    problem = stability_file_problem(earlier)
    if problem:
        raise ValueError(f"cannot resume from {path}: not an lra stability result as --json "
                         f"writes it ({problem}); write to another --json.")
    left_out = taus_left_out(earlier, args.tasks, args.methods, args.seeds)
    if left_out:
        shown = ", ".join(left_out[:4]) + (f" and {len(left_out) - 4} more"
                                           if len(left_out) > 4 else "")
        raise ValueError(f"{path} holds taus this run does not ask for ({shown}), which "
                         "rewriting it would lose; give their tasks, methods and seeds too, or "
                         "write to another --json.")
    print(f"resuming from {path}", file=sys.stderr)
    return earlier


def _run_presets(args: argparse.Namespace) -> int:
    from ..lra.presets import PRESETS, QUICK, QUICK_MAX_BATCH, TrainConfig

    common = TrainConfig(task="listops")
    print("per task (Skyformer paper section 5; warm-up and evaluation from the reference "
          "LRA configuration):")
    for task, values in PRESETS.items():
        print(f"  {task:<11}" + "  ".join(f"{k}={v}" for k, v in values.items()))
    print(f"all tasks: steps={common.steps}, weight_decay={common.weight_decay}, "
          f"dim={common.dim}, hidden={common.hidden}, heads={common.heads}, "
          f"layers={common.layers}, dropout={common.dropout}, patience={common.patience}")
    print("--quick: " + "  ".join(f"{k}={v}" for k, v in QUICK.items())
          + f"  batch_size<={QUICK_MAX_BATCH}")
    return 0


def run(args: argparse.Namespace) -> int:
    runners = {"prepare": _run_prepare, "generate": _run_generate, "train": _run_train,
               "report": _run_report, "stability": _run_stability, "presets": _run_presets}
    if not args.lra_command:  # no subcommand: an error, so its help on stderr
        args._lra_parser.print_help(sys.stderr)
        return 2
    return runners[args.lra_command](args)
