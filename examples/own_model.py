"""Put an efficient attention into your own PyTorch model, and swap it by name.

    python examples/own_model.py                        # --quick: a few seconds on a CPU
    python examples/own_model.py --full --methods softmax skyformer "skyformer[num_features=32]"

A small transformer encoder classifier whose attention is ``skyformer.MultiHeadAttention``
(a batch-first layer ``[B, N, dim] -> [B, N, dim]`` taking a ``key_padding_mask`` that is
True for real tokens), trained for a few steps on synthetic, padded sequences: the label
says whether token 1 occurs more often than token 2 among a sequence's real tokens, so
the model has to look at every real position; the mask keeps the padding (id 0) out of the
attention and of the mean pooling, so the logits do not depend on it. The same model is
trained once per method named on the command line, from the same seed and on the same
batches. A method name may carry options, as in ``"skyformer[num_features=32]"``: every
approximate method takes ``num_features`` (landmarks, projection size, random features),
the exact ones (``softmax``, ``kernelized``) take none. Linformer learns projections of a
fixed length, so the layer is told the longest sequence (``seq_len=``).

It prints, per method, the training loss (cross-entropy, mean of the first and of the last
fifth of the steps; 0.69 is a coin toss) and the accuracy on 256 held-out sequences (about
0.57 for always answering the more frequent label, 1 for a perfect classifier).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import skyformer
from skyformer.checks import (
    heads_divide_width,
    method_argument,
    positive_float_argument,
    positive_int_argument,
)

# exact softmax, then approximations at 16 landmarks / projections / random features
DEFAULT_METHODS = ("softmax", "skyformer[num_features=16]", "nystromformer[num_features=16]",
                   "performer[num_features=16]", "linformer[num_features=16]")


class Block(nn.Module):
    """Pre-norm transformer block: attention by ``method``, then an MLP."""

    def __init__(self, dim: int, heads: int, method: str, seq_len: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = skyformer.MultiHeadAttention(dim, heads, method, seq_len=seq_len)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor, mask: Tensor, generator: torch.Generator | None) -> Tensor:
        """``x: [B, N, dim]``, ``mask: [B, N]`` bool (True = real token)."""
        x = x + self.attn(self.norm1(x), key_padding_mask=mask, generator=generator)
        return x + self.mlp(self.norm2(x))


class Classifier(nn.Module):
    """Token + learned position embeddings, blocks, mean over the real tokens, a linear head."""

    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int,
                 method: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, method, seq_len)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor, mask: Tensor,
                generator: torch.Generator | None = None) -> Tensor:
        """``tokens, mask: [B, N]`` -> logits ``[B, 2]``."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, mask, generator)
        weight = mask[..., None].to(x.dtype)
        pooled = (self.norm(x) * weight).sum(1) / weight.sum(1)
        return self.head(pooled)


def synthetic_batch(batch: int, seq_len: int, vocab: int,
                    generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Padded random sequences and their labels: ``tokens, mask: [B, N]``, ``labels: [B]``
    (1 where token 1 occurs more often than token 2 among the real tokens; ties are 0)."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch,), generator=generator)
    mask = torch.arange(seq_len)[None] < lengths[:, None]
    tokens = torch.where(mask, tokens, 0)  # padding id 0, never counted: the mask hides it
    ones, twos = ((tokens == t) & mask for t in (1, 2))
    labels = (ones.sum(1) > twos.sum(1)).long()
    return tokens, mask, labels


def vocab_holds_the_labels(parser: argparse.ArgumentParser, vocab: int) -> None:
    """``parser.error`` where ``synthetic_batch``'s tokens cannot hold padding, token 1
    and token 2, whose counts the labels compare (below 3 every label is 0)."""
    if vocab < 3:
        parser.error(f"argument --vocab: must be at least 3 (padding, tokens 1 and 2), got "
                     f"{vocab}")


@dataclass
class Result:
    method: str
    first_loss: float
    last_loss: float
    accuracy: float


def train(method: str, args: argparse.Namespace) -> Result:
    """Train one model with ``method`` from seed 0 on the same batches as every other."""
    torch.manual_seed(0)  # the same weights where no method draws state (Performer, Linformer)
    model = Classifier(args.vocab, args.seq_len, args.dim, args.heads, args.layers, method)
    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)
    draws = torch.Generator().manual_seed(2)  # the methods' landmarks, features, hashes
    losses = []
    model.train()
    for _ in range(args.steps):
        tokens, mask, labels = synthetic_batch(args.batch, args.seq_len, args.vocab, data)
        loss = nn.functional.cross_entropy(model(tokens, mask, draws), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    model.eval()
    tokens, mask, labels = synthetic_batch(256, args.seq_len, args.vocab,
                                           torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens, mask, torch.Generator().manual_seed(4))
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    window = max(1, args.steps // 5)  # losses of single batches are noisy: average a few
    return Result(method, sum(losses[:window]) / window, sum(losses[-window:]) / window,
                  accuracy)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=method_argument,
                        help="method names (skyformer.list_methods()) or variants "
                             "'name[option=value]'")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="small model and few steps, seconds on a CPU (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="longer sequences and more steps")
    parser.add_argument("--steps", type=positive_int_argument,
                        help="training steps (quick 30, full 300)")
    parser.add_argument("--seq-len", type=positive_int_argument,
                        help="longest sequence (quick 32, full 512)")
    parser.add_argument("--batch", type=positive_int_argument, default=16)
    parser.add_argument("--dim", type=positive_int_argument, default=32)
    parser.add_argument("--heads", type=positive_int_argument, default=2)
    parser.add_argument("--layers", type=positive_int_argument, default=1)
    parser.add_argument("--vocab", type=positive_int_argument, default=8)
    parser.add_argument("--lr", type=positive_float_argument, default=3e-3)
    args = parser.parse_args(argv)
    vocab_holds_the_labels(parser, args.vocab)
    heads_divide_width(parser, args.dim, args.heads)
    args.steps = args.steps or (30 if args.quick else 300)
    args.seq_len = args.seq_len or (32 if args.quick else 512)
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    results = []
    print(f"{'method':32} {'loss first':>10} {'loss last':>10} {'accuracy':>9}")
    for method in args.methods:
        r = train(method, args)
        results.append(r)
        print(f"{r.method:32} {r.first_loss:10.3f} {r.last_loss:10.3f} {r.accuracy:9.3f}",
              flush=True)
    return results


if __name__ == "__main__":
    main()
