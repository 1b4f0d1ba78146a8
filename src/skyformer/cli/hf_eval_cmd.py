"""``skyformer hf-eval``: every method inside the pretrained MiniLM-L6, no fine-tuning."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval.hf.run import SETTINGS, HFEvalConfig
from .recorded import command_line

NAME = "hf-eval"
HELP = (
    "replace the attention of the pretrained MiniLM-L6 sentence-embedding model by each "
    "method (no fine-tuning): embedding cosine similarity and retrieval recall@1 against the "
    "exact model, forward time and peak memory, on short (sentences) and long (512-token) inputs"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = HFEvalConfig()  # the defaults, written once
    parser.add_argument("--methods", nargs="+", default=None,
                        help="subset of methods, each a name or a variant with options set, "
                        "'skyformer[pinv_gradient=implicit]' (default: all)")
    parser.add_argument("--features", nargs="+", type=int, default=list(d.features),
                        help="num_features values for approximate methods (default: "
                        f"{' '.join(map(str, d.features))})")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(d.settings),
                        help="short: sentences in padded batches; long: --seq-len token inputs "
                        "(default: both)")
    parser.add_argument("--layers", nargs="+", type=int, default=None,
                        help="replace attention only in these layers (default: all)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len,
                        help="tokens per long input; short sentences are truncated to it "
                        f"too (default {d.seq_len})")
    parser.add_argument("--max-texts", type=int, default=d.max_texts,
                        help=f"texts per setting (default {d.max_texts})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"texts per forward pass (default {d.batch_size})")
    parser.add_argument("--time-batch", type=int, default=None,
                        help="texts in the timed and memory-measured forward pass (default: "
                        "--batch-size sentences for short inputs, one long input)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help=f"seed of the methods' randomness (default {d.seed})")
    parser.add_argument("--repeats", type=int, default=d.repeats,
                        help=f"timed repeats (median; default {d.repeats})")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    parser.add_argument("--text", default=None, help="UTF-8 text file (default: shipped text)")
    parser.add_argument("--model", default=None,
                        help="local BERT-type model folder (default: pretrained MiniLM-L6)")
    parser.add_argument("--device", default=d.device, help=f"{d.device} (default) or cuda[:i]")
    parser.add_argument("--clock", choices=["wall", "cpu"], default=d.clock,
                        help="wall time (default) or CPU time of the process (on a shared "
                        "CPU it leaves out waiting for a core; use with OMP_NUM_THREADS=1)")
    parser.add_argument("--out", default="results/hf-eval",
                        help="folder for hf_eval.json, .csv, .md (table) and .png "
                        "(default results/hf-eval)")
    parser.add_argument("--no-plot", "--no-plots", action="store_true",
                        help="skip the PNG plot (and remove the one an earlier run left in --out)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    from ..eval.hf.report import format_table, markdown_table, plot, write_csv
    from ..eval.hf.run import evaluate, hf_eval_steps
    from ..io import (
        atomic_write_text,
        check_output_path,
        remove_stale,
        replacing_together,
        write_json,
    )

    check_output_path(args.out, folder=True)
    import skyformer.hf  # noqa: F401  (first: without transformers there is no evaluation)

    if not args.no_plot:  # fail before the evaluation, not in its files' writing
        from ..eval.approx.plots import require_matplotlib

        require_matplotlib("pass --no-plots")

    config = HFEvalConfig(
        methods=tuple(args.methods) if args.methods else None, features=tuple(args.features),
        settings=tuple(args.settings),
        layers=tuple(args.layers) if args.layers is not None else None, seq_len=args.seq_len,
        max_texts=args.max_texts, batch_size=args.batch_size, time_batch=args.time_batch,
        seed=args.seed, repeats=args.repeats, memory=not args.no_memory, text=args.text,
        model=args.model, device=args.device, clock=args.clock,
    )
    if args.quiet or not sys.stderr.isatty():
        result = evaluate(config)
    else:  # a bar on a terminal, naming what runs; nothing when piped
        from tqdm.auto import tqdm

        with tqdm(total=hf_eval_steps(config), desc="hf-eval", unit="run", leave=False) as bar:
            def progress(line: str) -> None:
                bar.set_postfix_str(line)
                bar.update(1)

            result = evaluate(config, progress=progress)
    texts = "; ".join(
        f"{s}: {t['count']} texts of {_token_range(t['min_tokens'], t['max_tokens'])} tokens "
        f"({t['timed_texts']} in the timed pass)"
        for s, t in result.texts.items()
    )
    layers = "every layer" if config.layers is None else \
        f"layer{'s' if len(config.layers) > 1 else ''} {', '.join(map(str, config.layers))}"
    kind = "pretrained " if config.model is None else ""
    print(f"model: {kind}{result.model}, no fine-tuning, the method in {layers}; {texts}")
    print("cos: cosine similarity of the embeddings to the exact model's (mean, min); R@1: "
          f"nearest-neighbour agreement with the exact model; time ({config.clock} clock) and "
          f"memory: one forward pass; seed {config.seed}: the draws of the randomized methods "
          "in every row and the initial values of weights a method adds (Linformer's "
          "projections and the like; no fine-tuning)")
    print(format_table(result.rows))
    out = Path(args.out)
    names = ["hf_eval.json", "hf_eval.csv", "hf_eval.md"] + ([] if args.no_plot
                                                             else ["hf_eval.png"])
    with replacing_together(out) as stage:  # all of this run's files, or none of them
        data = {**result.to_dict(), "command": command_line(args)}
        write_json(stage / "hf_eval.json", data)
        write_csv(stage / "hf_eval.csv", result.rows,
                  metadata={key: data[key] for key in ("config", "environment", "command")})
        atomic_write_text(stage / "hf_eval.md", markdown_table(result.rows) + "\n")
        if not args.no_plot:
            plot(stage / "hf_eval.png", result.rows,
                 title=f"{result.model} with each method's attention, no fine-tuning")
    if args.no_plot:
        remove_stale(out / "hf_eval.png")
    print("wrote " + ", ".join(str(out / name) for name in names))
    return 0


def _token_range(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"
