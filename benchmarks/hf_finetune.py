"""Short fine-tune of MiniLM-L6 with Gaussian kernelized attention (not a drop-in).

    python benchmarks/hf_finetune.py [--methods kernelized skyformer] [--steps 100]

``skyformer hf-eval`` shows that swapping Gaussian kernelized attention (exact or
Skyformer's approximation) into the softmax-pretrained MiniLM-L6 loses much of its
sentence embedding. This distils the exact model's embeddings into the model with the
new attention on the sentences of the shipped text (every 5th sentence held out) and
reports held-out cosine similarity and retrieval recall@1 before and after. Writes JSON
and CSV (config and environment) and a PNG of the training loss under --out. Your own
sentences and model: --text and --model; --save DIR keeps each fine-tuned model.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script

from skyformer import get_method
from skyformer.checks import positive_int_argument
from skyformer.eval.hf.finetune import FinetuneConfig, distill
from skyformer.io import check_output_path, save_figure, write_csv, write_json

DEFAULT_FEATURES = 32


def _config(method: str, args: argparse.Namespace) -> FinetuneConfig:
    """The run of ``method``, checked: --features where the method has num_features and
    its name does not set it in brackets (there the brackets' value runs: --features,
    which has a default, would override it without a word)."""
    spec = get_method(method)
    bracketed = "num_features" in dict(spec.preset)
    if bracketed and args.features is not None:  # which of the two would be ambiguous
        raise ValueError(f"{method} sets num_features in its brackets and --features "
                         f"{args.features} sets it too; give it in one place.")
    takes = "num_features" in spec.option_names() and not bracketed
    features = DEFAULT_FEATURES if args.features is None else args.features
    config = FinetuneConfig(method=method, num_features=features if takes else None,
                            steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                            seq_len=args.seq_len, holdout=args.holdout, seed=args.seed,
                            text=args.text, model=args.model)
    config.validate()
    return config


def folder_name(method: str) -> str:
    """A folder name for ``method`` (a variant's brackets and commas made plain)."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", method).strip("_")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["kernelized", "skyformer"])
    parser.add_argument("--features", type=positive_int_argument, default=None,
                        help="num_features of approximate methods (default 32; a method "
                             "that sets it in brackets keeps its own)")
    parser.add_argument("--steps", type=positive_int_argument, default=100)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=positive_int_argument, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=positive_int_argument, default=128,
                        help="tokens a sentence is cut at (default 128)")
    parser.add_argument("--holdout", type=positive_int_argument, default=5,
                        help="every HOLDOUT-th sentence is held out for evaluation (default 5)")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file whose sentences train and evaluate (default: "
                             "the text shipped with skyformer)")
    parser.add_argument("--model", default=None,
                        help="local BERT-type model folder (default: MiniLM-L6)")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="save each fine-tuned model with its tokenizer to DIR/METHOD "
                             "(skyformer.hf.from_pretrained(DIR/METHOD) loads it with its "
                             "attention)")
    parser.add_argument("--out", default=str(RESULTS / "hf_finetune"),
                        help="path prefix of the results: OUT.json, OUT.csv, OUT.png")
    args = parser.parse_args(argv)
    try:  # what fails before training: a sentence, not a traceback after it
        configs = [_config(method, args) for method in args.methods]
        check_output_path(args.out)
        saves = [None] * len(configs) if args.save is None else [
            Path(args.save) / folder_name(config.method) for config in configs]
        for folder in saves:
            check_output_path(folder, folder=True)
    except (ValueError, TypeError, OSError) as err:
        print(f"hf_finetune: error: {err}", file=sys.stderr)
        return 2

    try:  # what only the data shows (a text of one sentence): a sentence too
        runs = [distill(config, progress=lambda line: print(f"  {line}", file=sys.stderr),
                        save_to=folder) for config, folder in zip(configs, saves, strict=True)]
    except (ValueError, OSError) as err:
        print(f"hf_finetune: error: {err}", file=sys.stderr)
        return 2

    header = (f"{'method':<12}{'features':>9}{'steps':>7}{'cos before':>12}{'cos after':>11}"
              f"{'R@1 before':>12}{'R@1 after':>11}{'train s':>9}")
    print(f"held-out sentences: {runs[0]['test_texts']}, "
          f"training sentences: {runs[0]['train_texts']}")
    print(header)
    print("-" * len(header))
    rows = []
    for run in runs:
        c, b, a = run["config"], run["before"], run["after"]
        # what ran: --features, or the brackets' own (skyformer[num_features=8])
        features = c["num_features"] if c["num_features"] is not None else \
            dict(get_method(c["method"]).preset).get("num_features")
        rows.append({"method": c["method"], "num_features": features, "steps": c["steps"],
                     "cosine_before": b["cosine_mean"], "cosine_after": a["cosine_mean"],
                     "recall_before": b["recall_at_1"], "recall_after": a["recall_at_1"],
                     "seconds": run["seconds"]})
        print(f"{c['method']:<12}{features or 'exact'!s:>9}{c['steps']:>7}"
              f"{b['cosine_mean']:>12.4f}{a['cosine_mean']:>11.4f}{b['recall_at_1']:>12.3f}"
              f"{a['recall_at_1']:>11.3f}{run['seconds']:>9.0f}")

    out = Path(args.out)
    metadata = run_metadata(__file__, argv, vars(args))
    write_json(out.with_suffix(".json"), {**metadata, "runs": runs})
    write_csv(out.with_suffix(".csv"), rows, metadata=metadata)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], label=run["config"]["method"])
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (1 - cosine to exact)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        save_figure(fig, out.with_suffix(".png"), dpi=110)  # a temporary file of its own
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.csv')}"
          + ("" if "matplotlib" not in sys.modules else f", {out.with_suffix('.png')}"))
    for folder in saves:
        if folder is not None:
            print(f"saved the fine-tuned model to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
