"""How close each approximation is to exact attention on your own Q/K/V, and what it costs.

    python examples/own_qkv_error.py                    # --quick, on MiniLM-L6's Q/K/V
    python examples/own_qkv_error.py --qkv my_qkv.pt --full --features 64

Save the queries, keys and values of one of your attention layers with
``torch.save({"q": q, "k": k, "v": v}, "my_qkv.pt")`` (or ``torch.save((q, k, v), ...)``,
or NumPy's ``np.savez("my_qkv.npz", q=q, k=k, v=v)``), each ``[B, H, N, D]`` (batch,
heads, sequence, head dim; the values may have another last dimension: a layer's
``[B, N, H, D]`` needs ``.transpose(1, 2)`` first), and pass the file as ``--qkv``. A
padded batch adds its key padding mask, ``[B, Nk]`` bool with True = real token, as
``"mask"`` (or ``"key_padding_mask"``): the padding is then left out of the exact
attention and of every method's, as in the model. Without ``--qkv`` the example saves
the Q/K/V of layer 0 of the pretrained MiniLM-L6 model on the text shipped with
skyformer to a temporary file first (this needs ``pip install 'skyformer[hf]'``), to
show the format.

Each method runs on the whole batch and is compared with the exact attention it
approximates (softmax, or Gaussian kernelized attention for ``skyformer`` and its
variants): the relative spectral-norm error ``||out - exact||_2 / ||exact||_2`` per head,
its mean and spread over every sequence's heads, the relative Frobenius error, the
forward time and (``--full``) the peak memory of a call, measured in a fresh process.
An error above the trivial answer's (every output row the mean of the values, or all
zeros) is marked with ``!``: that method is no better than ignoring the keys on this data.
Heads that NaN or inf in the tensors reach have no error: they are left out of the
means, and each row says how many. ``--json FILE`` writes the rows as strict JSON (a
missing number as ``null``). The same measurement on MiniLM's Q/K/V is
``skyformer compare``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import skyformer
from skyformer.checks import positive_int_argument
from skyformer.eval.compare import CompareConfig, compare_on, format_table
from skyformer.eval.data.qkv import load_qkv_file
from skyformer.io import check_output_path, write_json


def save_minilm_qkv(path: Path, seq_len: int) -> None:
    """Save layer 0 of the pretrained MiniLM-L6 on the shipped text, ``[1, 12, N, 32]``."""
    from skyformer.eval.data.qkv import load_qkv
    from skyformer.eval.data.text import default_text

    qkv = load_qkv(seq_len=seq_len, layer=0, text=default_text())
    torch.save({"q": qkv.q, "k": qkv.k, "v": qkv.v}, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", help="file of torch.save (or .npz) with q, k, v, each "
                                      "[B, H, N, D], and optionally mask [B, Nk] (default: "
                                      "MiniLM-L6's, saved to a temporary file)")
    parser.add_argument("--methods", nargs="+",
                        default=["softmax", "kernelized", "skyformer", "nystrom_softmax",
                                 "nystromformer", "performer", "linear", "reformer"],
                        help="method names or variants 'name[option=value]' "
                             "(skyformer.list_methods())")
    parser.add_argument("--features", type=positive_int_argument,
                        help="num_features of every approximate method (default: quick 32 "
                             "for all of them, but where any method sets num_features in "
                             "brackets each method's own, as full always)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="one timed run, no memory measurement, MiniLM at N=256 (default)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="median of 5 timed runs, peak memory, MiniLM at N=1024")
    parser.add_argument("--seed", type=int, default=0, help="seed of the methods' draws")
    parser.add_argument("--json", help="also write the rows to this JSON file (one there "
                                       "already is replaced)")
    args = parser.parse_args(argv)
    # a variant's own num_features and a --features for all cannot go together
    bracketed = any("num_features" in dict(skyformer.get_method(m).preset)
                    for m in args.methods)
    if args.features is None and args.quick and not bracketed:
        args.features = 32
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    check_output_path(args.json)  # now, not after the measuring
    with tempfile.TemporaryDirectory() as tmp:
        path = args.qkv
        if path is None:
            path = Path(tmp) / "minilm_qkv.pt"
            save_minilm_qkv(path, seq_len=256 if args.quick else 1024)
        saved = load_qkv_file(path, label="--qkv")
    print(saved.describe())
    config = CompareConfig(methods=tuple(args.methods), num_features=args.features,
                           seed=args.seed, repeats=1 if args.quick else 5,
                           memory=not args.quick)
    rows = compare_on(saved[:3], config, key_padding_mask=saved.key_padding_mask)
    print(format_table(rows))
    if args.json:  # strict JSON (NaN as null), written whole or not at all
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    try:
        main()
    except (ValueError, TypeError, OSError, ImportError) as err:  # the sentence, no traceback
        sys.exit(f"own_qkv_error: error: {err}")
