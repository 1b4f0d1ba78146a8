"""``skyformer compare``: every method against exact attention on real MiniLM Q/K/V."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys

from ..eval.compare import CompareConfig, compare, compare_on, format_table
from ..eval.compare.maps import MapPanel, describe
from ..eval.compare.run import CompareResult
from ..eval.data.qkv import load_qkv_file
from ..eval.methods import unread_features_note
from ..io import (
    check_output_path,
    environment,
    json_text,
    refuse_overwriting_inputs,
    write_json,
)
from .recorded import command_line

NAME = "compare"
HELP = (
    "compare every method with exact attention on real Q/K/V of the pretrained MiniLM-L6 "
    "model, or on your own (--qkv): relative spectral error, time, peak memory"
)


# the options that choose the model's Q/K/V (which --qkv replaces), with their defaults
MODEL_SOURCE = {"seq_len": CompareConfig.seq_len, "layer": CompareConfig.layer,
                "text": CompareConfig.text, "model": CompareConfig.model,
                "random_init": not CompareConfig.pretrained}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"sequence length N (default {MODEL_SOURCE['seq_len']})")
    parser.add_argument("--features", type=int, default=None,
                        help="num_features for every approximate method (default: each method's)")
    parser.add_argument("--layer", type=int, default=None,
                        help=f"model layer to take Q/K/V from (default "
                        f"{MODEL_SOURCE['layer']}, the first)")
    parser.add_argument("--seed", type=int, default=CompareConfig.seed,
                        help="seed of the methods' randomness (and of the --random-init "
                        f"weights; default {CompareConfig.seed})")
    parser.add_argument("--text", default=None, help="UTF-8 text file (default: shipped text)")
    parser.add_argument("--model", default=None,
                        help="local BERT-type model folder (default: pretrained MiniLM-L6)")
    parser.add_argument("--random-init", action="store_true",
                        help="same architecture, randomly initialised weights")
    parser.add_argument("--qkv", default=None, metavar="FILE",
                        help="your own Q/K/V instead of the model's: a torch.save file of a "
                        "dict q, k, v (each [B, H, N, D]) and optionally mask [B, Nk] (True = "
                        "real token), or the three tensors in order, or an .npz with those "
                        "keys (--seq-len, --layer, --text, --model, --random-init are "
                        "refused beside it: they choose the model's Q/K/V)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="subset of methods, each a name or a variant with options set, "
                        "'skyformer[pinv_gradient=implicit]'")
    parser.add_argument("--repeats", type=int, default=CompareConfig.repeats,
                        help=f"timed repeats (median; default {CompareConfig.repeats})")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    parser.add_argument(
        "--json", dest="json_path", default=None, metavar="FILE",
        help="write results to this JSON file ('-': to standard output, the table then "
        "to standard error)")
    parser.add_argument("--maps", default=None, metavar="FIGURE",
                        help="also draw the attention matrix each method applies to V for one "
                        "head of the first sequence, beside the exact one, with its relative "
                        "spectral error (a PNG, or the format its suffix names)")
    parser.add_argument("--maps-head", type=int, default=None,
                        help=f"the head --maps draws (default {CompareConfig.maps_head})")


def run(args: argparse.Namespace) -> int:
    """Measure and print; with ``--json -`` the JSON is standard output's only text
    (``skyformer compare --json - | jq``) and everything else goes to standard error."""
    to_stdout = args.json_path == "-"
    if not to_stdout:
        check_output_path(args.json_path)
    refuse_overwriting_inputs({"--json": args.json_path, "--maps": args.maps},
                              {"the --qkv file": args.qkv, "the --text file": args.text})
    text_out = contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext()
    with text_out:
        data = _measure(args)
    if data is not None:
        print(json_text(data, indent=2))
    return 0


def _measure(args: argparse.Namespace) -> dict | None:
    """``run``'s work: the results printed (and written to a ``--json`` file), returned
    as ``--json -`` prints them (None without ``--json -``)."""
    if args.qkv is not None:
        given = [f"--{name.replace('_', '-')}" for name in MODEL_SOURCE
                 if getattr(args, name) is not None and getattr(args, name) is not False]
        if given:
            raise ValueError(f"--qkv measures the tensors of its file as they are; "
                             f"{', '.join(given)} choose{'s' if len(given) == 1 else ''} the "
                             f"model's Q/K/V instead: give one or the other.")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}.")
    if args.qkv is None and importlib.util.find_spec("transformers") is None:
        raise ImportError("the model's Q/K/V need transformers: pip install 'skyformer[hf]' "
                          "(Q/K/V of your own need no extra: skyformer compare --qkv FILE).")
    config = CompareConfig(
        seq_len=MODEL_SOURCE["seq_len"] if args.seq_len is None else args.seq_len,
        layer=MODEL_SOURCE["layer"] if args.layer is None else args.layer,
        num_features=args.features,
        seed=args.seed,
        text=args.text,
        model=args.model,
        pretrained=not args.random_init,
        methods=tuple(args.methods) if args.methods else None,
        repeats=args.repeats,
        memory=not args.no_memory,
        maps=args.maps,
        maps_head=CompareConfig.maps_head if args.maps_head is None else args.maps_head,
    )
    if args.maps_head is not None and not args.maps:
        print("note: --maps-head changes nothing in this run: only --maps reads it.",
              file=sys.stderr)
    note = unread_features_note(config.methods, config.num_features)
    if note:
        print(note, file=sys.stderr)
    result = compare(config) if args.qkv is None else _compare_file(args, config)
    print(f"Q/K/V: {result.source}")
    print(f"seed {args.seed}: the draws of the randomized methods in every row"
          + ("" if not args.random_init else " and the random weights"))
    print(format_table(result.rows))
    if args.maps:
        print(f"wrote {args.maps}: the attention matrix of head {config.maps_head} of the first "
              f"sequence, each method's relative spectral error against its target's:")
        print("\n".join(describe(result.maps)))
    if not args.json_path:
        return None
    data = result.to_dict()
    if args.qkv is not None:  # the file's tensors, not a model's: no model settings
        data["config"] = {**{key: value for key, value in data["config"].items()
                             if key not in (*MODEL_SOURCE, "pretrained")},
                          "qkv": args.qkv}
    data = {**data, "command": command_line(args)}
    if args.json_path == "-":
        return data
    print(f"wrote {write_json(args.json_path, data)}")
    return None


def _compare_file(args: argparse.Namespace, config: CompareConfig) -> CompareResult:
    """``compare_on`` the Q/K/V (and key padding mask) of the ``--qkv`` file."""
    saved = load_qkv_file(args.qkv, label="--qkv")
    panels: list[MapPanel] = []
    rows = compare_on(saved[:3], config, key_padding_mask=saved.key_padding_mask,
                      maps=panels)
    return CompareResult(config, f"{args.qkv}: {saved.describe()}", rows,
                         environment(saved.q.device), panels)
