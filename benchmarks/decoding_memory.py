"""Decoding memory against the generated length: ``skyformer.hf.DecodingCache`` vs
transformers' key/value cache.

    python benchmarks/decoding_memory.py [--lengths 1024 8192] [--prompt 64] [--m 128]

A GPT-2-shaped decoder built from a config (4 layers, width 256, 4 heads, random
weights: memory does not depend on them) generates greedily from one prompt of
``--prompt`` tokens; after 1k and 8k generated tokens the bytes every layer's cache
holds are read (``DecodingCache.nbytes``; for exact attention the keys and values kept,
which is what transformers' DynamicCache holds). Writes
``benchmarks/results/decoding_memory.{json,md}``. Bytes, not timings: runs anywhere
(the tokens/s column is informative only, from the same run).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from run_metadata import RESULTS, run_metadata  # benchmarks/, beside this script

import skyformer.hf as shf
from skyformer.checks import positive_int_argument
from skyformer.io import atomic_write_text, write_json

METHODS = {
    "softmax (key/value cache)": ("softmax", {}),
    "skyformer": ("skyformer", {"num_features": None}),
    "nystrom_softmax": ("nystrom_softmax", {"num_features": None}),
    "performer": ("performer", {"num_features": None}),
    "linear": ("linear", {}),
}


def build(max_len: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=256, n_positions=max_len,
                        bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "skyformer"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


@torch.no_grad()
def measure(lengths: list[int], prompt: int, m: int) -> list[dict]:
    model = build(prompt + max(lengths))
    ids = torch.randint(2, 256, (1, prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    for label, (method, options) in METHODS.items():
        options = {k: (m if v is None else v) for k, v in options.items()}
        shf.set_attention(model, method, seed=0, **options)
        for new in lengths:
            cache = shf.DecodingCache(model)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, cache=cache)
            seconds = time.perf_counter() - start
            rows.append({"method": label, "generated": new, "cache_bytes": cache.nbytes(),
                         "tokens_per_s": new / seconds, **options})
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict], lengths: list[int]) -> str:
    head = " | ".join(f"cache after {n} tokens" for n in lengths)
    lines = [f"| method | {head} | growth | tokens/s at {lengths[-1]} |",
             "|---|" + "---|" * (len(lengths) + 2)]
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = {r["generated"]: r for r in rows if r["method"] == label}
        sizes = [mine[n]["cache_bytes"] for n in lengths]
        cells = " | ".join(f"{s / 2**20:.2f} MiB" for s in sizes)
        lines.append(f"| {label} | {cells} | {sizes[-1] / sizes[0]:.2f}x | "
                     f"{mine[lengths[-1]]['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_int_argument, nargs="+", default=[1024, 8192])
    parser.add_argument("--prompt", type=positive_int_argument, default=64)
    parser.add_argument("--m", type=positive_int_argument,
                        default=128, help="num_features of the approximations")
    parser.add_argument("--threads", type=positive_int_argument, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.lengths, args.prompt, args.m)
    write_json(args.out / "decoding_memory.json",
               {**run_metadata(__file__, argv, vars(args)), "rows": rows})
    atomic_write_text(args.out / "decoding_memory.md", table(rows, args.lengths))
    print(table(rows, args.lengths))


if __name__ == "__main__":
    main()
