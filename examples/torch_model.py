"""Swap an efficient attention into a model built on torch's own layers, weights kept.

    python examples/torch_model.py                      # --quick: a few seconds on a CPU
    python examples/torch_model.py --full               # one to two minutes on 2 CPU cores
    python examples/torch_model.py --methods skyformer "performer[num_features=8]"

A user's plain PyTorch classifier: an embedding, an ``nn.TransformerEncoder`` of
``nn.TransformerEncoderLayer(batch_first=True)`` (torch's ``nn.MultiheadAttention``
inside) and a linear head, trained briefly with torch's exact attention on the padded
sequences of examples/own_model.py (is token 1 more frequent than token 2 among the real
tokens?). The head reads one position only, a classification token put in front, so
what it knows of the sequence came to it through attention. Then
``skyformer.replace_attention`` swaps ``skyformer.TorchMultiheadAttention`` into a copy of
the model for every torch attention layer, the trained weights carried over:

1. ``"softmax"``: the copy computes what torch's layers do; the largest difference of
   the logits is float32 rounding, which shows that the weights carried over;
2. each of ``--methods`` (``--num-features`` landmarks / random features, unless the
   name sets them in brackets): its accuracy on held-out sequences as swapped, with no
   training, then after a short fine-tune of the copy (``--finetune-steps``), below
   torch's model fine-tuned alike. ``nystromformer`` and ``performer`` approximate
   softmax attention; ``kernelized`` (exact) and ``skyformer`` (its approximation)
   compute Gaussian kernelized attention, another function than softmax, so
   softmax-trained weights may need the fine-tune with them (the last line says what
   this run shows).

Every evaluation runs in eval mode under ``torch.no_grad()`` with a
``src_key_padding_mask``, where torch takes its fast path: the plain model runs torch's
fused encoder layers on nested tensors. In the swapped copies each layer declines that
fused path (a forward pre-hook on the attention), so the chosen method always runs.
torch's layers pass no ``generator`` to their attention: the randomised methods
(skyformer's landmarks, Performer's features) draw from torch's global generator, which
the example seeds before every swap, training and evaluation, so a run repeats exactly.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import skyformer
from skyformer.checks import (
    heads_divide_width,
    method_argument,
    positive_float_argument,
    positive_int_argument,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is no package
from own_model import synthetic_batch, vocab_holds_the_labels  # sequences and labels

DEFAULT_METHODS = ("kernelized", "nystromformer", "performer", "skyformer")
EXACT = "exact (torch's layers)"  # the first row: the model as trained, no swap


class TorchClassifier(nn.Module):
    """Token + learned position embeddings with a classification token in front, torch's
    ``nn.TransformerEncoder``, a linear head on the classification token's output."""

    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.cls = vocab  # the classification token's id, after the data's 0 .. vocab - 1
        self.embed = nn.Embedding(vocab + 1, dim)
        self.position = nn.Parameter(torch.randn(seq_len + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """``tokens, mask: [B, N]`` (mask True = real token, as own_model's) -> ``[B, 2]``."""
        cls = torch.full_like(tokens[:, :1], self.cls)
        tokens = torch.cat([cls, tokens], 1)
        padding = ~torch.cat([torch.ones_like(mask[:, :1]), mask], 1)  # torch's: True = pad
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def train(model: nn.Module, steps: int, lr: float, args: argparse.Namespace, data_seed: int
          ) -> list[float]:
    """``steps`` AdamW steps at ``lr`` on fresh batches of ``data_seed``; the losses."""
    torch.manual_seed(args.seed)  # the methods' draws: torch's layers pass no generator
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(data_seed)
    model.train()
    losses = []
    for _ in range(steps):
        tokens, mask, labels = synthetic_batch(args.batch, args.seq_len, args.vocab, data)
        loss = nn.functional.cross_entropy(model(tokens, mask), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def evaluate(model: nn.Module, test: tuple[Tensor, Tensor, Tensor], seed: int
             ) -> tuple[float, Tensor]:
    """Accuracy and logits on the held-out ``test`` batch, in eval under no_grad."""
    tokens, mask, labels = test
    model.eval()
    torch.manual_seed(seed)  # the randomised methods' draws in eval too
    # Eval, no_grad and a src_key_padding_mask: torch's fast path. TransformerEncoder packs
    # the real tokens into a nested tensor and each layer would run torch's fused softmax
    # attention; a TorchMultiheadAttention declines that fused layer path (a pre-hook), so
    # its method runs, on the nested tensor padded again.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
        logits = model(tokens, mask)
    return (logits.argmax(-1) == labels).float().mean().item(), logits


@dataclass
class Result:
    softmax_difference: float  # max |logits - torch's| after replace_attention(.., "softmax")
    swapped: dict[str, float]  # accuracy of each model as swapped in, no training
    finetuned: dict[str, float]  # ... after --finetune-steps more steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=method_argument,
                        help="methods swapped in (skyformer.list_methods()), options in "
                             "brackets allowed: 'skyformer[num_features=8]'")
    parser.add_argument("--num-features", type=positive_int_argument, default=16,
                        help="num_features of each method that takes it (default 16)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="short sequences and few steps, seconds on a CPU (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="longer sequences and more steps, one to two minutes on 2 cores")
    parser.add_argument("--steps", type=positive_int_argument,
                        help="training steps, exact attention (quick 60, full 600)")
    parser.add_argument("--finetune-steps", type=positive_int_argument,
                        help="fine-tuning steps per method (quick 10, full 150)")
    parser.add_argument("--seq-len", type=positive_int_argument,
                        help="longest sequence (quick 24, full 128)")
    parser.add_argument("--test", type=positive_int_argument,
                        default=512, help="held-out sequences")
    parser.add_argument("--batch", type=positive_int_argument, default=32)
    parser.add_argument("--dim", type=positive_int_argument, default=32)
    parser.add_argument("--heads", type=positive_int_argument, default=2)
    parser.add_argument("--layers", type=positive_int_argument, default=2)
    parser.add_argument("--vocab", type=positive_int_argument, default=8)
    parser.add_argument("--lr", type=positive_float_argument, default=3e-3)
    parser.add_argument("--finetune-lr", type=positive_float_argument, default=1e-3,
                        help="learning rate of the fine-tunes (3e-3 unsettles skyformer's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and draws")
    args = parser.parse_args(argv)
    vocab_holds_the_labels(parser, args.vocab)
    heads_divide_width(parser, args.dim, args.heads)
    args.steps = args.steps or (60 if args.quick else 600)
    args.finetune_steps = (args.finetune_steps if args.finetune_steps is not None
                           else 10 if args.quick else 150)
    args.seq_len = args.seq_len or (24 if args.quick else 128)
    return args


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = TorchClassifier(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    losses = train(model, args.steps, args.lr, args, data_seed=args.seed + 1)
    test = synthetic_batch(args.test, args.seq_len, args.vocab,
                           torch.Generator().manual_seed(args.seed + 2))
    exact, exact_logits = evaluate(model, test, args.seed)
    window = max(1, args.steps // 5)
    print(f"trained with torch's exact attention for {args.steps} steps: loss "
          f"{sum(losses[:window]) / window:.3f} -> {sum(losses[-window:]) / window:.3f}, "
          f"accuracy {exact:.3f} on {args.test} held-out sequences")

    softmax = skyformer.replace_attention(copy.deepcopy(model), "softmax")
    _, logits = evaluate(softmax, test, args.seed)
    result = Result((logits - exact_logits).abs().max().item(), {}, {})
    print(f'replace_attention(model, "softmax"): logits differ from torch\'s by at most '
          f"{result.softmax_difference:.1e}: the weights carried over\n")

    rows: list[tuple[str, str | None, dict[str, int]]] = [(EXACT, None, {})]
    for method in args.methods:  # a name, the method, its options at replace_attention
        spec = skyformer.get_method(method)
        if "num_features" in spec.option_names() and "num_features" not in dict(spec.preset):
            n = args.num_features
            name = f"{method[:-1]},num_features={n}]" if method.endswith("]") \
                else f"{method}[num_features={n}]"
            rows.append((name, method, {"num_features": n}))
        else:
            rows.append((method, method, {}))
    width = max(len(name) for name, _, _ in rows)
    tuned = f"fine-tuned {args.finetune_steps} steps"
    print(f"{'attention':{width}} {'no fine-tune':>12} {tuned:>22}")
    for name, method, options in rows:
        if method is None:  # torch's model, fine-tuned as the others: what they compare with
            swapped = copy.deepcopy(model)
        else:
            torch.manual_seed(args.seed)  # the layers' own draws (Performer's features)
            swapped = skyformer.replace_attention(copy.deepcopy(model), method,
                                                  seq_len=args.seq_len + 1, **options)
        result.swapped[name], _ = evaluate(swapped, test, args.seed)
        train(swapped, args.finetune_steps, args.finetune_lr, args, data_seed=args.seed + 3)
        result.finetuned[name], _ = evaluate(swapped, test, args.seed)
        print(f"{name:{width}} {result.swapped[name]:12.3f} {result.finetuned[name]:22.3f}",
              flush=True)
    sentence = _gaussian_sentence(result)
    if sentence:
        print("\n" + sentence)
    return result


def _gaussian_sentence(result: Result) -> str:
    """What the run shows of the Gaussian-kernel methods swapped into softmax-trained
    weights: their accuracy as swapped against the exact model's."""
    exact = result.swapped[EXACT]
    gaussian = {n: a for n, a in result.swapped.items() if n != EXACT
                and skyformer.get_method(n).capabilities.target == "gaussian"}
    if not gaussian:
        return ""
    said = (f"{' and '.join(gaussian)} compute{'s' * (len(gaussian) == 1)} Gaussian "
            f"kernelized attention, not softmax")
    lost = {n: exact - a for n, a in gaussian.items() if a < exact - 0.02}
    if lost:
        worst = max(lost, key=lost.get)
        return (f"{said}: as swapped, {worst} scored {gaussian[worst]:.3f} against the exact "
                f"model's {exact:.3f}; softmax-trained weights need the fine-tune with them.")
    return (f"{said}: here, after a short training, they kept the exact model's accuracy "
            f"({exact:.3f}) as swapped; weights trained longer (--full) may not.")


if __name__ == "__main__":
    main()
