"""``skyformer compare``: every method against exact attention on real MiniLM Q/K/V."""

from __future__ import annotations

import argparse

from ..eval.compare import CompareConfig, compare, format_table
from ..io import check_output_path, write_json
from .recorded import command_line

NAME = "compare"
HELP = (
    "compare every method with exact attention on real Q/K/V of the pretrained MiniLM-L6 "
    "model (relative spectral error, time, peak memory)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length N (default 512)")
    parser.add_argument("--features", type=int, default=None,
                        help="num_features for every approximate method (default: each method's)")
    parser.add_argument("--layer", type=int, default=0,
                        help="model layer to take Q/K/V from (default 0, the first)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the methods' randomness (and of the --random-init "
                        "weights)")
    parser.add_argument("--text", default=None, help="UTF-8 text file (default: shipped text)")
    parser.add_argument("--model", default=None,
                        help="local BERT-type model folder (default: pretrained MiniLM-L6)")
    parser.add_argument("--random-init", action="store_true",
                        help="same architecture, randomly initialised weights")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="subset of methods, each a name or a variant with options set, "
                        "'skyformer[pinv_gradient=implicit]'")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    parser.add_argument(
        "--json", dest="json_path", default=None, help="write results to this JSON file"
    )


def run(args: argparse.Namespace) -> int:
    check_output_path(args.json_path)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}.")
    config = CompareConfig(
        seq_len=args.seq_len,
        layer=args.layer,
        num_features=args.features,
        seed=args.seed,
        text=args.text,
        model=args.model,
        pretrained=not args.random_init,
        methods=tuple(args.methods) if args.methods else None,
        repeats=args.repeats,
        memory=not args.no_memory,
    )
    result = compare(config)
    print(f"Q/K/V: {result.source}")
    print(f"seed {args.seed}: the draws of the randomized methods (their rows' seed)"
          + ("" if not args.random_init else " and the random weights"))
    print(format_table(result.rows))
    if args.json_path:
        path = write_json(args.json_path, {**result.to_dict(), "command": command_line(args)})
        print(f"wrote {path}")
    return 0
