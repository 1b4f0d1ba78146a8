"""``skyformer bench``: time and peak memory of every method against exact SDPA."""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from ..checks import positive_int_argument
from ..eval.bench.report import format_table, format_wide, result_path, write_results
from ..eval.bench.resume import (
    earlier_runs,
    read_earlier_result,
    refuse_to_replace_an_interrupted_run,
    replacing_a_finished_run,
    resumable_rows,
)
from ..eval.bench.run import DTYPES, BenchConfig, BenchResult, left_to_measure, run_bench
from ..eval.measure.timing import TIMINGS
from ..eval.methods import unread_features_note
from ..io import (
    check_output_path,
    remove_interrupted_writes,
    results_lock,
)
from .recorded import command_line

NAME = "bench"
MIN_N, MAX_N = 512, 16384  # the lengths without --seq-lens: MIN_N doubling up to MAX_N
HELP = (
    "time (forward, forward+backward) and peak memory of attention methods against exact "
    "SDPA over sequence lengths, with relative error, crossover length and scaling exponent"
)


def _shape(text: str) -> tuple[int, int, int]:
    try:
        b, h, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is B,H,D (e.g. 1,2,32), got {text!r}") from None
    return b, h, d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()  # the defaults, written once
    parser.add_argument("--methods", nargs="+", default=None,
                        help="registered names, variants with options set "
                        "('skyformer[pinv_gradient=implicit]') or "
                        "package.module:function[@softmax|@gaussian], called as "
                        "function(q, k, v, **options), with generator= where its "
                        "signature names one (default: every registered method; softmax "
                        "is always included)")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=None,
                        help="sequence lengths (default: --min-n doubling to --max-n)")
    parser.add_argument("--min-n", type=int, default=None,
                        help=f"shortest length (default {MIN_N}; not with --seq-lens)")
    parser.add_argument("--max-n", type=int, default=None,
                        help=f"longest length allowed (default {MAX_N}; not with --seq-lens): "
                        "lengths double from --min-n, the last being the largest such "
                        "length <= --max-n")
    parser.add_argument("--shapes", nargs="+", type=_shape, default=list(d.shapes),
                        metavar="B,H,D",
                        help=f"batch,heads,head-dim triples (default "
                        f"{' '.join(','.join(map(str, s)) for s in d.shapes)}; e.g. also 4,8,64)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(d.dtypes),
        choices=DTYPES,
        help=f"input dtypes (default {' '.join(d.dtypes)}; on a GPU e.g. bfloat16 float16 "
        "float32)",
    )
    parser.add_argument("--device", default=d.device, help=f"cpu or cuda (default {d.device})")
    parser.add_argument("--features", type=int, default=None,
                        help="num_features for every method that has it (default: each method's)")
    parser.add_argument(
        "--repeats", type=int, default=d.repeats,
        help=f"timed runs per configuration (median; default {d.repeats})"
    )
    parser.add_argument("--warmup", type=int, default=d.warmup,
                        help="untimed runs before the timed ones, after one untimed first "
                        f"call (default {d.warmup})")
    parser.add_argument("--forward-only", action="store_true", help="time the forward pass only")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip peak-memory measurement (the peak of one call above its "
                        "inputs and, with the backward pass, the output gradient)")
    parser.add_argument("--no-error", action="store_true", help="skip the relative error")
    parser.add_argument("--max-seconds", type=float, default=d.max_seconds,
                        help="skip configurations predicted to take longer per call: from "
                        "the two lengths before, or at least their operations at the measured "
                        f"matmul rate, the first length too (default {d.max_seconds:g})")
    parser.add_argument("--threads", type=positive_int_argument, default=None,
                        help="torch CPU threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default=d.clock,
                        help="wall time (default) or process CPU time (robust to other load on "
                        "a shared machine; use with --threads 1)")
    parser.add_argument("--timing", choices=TIMINGS, default=d.timing,
                        help="the repeats interleaved across methods (default), or each "
                        "method's in a block of its own after an idle pause (on a GPU a "
                        "long, heavy call can slow the light one after it)")
    parser.add_argument("--pause", type=float, default=None,
                        help=f"seconds idle before each block (--timing blocked; default "
                        f"{d.pause:g})")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help=f"seed of inputs and landmarks (default {d.seed})")
    parser.add_argument("--causal", action="store_true",
                        help="causal attention for every method (the reference is causal SDPA); "
                        "default methods: those that can be causal")
    parser.add_argument(
        "--out",
        default=None,
        help="write OUT.json, OUT.csv and OUT.png (e.g. benchmarks/results/bench_cpu; an "
        "OUT ending in .json, .csv or .png names the same three); a folder (one that "
        "exists, or OUT/) gets bench.json, bench.csv and bench.png",
    )
    parser.add_argument("--no-plot", "--no-plots", action="store_true",
                        help="with --out: no PNG (and remove the one an earlier run left)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --out: keep the rows of OUT.json (written after every sequence length) "
        "and measure only what is missing; the other settings must be the same",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print Markdown tables, one column per N (time with speed-up, memory)",
    )


def _seq_lens(args: argparse.Namespace) -> tuple[int, ...]:
    """The lengths asked for: ``--seq-lens``, or ``--min-n`` doubling up to ``--max-n``."""
    bounds = [(flag, value) for flag, value in (("--min-n", args.min_n), ("--max-n", args.max_n))
              if value is not None]
    if args.seq_lens is not None:
        if bounds:
            given = " ".join(f"{flag} {value}" for flag, value in bounds)
            raise ValueError(f"--seq-lens {' '.join(map(str, args.seq_lens))} with {given}: "
                             f"--seq-lens lists the lengths, --min-n and --max-n make them "
                             f"(doubling); pass one or the other, not both.")
        return tuple(args.seq_lens)
    low = MIN_N if args.min_n is None else args.min_n
    high = MAX_N if args.max_n is None else args.max_n
    _check_bounds(args, low, high)
    seq_lens, n = [], low
    while n <= high:
        seq_lens.append(n)
        n *= 2
    return tuple(seq_lens)


def _check_bounds(args: argparse.Namespace, low: int, high: int) -> None:
    """Lengths from ``low`` doubling up to ``high``: a sentence naming the bounds given,
    and the default where the other bound was not."""
    for flag, value in (("--min-n", args.min_n), ("--max-n", args.max_n)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}.")
    if low <= high:
        return
    if args.min_n is None:
        raise ValueError(f"--max-n {high} is below --min-n's default {MIN_N}: pass --min-n "
                         f"too, e.g. --min-n {max(1, high // 4)}.")
    if args.max_n is None:
        raise ValueError(f"--min-n {low} is above --max-n's default {MAX_N}: pass --max-n "
                         f"too, e.g. --max-n {low * 4}.")
    raise ValueError(f"--min-n {low} is above --max-n {high}: the lengths double from "
                     "--min-n up to --max-n; pass a --min-n at most --max-n.")


def _earlier_rows(config: BenchConfig, out: str | None) -> tuple[list[dict], list[dict]]:
    """The rows ``--resume`` keeps (those of OUT.json measured with the same settings)
    and the runs that measured them."""
    if out is None:
        raise ValueError("--resume continues the results written to --out; give --out.")
    path = result_path(out, ".json")
    earlier = read_earlier_result(path)
    if earlier is None:
        return [], []
    runs = earlier_runs(earlier, str(path))
    rows, unasked = resumable_rows(config, earlier)
    if unasked:  # refused, as lra stability's: rewriting the file would drop them
        lengths = sorted({row["n"] for row in unasked})
        every = " ".join(map(str, sorted(set(lengths) | set(config.seq_lens))))
        raise ValueError(
            f"{path} holds {len(unasked)} rows this run does not ask for (N = "
            f"{', '.join(map(str, lengths))}, or other shapes or dtypes), which rewriting it "
            f"would lose; ask for them too (--seq-lens {every}, and their shapes and "
            f"dtypes), or write to another --out.")
    print(f"resuming from {path}: {len(rows)} rows measured before", file=sys.stderr)
    return rows, runs


def _finished(out: str) -> bool:
    """Whether ``out``'s results were written by a run that ended (``complete``)."""
    earlier = read_earlier_result(result_path(out, ".json"))
    return earlier is not None and earlier.get("complete") is True


def _prefix(out: str | None) -> str | None:
    """``--out`` as the prefix of the result files: a folder (one that exists, or a path
    ending in a separator) holds ``bench.json``, ``.csv`` and ``.png``, as the other
    commands' ``--out DIR``; anything else is the prefix itself."""
    separators = tuple(sep for sep in (os.sep, os.altsep) if sep)
    if out and (out.endswith(separators) or os.path.isdir(out)):
        return os.path.join(out, "bench")
    return out


def run(args: argparse.Namespace) -> int:
    args.out = _prefix(args.out)
    check_output_path(args.out)  # a prefix: PREFIX.json, .csv, .png
    if args.out:
        for suffix in (".json", ".csv") + (() if args.no_plot else (".png",)):
            check_output_path(result_path(args.out, suffix))
    if args.no_plot and not args.out:
        print("note: --no-plot changes nothing without --out (no file is written, the plot "
              "included)", file=sys.stderr)
    if args.pause is not None and args.timing != "blocked":
        print(f"note: --pause {args.pause:g} changes nothing with --timing {args.timing} "
              f"(the repeats interleaved across methods, with no idle pause); it is the "
              f"pause of --timing blocked", file=sys.stderr)
    if args.out and not args.no_plot:
        from ..eval.approx.plots import require_matplotlib

        # fail before the run, not after it, when matplotlib is missing
        require_matplotlib("pass --no-plot")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.device == "cpu" and torch.get_num_threads() > 1:
        print(f"note: --clock cpu adds the CPU time of all {torch.get_num_threads()} threads, "
              f"so a call that runs on several reads as slower than its wall time; pass "
              f"--threads 1 for times comparable with one another", file=sys.stderr)
    config = BenchConfig(
        methods=tuple(args.methods) if args.methods else None, seq_lens=_seq_lens(args),
        shapes=tuple(args.shapes), dtypes=tuple(args.dtypes), device=args.device,
        num_features=args.features, repeats=args.repeats, warmup=args.warmup,
        backward=not args.forward_only, memory=not args.no_memory, error=not args.no_error,
        seed=args.seed, max_seconds=args.max_seconds, clock=args.clock, causal=args.causal,
        timing=args.timing, pause=BenchConfig.pause if args.pause is None else args.pause,
    )
    note = unread_features_note(config.methods, config.num_features)
    if note:
        print(note, file=sys.stderr)
    if not args.out:
        return _measure(args, config)
    with results_lock(result_path(args.out, ".json")):  # one run at a time writes OUT.*
        written = [result_path(args.out, suffix) for suffix in (".json", ".csv", ".png")]
        remove_interrupted_writes(written[0].parent, tuple(p.name for p in written),
                                  say=functools.partial(print, file=sys.stderr))
        if not args.resume:
            refuse_to_replace_an_interrupted_run(result_path(args.out, ".json"))
            replacing = replacing_a_finished_run(result_path(args.out, ".json"))
            if replacing:
                print(replacing, file=sys.stderr)
        return _measure(args, config)


def _measure(args: argparse.Namespace, config: BenchConfig) -> int:
    """The run of ``run``: measure, print the tables, write ``--out`` as it goes."""
    measured, runs = _earlier_rows(config, args.out) if args.resume else (None, None)
    if measured and not left_to_measure(config, measured) and _finished(args.out):
        # a run that added nothing would still be listed in the file, and head it
        print(f"nothing to resume: {result_path(args.out, '.json')} holds every length of "
              f"these settings; run without --resume to measure them again.", file=sys.stderr)
        return 0
    command = command_line(args)

    def write_partial(partial: BenchResult) -> None:
        write_results(partial, args.out, plot=False, command=command, complete=False)

    result = run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True),
                       measured=measured, earlier_runs=runs,
                       after_length=write_partial if args.out else None)
    print(format_wide(result) if args.markdown else format_table(result))
    env = result.environment
    print(f"\ntorch {env['torch']}, {env['device']}, {env['torch_threads']} threads, "
          f"{config.clock} clock, {config.timing} timing, load average "
          f"{env.get('load_average_start')} -> {env.get('load_average_end')}"
          + (" (this run; the earlier runs' are in the result file's runs)"
             if len(result.runs) > 1 else ""))
    if args.out:
        for path in write_results(result, args.out, plot=not args.no_plot, command=command):
            print(f"wrote {path}")
    return 0
