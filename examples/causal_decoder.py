"""A tiny decoder with causal Skyformer attention: train it, then generate with a cache.

    python examples/causal_decoder.py                   # --quick: a few seconds on a CPU
    python examples/causal_decoder.py --full \\
        --method "nystrom_softmax[num_features=32,landmark_stride=4]"

A byte-level language model (pre-norm blocks of ``skyformer.MultiHeadAttention(...,
causal=True)``: query i sees positions j <= i) is trained for a few steps on the
public-domain English text shipped with skyformer, then continues a prompt greedily, one
byte at a time, through per-layer decoding caches (``layer.new_cache``). A cache keeps a
state whose size stops growing with the generated length for ``skyformer``,
``nystrom_softmax`` (once every landmark slot is revealed, after ``num_features *
landmark_stride`` positions), ``performer`` and ``linear`` (a key/value cache for the exact
methods), and each step's outputs equal the full causal forward over the whole sequence
with the same random key; the example checks that by also generating without caches,
recomputing the forward over every position at every step, and printing both texts and
the largest difference of their next-byte logits (float32 rounding, about 1e-6, when they
agree; the greedy bytes of a briefly trained model can agree even where they do not).

Two settings make the two agree: one random key, ``skyformer.random_key(seed)``, from which
each layer's forward and cache take the same key of their own, ``skyformer.fold_in(key, i)``
for layer i (a ``torch.Generator`` would be advanced by each draw; one key for every layer
would give them all the same landmarks), and
a fixed ``landmark_stride`` (one landmark slot per that many tokens; without it a cache
keeps the prompt's stride, the forward takes the whole sequence's: docs/causal.md).
Causal ``skyformer`` and ``nystrom_softmax`` attend exactly to the keys of the query's own
chunk of 64 positions and through landmarks to earlier chunks, so sequences of at most 64
positions get exact attention: the training windows and the generation go beyond that.
"""

from __future__ import annotations

import argparse
import math
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
from skyformer.eval.data.text import default_text


class Block(nn.Module):
    """Pre-norm decoder block: causal attention by ``method``, then an MLP."""

    def __init__(self, dim: int, heads: int, method: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = skyformer.MultiHeadAttention(dim, heads, method, causal=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, key: Tensor | None = None, cache: object = None) -> Tensor:
        """``x: [B, n, dim]``: the whole sequence (``key``), or its next positions (``cache``)."""
        h = self.norm1(x)
        x = x + (self.attn(h, cache=cache) if cache is not None else self.attn(h, generator=key))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Byte embedding + sinusoidal positions + blocks + final norm + next-byte logits."""

    def __init__(self, dim: int, heads: int, layers: int, method: str) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, method) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def positions(self, start: int, n: int) -> Tensor:
        """Sinusoidal encodings of positions ``start .. start + n - 1``: ``[n, dim]`` (an
        odd dim drops the last cosine)."""
        pos = torch.arange(start, start + n, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, self.dim, 2) * (-math.log(10000.0) / self.dim))
        return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], -1)[:, :self.dim]

    def forward(self, tokens: Tensor, key: Tensor | None = None, caches: list | None = None,
                start: int = 0) -> Tensor:
        """``tokens: [B, n]`` at positions ``start ..`` -> logits ``[B, n, 256]``: the whole
        sequence with ``key``, or the next positions with one cache per layer."""
        x = self.embed(tokens) + self.positions(start, tokens.shape[1])
        for i, block in enumerate(self.blocks):  # layer i's key: its own landmarks
            x = block(x, None if key is None else skyformer.fold_in(key, i),
                      None if caches is None else caches[i])
        return self.head(self.norm(x))


def text_batches(seq_len: int, batch: int, generator: torch.Generator) -> Tensor:
    """Random windows of ``seq_len + 1`` bytes of the shipped text: ``[batch, seq_len + 1]``."""
    data = torch.tensor(list(default_text().encode("utf-8")))
    start = torch.randint(0, len(data) - seq_len - 1, (batch, 1), generator=generator)
    return data[start + torch.arange(seq_len + 1)]


@torch.no_grad()
def generate_cached(model: Decoder, prompt: Tensor, steps: int,
                    key: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """Greedy continuation of ``prompt: [1, n0]`` by ``steps`` bytes through decoding caches,
    each step running the model on one new position: ``[1, n0 + steps]``, the next-byte
    logits each step chose from, ``[steps, 256]``, and the bytes the caches hold after
    each step."""
    caches = [block.attn.new_cache(generator=skyformer.fold_in(key, i))  # as the forward's
              for i, block in enumerate(model.blocks)]
    tokens, logits = prompt, model(prompt, caches=caches)[:, -1]
    chosen, sizes = [], []
    for _ in range(steps):
        chosen.append(logits[0])
        nxt = logits.argmax(-1, keepdim=True)
        logits = model(nxt, caches=caches, start=tokens.shape[1])[:, -1]
        tokens = torch.cat([tokens, nxt], 1)
        sizes.append(sum(cache.nbytes() for cache in caches))
    return tokens, torch.stack(chosen), sizes


@torch.no_grad()
def generate_full(model: Decoder, prompt: Tensor, steps: int,
                  key: Tensor) -> tuple[Tensor, Tensor]:
    """The same continuation, recomputing the causal forward over every position per step:
    ``[1, n0 + steps]`` and the next-byte logits ``[steps, 256]``."""
    tokens, chosen = prompt, []
    for _ in range(steps):
        logits = model(tokens, key)[:, -1]
        chosen.append(logits[0])
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens, torch.stack(chosen)


@dataclass
class Result:
    first_loss: float
    last_loss: float
    cached: str
    full: str
    max_logit_difference: float  # cached against full, over every step's next-byte logits
    cache_bytes: list[int]  # after each generated byte


def train(model: Decoder, args: argparse.Namespace) -> list[float]:
    """Next-byte cross-entropy, AdamW; the losses of every step."""
    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed)
    landmarks = skyformer.random_key(args.seed)
    losses = []
    for step in range(args.steps):
        window = text_batches(args.seq_len, args.batch, data)
        logits = model(window[:, :-1], skyformer.fold_in(landmarks, step))  # new per step
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="skyformer[num_features=16,landmark_stride=4]",
                        type=method_argument,
                        help="a method that can be causal (skyformer, nystrom_softmax, "
                             "performer, linear, softmax, kernelized), options in brackets; "
                             "give skyformer and nystrom_softmax a landmark_stride")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="a small model, few steps, seconds on a CPU (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="a wider model trained longer on longer windows")
    parser.add_argument("--steps", type=positive_int_argument,
                        help="training steps (quick 30, full 500)")
    parser.add_argument("--seq-len", type=positive_int_argument,
                        help="training window (quick 128, full 512)")
    parser.add_argument("--generate", type=positive_int_argument,
                        default=170, help="bytes to generate")
    parser.add_argument("--prompt", default="We hold these truths to be")
    parser.add_argument("--batch", type=positive_int_argument, default=8)
    parser.add_argument("--dim", type=positive_int_argument,
                        help="model width (quick 32, full 128)")
    parser.add_argument("--heads", type=positive_int_argument, default=2)
    parser.add_argument("--layers", type=positive_int_argument, default=2)
    parser.add_argument("--lr", type=positive_float_argument, default=3e-3)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights, the training data and landmarks, and the "
                             "generation's random key")
    args = parser.parse_args(argv)
    if not skyformer.get_method(args.method).capabilities.causal:
        parser.error(f"argument --method: {args.method} cannot attend causally; take one "
                     f"of {', '.join(skyformer.registry.methods_that_can('causal'))}")
    if not args.prompt:
        parser.error("--prompt is empty; give at least one character to continue.")
    quick = args.quick
    args.steps = args.steps or (30 if quick else 500)
    args.seq_len = args.seq_len or (128 if quick else 512)
    args.dim = args.dim or (32 if quick else 128)
    heads_divide_width(parser, args.dim, args.heads)
    text = len(default_text().encode("utf-8"))
    if args.seq_len > text - 2:  # windows of seq_len + 1 bytes, at more than one start
        parser.error(f"argument --seq-len: the training text holds {text} bytes, so windows "
                     f"are at most {text - 2} long, got {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = Decoder(args.dim, args.heads, args.layers, args.method)
    losses = train(model, args)
    print(f"{args.method}: training loss {losses[0]:.3f} -> {losses[-1]:.3f} (nats per byte)")
    model.eval()
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))])
    key = skyformer.random_key(args.seed)
    cached, cached_logits, sizes = generate_cached(model, prompt, args.generate, key)
    full, full_logits = generate_full(model, prompt, args.generate, key)
    difference = (cached_logits - full_logits).abs().max().item()
    result = Result(losses[0], losses[-1],
                    *(bytes(t[0].tolist()).decode("utf-8", "replace") for t in (cached, full)),
                    difference, sizes)
    print(f"with caches:    {result.cached!r}")
    print(f"full forwards:  {result.full!r}  ({'the same' if cached.equal(full) else 'differs'})")
    # greedy bytes can agree where the logits do not: float32 rounding is about 1e-6
    print(f"largest difference of the next-byte logits, caches against full: {difference:.1e}")
    method = skyformer.get_method(args.method)
    if difference > 1e-4 and "landmark_stride" in method.option_names() \
            and "landmark_stride" not in dict(method.preset):
        print(f"(they differ: {method.name} without a fixed landmark_stride keeps the prompt's "
              f"stride in the caches, the full forward takes the whole sequence's; "
              f"docs/causal.md)")
    # a state's size cycles with the 64-position chunks of its exact local part: compare
    # it at chunk boundaries (at the end where the generation crosses none)
    n0 = prompt.shape[1]
    ends = [n for n in range(64, n0 + args.generate + 1, 64) if n > n0] \
        or [n0 + args.generate]
    sizes_at = ", ".join(f"{sizes[n - n0 - 1] / 1024:.1f} KiB after {n}" for n in ends)
    print(f"caches of all layers: {sizes_at} positions")
    return result


if __name__ == "__main__":
    main()
