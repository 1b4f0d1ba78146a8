"""How close each approximation is to exact attention on your own Q/K/V, and what it costs.

    python examples/own_qkv_error.py                    # --quick, on MiniLM-L6's Q/K/V
    python examples/own_qkv_error.py --qkv my_qkv.pt --full --features 64

Save the queries, keys and values of one of your attention layers with
``torch.save({"q": q, "k": k, "v": v}, "my_qkv.pt")`` (or ``torch.save((q, k, v), ...)``),
each ``[B, H, N, D]`` (batch, heads, sequence, head dim; the values may have another
last dimension), and pass the file as ``--qkv``. Without it the example saves the Q/K/V of
layer 0 of the pretrained MiniLM-L6 model on the text shipped with skyformer to a
temporary file first (this needs ``pip install 'skyformer[hf]'``), to show the format.

Each method runs on the whole batch and is compared with the exact attention it
approximates (softmax, or Gaussian kernelized attention for ``skyformer`` and its
variants): the relative spectral-norm error ``||out - exact||_2 / ||exact||_2`` per head,
its mean and spread over every sequence's heads, the relative Frobenius error, the
forward time and (``--full``) the peak memory of a call, measured in a fresh process.
An error above the trivial answer's (every output row the mean of the values, or all
zeros) is marked with ``!``: that method is no better than ignoring the keys on this data.
The same measurement on MiniLM's Q/K/V is ``skyformer compare``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import skyformer
from skyformer.eval.compare import CompareConfig, compare_on, format_table

SAVE = "torch.save({'q': q, 'k': k, 'v': v}, path)"


def save_minilm_qkv(path: Path, seq_len: int) -> None:
    """Save layer 0 of the pretrained MiniLM-L6 on the shipped text, ``[1, 12, N, 32]``."""
    from skyformer.eval.data.qkv import load_qkv
    from skyformer.eval.data.text import default_text

    qkv = load_qkv(seq_len=seq_len, layer=0, text=default_text())
    torch.save({"q": qkv.q, "k": qkv.k, "v": qkv.v}, path)


def load_qkv_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` from a file of ``torch.save``: a dict with keys q, k, v, or the three
    tensors in order; anything else is refused in a sentence saying what the file holds."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"--qkv {str(path)!r} is a folder; pass the file that "
                                f"torch.save wrote.")
    if not path.is_file():
        raise FileNotFoundError(f"--qkv {str(path)!r} does not exist; save your tensors "
                                f"first: {SAVE}.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler fails on other files in many ways
        raise ValueError(f"--qkv {str(path)!r} is not a file of torch.save holding tensors "
                         f"({type(err).__name__}: {err}); write it with {SAVE}.") from None
    if isinstance(data, dict) and {"q", "k", "v"} <= set(data):
        data = data["q"], data["k"], data["v"]
    if isinstance(data, (tuple, list)) and len(data) == 3 \
            and all(isinstance(t, torch.Tensor) for t in data):
        return data[0], data[1], data[2]
    held = (f"a dict with keys {sorted(map(str, data))}" if isinstance(data, dict)
            else f"a {type(data).__name__}")
    raise ValueError(f"--qkv {str(path)!r} holds {held}, not the queries, keys and values: "
                     f"save them as {SAVE}, each a tensor [B, H, N, D].")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", help="file of torch.save with q, k, v, each [B, H, N, D] "
                                      "(default: MiniLM-L6's, saved to a temporary file)")
    parser.add_argument("--methods", nargs="+",
                        default=["softmax", "kernelized", "skyformer", "nystrom_softmax",
                                 "nystromformer", "performer", "linear", "reformer"],
                        help="method names or variants 'name[option=value]' "
                             "(skyformer.list_methods())")
    parser.add_argument("--features", type=int,
                        help="num_features of every approximate method (default: quick 32 "
                             "for all of them, but where any method sets num_features in "
                             "brackets each method's own, as full always)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="one timed run, no memory measurement, MiniLM at N=256 (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="median of 5 timed runs, peak memory, MiniLM at N=1024")
    parser.add_argument("--seed", type=int, default=0, help="seed of the methods' draws")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    # a variant's own num_features and a --features for all cannot go together
    bracketed = any("num_features" in dict(skyformer.get_method(m).preset)
                    for m in args.methods)
    if args.features is None and args.quick and not bracketed:
        args.features = 32
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.qkv
        if path is None:
            path = Path(tmp) / "minilm_qkv.pt"
            save_minilm_qkv(path, seq_len=256 if args.quick else 1024)
        q, k, v = load_qkv_file(path)
    print(f"Q {tuple(q.shape)}, K {tuple(k.shape)}, V {tuple(v.shape)}, {q.dtype}")
    config = CompareConfig(methods=tuple(args.methods), num_features=args.features,
                           seed=args.seed, repeats=1 if args.quick else 5,
                           memory=not args.quick)
    rows = compare_on((q, k, v), config)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    try:
        main()
    except (ValueError, TypeError, OSError, ImportError) as err:  # the sentence, no traceback
        sys.exit(f"own_qkv_error: error: {err}")
