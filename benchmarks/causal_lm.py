"""A small byte-level causal language model: exact causal softmax vs each causal approximation.

    python benchmarks/causal_lm.py                      # full run (see docs/causal.md)
    python benchmarks/causal_lm.py --ns 128 --steps 3 --out /tmp/lm   # smoke run

The public-domain text shipped with the package (``skyformer.eval.data.text``; or
``--text FILE``) as bytes: the first 90 % trains, the last 10 % is held out. For each
context length N and each method (``softmax`` exact, then every registered approximate
method with capability ``causal``) the same model (embedding + learned positions,
``--layers`` pre-norm blocks of ``skyformer.nn.MultiHeadAttention(method, causal=True)``
and an MLP, width ``--dim``) is trained from the same initialisation for ``--steps``
AdamW steps on random windows of N + 1 bytes, ``--tokens-per-step`` tokens per step at
every N (batch = tokens / N), at the same budget (``--m`` = num_features for every
method that has it).

Held-out loss (nats per byte): every held-out byte is predicted once, from a window of
N bytes that ends just before it (the context may reach back into the training text;
the targets never were trained on), with the method's random key fixed. It is measured
every ``--eval-every`` steps; the table reports the last value and the best one (the
corpus is small, so long runs overfit). Training tokens/s: median over steps after
``--warmup`` (over all steps when there are no more). Each finished (N, method) row is
written at once, atomically, to ``<out>.{json,csv}``; a rerun with the same
configuration skips the rows already there, one with another is refused (``--fresh``
starts over). The plot
``<out>.png`` is redrawn after every row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script
from torch import Tensor, nn

from skyformer.checks import positive_int_argument
from skyformer.eval.data.text import read_text
from skyformer.io import (
    check_output_path,
    json_ready,
    save_figure,
    write_csv,
    write_json,
)
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


def heldout_windows(data: Tensor, cut: int, n: int) -> list[tuple[Tensor, int]]:
    """(window of N + 1 bytes, number of its last targets to score): blocks of N / 2
    held-out targets, each predicted from the N bytes before it (at least N / 2 context)."""
    block = max(1, n // 2)
    out = []
    for end in range(cut, len(data), block):
        stop = min(end + block, len(data))
        out.append((data[stop - n - 1:stop], stop - end))
    return out


@torch.no_grad()
def heldout_loss(model: ByteLM, windows: list[tuple[Tensor, int]]) -> float:
    """Mean cross-entropy (nats per byte) over every held-out target."""
    model.eval()
    total, count = 0.0, 0
    for window, scored in windows:
        logits = model(window[None, :-1], torch.Generator().manual_seed(0))[0, -scored:]
        total += float(nn.functional.cross_entropy(logits, window[-scored:], reduction="sum"))
        count += scored
    model.train()
    return total / count


def train_one(method: str, n: int, args: argparse.Namespace, data: Tensor, cut: int) -> dict:
    torch.manual_seed(args.seed)
    model = ByteLM(n, args.dim, args.heads, args.layers, method, budget(method, args.m))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed)
    windows = heldout_windows(data, cut, n)
    batch = max(1, args.tokens_per_step // n)
    rates, curve = [], []  # tokens/s of every step; the first --warmup are dropped
    for step in range(1, args.steps + 1):
        start = torch.randint(0, cut - n - 1, (batch,), generator=data_gen)
        window = torch.stack([data[s: s + n + 1] for s in start.tolist()])
        t0 = time.perf_counter()
        logits = model(window[:, :-1], torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        rates.append(batch * n / (time.perf_counter() - t0))
        if step % args.eval_every == 0 or step == args.steps:
            curve.append([step, heldout_loss(model, windows)])
    return {"method": method, "n": n, "num_features": args.m, "batch": batch,
            "train_loss": loss.item(), "heldout_loss": curve[-1][1],
            "best_heldout_loss": min(c[1] for c in curve),
            "best_step": min(curve, key=lambda c: c[1])[0],
            "heldout_bytes": len(data) - cut,
            "tokens_per_s": statistics.median(rates[args.warmup:] or rates),
            "curve": curve}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["n"])
        ns = [r["n"] for r in mine]
        axes[0].plot(ns, [r["best_heldout_loss"] for r in mine], "o-", label=method)
        axes[1].plot(ns, [r["tokens_per_s"] for r in mine], "o-", label=method)
    for ax, label in zip(axes, ("best held-out loss (nats/byte)", "training tokens/s"),
                         strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context N")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=120)


def run_config(args: argparse.Namespace) -> dict:
    """What a row depends on (a rerun reuses rows only when this is unchanged)."""
    keep = ("text", "m", "dim", "heads", "layers", "tokens_per_step", "steps", "warmup",
            "eval_every", "lr", "seed")
    return {k: (None if getattr(args, k) is None else str(getattr(args, k))
                if isinstance(getattr(args, k), Path) else getattr(args, k)) for k in keep}


def load_rows(path: Path, config: dict) -> list[dict]:
    """The rows saved in ``path`` by a run with ``config``; rows of another config are
    refused in a sentence naming the settings that differ (a smoke run replaced the
    committed results without a word), ``--fresh`` replaces them."""
    if not path.is_file():
        return []
    import json

    saved = json.loads(path.read_text())
    # compared as written: a non-finite setting is stored as null
    now, then = json_ready(config), saved.get("config") or {}
    if then == now:
        return saved["rows"]
    differ = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    raise SystemExit(f"{path} holds {len(saved.get('rows', []))} rows of another "
                     f"configuration ({', '.join(differ)} differ): pass --fresh to replace "
                     f"them, or another --out.")


def save(rows: list[dict], config: dict, out: Path, argv: list[str] | None) -> None:
    """``out.{json,csv,png}`` with the config, the environment and the command (``argv``:
    its arguments; None: this process's)."""
    metadata = run_metadata(__file__, argv, config)
    write_json(out.with_suffix(".json"), {**metadata, "rows": rows})
    flat = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    write_csv(out.with_suffix(".csv"), flat, metadata=metadata)
    plot(rows, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=positive_int_argument,
                        nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--text", type=Path, default=None,
                        help="UTF-8 text file (default: the text shipped with the package)")
    parser.add_argument("--m", type=positive_int_argument, default=128)
    parser.add_argument("--dim", type=positive_int_argument, default=128)
    parser.add_argument("--heads", type=positive_int_argument, default=4)
    parser.add_argument("--layers", type=positive_int_argument, default=2)
    parser.add_argument("--tokens-per-step", type=positive_int_argument, default=8192)
    parser.add_argument("--steps", type=positive_int_argument, default=300)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--eval-every", type=positive_int_argument, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int_argument, default=None)
    parser.add_argument("--fresh", action="store_true",
                        help="replace the rows of an earlier run (of any configuration)")
    parser.add_argument("--out", type=Path, default=RESULTS / "causal_lm" / "causal_lm")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_output_path(args.out)
    methods = args.methods or causal_methods()
    for method in methods:
        if not get_method(method).capabilities.causal:
            raise SystemExit(f"{method} cannot attend causally; choose from {causal_methods()}.")
    data = torch.tensor(list(read_text(args.text).encode("utf-8")), dtype=torch.long)
    cut = int(0.9 * len(data))
    if cut <= max(args.ns) + 1:
        raise SystemExit(f"the text has {len(data)} bytes: too short for N = {max(args.ns)} "
                         "(its first 90 % must hold a training window); pass a longer --text.")
    config = run_config(args)
    rows = [] if args.fresh else load_rows(args.out.with_suffix(".json"), config)
    done = {(r["n"], r["method"]) for r in rows}
    for n in args.ns:
        for method in methods:
            if (n, method) in done:
                continue
            rows.append(train_one(method, n, args, data, cut))
            r = rows[-1]
            print(f"N={n:5d} {method:16s} held-out {r['heldout_loss']:.3f} "
                  f"(best {r['best_heldout_loss']:.3f} at {r['best_step']}) "
                  f"train {r['train_loss']:.3f} {r['tokens_per_s']:9.0f} tok/s", flush=True)
            save(rows, config, args.out, argv)
    return rows


if __name__ == "__main__":
    main()
