"""A small byte-level causal language model: exact causal softmax vs each causal approximation.

    python benchmarks/causal_lm.py                      # full run (see docs/causal.md)
    python benchmarks/causal_lm.py --ns 128 --steps 3   # smoke run

The public-domain text shipped with the package (``skyformer.eval.data.text``) as bytes:
the first 90 % trains, the last 10 % is held out. For each context length N and each
method (``softmax`` exact, then every registered approximate method with capability
``causal``) the same model (embedding + learned positions, ``--layers`` pre-norm blocks
of ``skyformer.nn.MultiHeadAttention(method, causal=True)`` and an MLP, width
``--dim``) is trained from the same initialisation for ``--steps`` AdamW steps on random
windows of N + 1 bytes, at the same budget (``--m`` = num_features for every method
that has it). Reported: held-out loss (nats per byte, mean over non-overlapping
held-out windows) and training tokens/s (median over steps after ``--warmup``). Writes
``benchmarks/results/causal_lm/causal_lm.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from skyformer.eval.data.text import default_text
from skyformer.nn import MultiHeadAttention
from skyformer.registry import get_method, list_methods


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, method: str, options: dict) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, heads, method, causal=True, **options)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        x = x + self.attn(self.norm1(x), generator=generator)
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """Bytes ``[B, N]`` -> next-byte logits ``[B, N, 256]``."""

    def __init__(self, n: int, dim: int, heads: int, layers: int, method: str,
                 options: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.randn(n, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, method, options) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 256))

    def forward(self, ids: Tensor, generator: torch.Generator | None = None) -> Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, generator)
        return self.head(x)


def causal_methods() -> list[str]:
    return ["softmax"] + [m for m in list_methods()
                          if get_method(m).capabilities.causal
                          and not get_method(m).capabilities.exact]


def budget(method: str, m: int) -> dict:
    return {"num_features": m} if "num_features" in get_method(method).option_names() else {}


def train_one(method: str, n: int, args: argparse.Namespace, train: Tensor, held: Tensor
              ) -> dict:
    torch.manual_seed(args.seed)
    model = ByteLM(n, args.dim, args.heads, args.layers, method, budget(method, args.m))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed)
    loss_fn = nn.CrossEntropyLoss()
    rates = []
    for step in range(args.steps):
        start = torch.randint(0, len(train) - n - 1, (args.batch,), generator=data_gen)
        window = torch.stack([train[s: s + n + 1] for s in start.tolist()])
        t0 = time.perf_counter()
        logits = model(window[:, :-1], torch.Generator().manual_seed(step))
        loss = loss_fn(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= args.warmup:
            rates.append(args.batch * n / (time.perf_counter() - t0))
    model.eval()
    losses = []
    with torch.no_grad():
        for s in range(0, len(held) - n - 1, n):
            window = held[s: s + n + 1][None]
            logits = model(window[:, :-1], torch.Generator().manual_seed(0))
            losses.append(float(loss_fn(logits[0], window[0, 1:])))
    return {"method": method, "n": n, "num_features": args.m, "train_loss": loss.item(),
            "heldout_loss": statistics.mean(losses) if losses else float("nan"),
            "heldout_windows": len(losses),
            "tokens_per_s": statistics.median(rates) if rates else float("nan")}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ns = [r["n"] for r in mine]
        axes[0].plot(ns, [r["heldout_loss"] for r in mine], "o-", label=method)
        axes[1].plot(ns, [r["tokens_per_s"] for r in mine], "o-", label=method)
    for ax, label in zip(axes, ("held-out loss (nats/byte)", "training tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context N")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/causal_lm/causal_lm"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.tensor(list(default_text().encode("utf-8")), dtype=torch.long)
    cut = int(0.9 * len(data))
    train, held = data[:cut], data[cut:]
    rows = []
    for n in args.ns:
        for method in args.methods or causal_methods():
            rows.append(train_one(method, n, args, train, held))
            r = rows[-1]
            print(f"N={n:5d} {method:16s} held-out {r['heldout_loss']:.3f} "
                  f"train {r['train_loss']:.3f} {r['tokens_per_s']:9.0f} tok/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": "cpu",
           "train_bytes": len(train), "heldout_bytes": len(held)}
    args.out.with_suffix(".json").write_text(json.dumps(
        {"config": config, "environment": env, "rows": rows}, indent=2))
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out)


if __name__ == "__main__":
    main()
