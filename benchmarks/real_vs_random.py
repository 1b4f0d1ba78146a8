"""Time on real Q/K/V against time on random ones of the same shape (CPU).

    python benchmarks/real_vs_random.py [--seq-lens 512 2048 4096] [--methods ...]

(a method name, or NAME:causal for its causal form)

Far landmarks give Gaussian kernel entries that underflow to subnormal numbers, and
CPU arithmetic on subnormals is one to two orders of magnitude slower; random inputs
never produce them, so a benchmark on random inputs alone hides the slowdown. This
script times each method's forward + backward on pretrained MiniLM-L6 Q/K/V (layer 0,
12 heads, the default text) and on standard normal tensors of the same shape, in one
run, and prints the ratio: about 1 means the method runs as fast on real data.
Writes ``benchmarks/results/real_vs_random.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from run_metadata import run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.eval.data.qkv import extract_qkv, load_model
from skyformer.eval.data.text import default_text
from skyformer.io import atomic_write_text, write_json
from skyformer.registry import get_method

RESULTS = Path(__file__).parent / "results"
METHODS = ["skyformer", "skyformer:causal", "nystrom_softmax", "nystrom_softmax:causal",
           "skyformer_adaptive", "nystromformer"]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step(method: str, inputs: tuple[torch.Tensor, ...], m: int):
    name, _, variant = method.partition(":")
    attend = get_method(name).bind(seq_len=inputs[0].shape[2], num_features=m,
                                   **({"causal": True} if variant == "causal" else {}))
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]

    def run() -> None:
        out = attend(*leaves, generator=torch.Generator().manual_seed(0))
        out.sum().backward()
        for t in leaves:  # each call makes its own gradients, not adds to the last
            t.grad = None

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=positive_int_argument,
                        nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    parser.add_argument("--threads", type=positive_int_argument, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "real_vs_random")
    args = parser.parse_args(argv)
    for method in args.methods:  # before the model loads and any row is timed
        name, colon, form = method.partition(":")
        if colon and form != "causal":
            parser.error(f"--methods: {method!r}: the one form after ':' is 'causal' "
                         f"(e.g. skyformer:causal).")
        try:
            get_method(name)
        except ValueError as err:
            parser.error(f"--methods: {err}")
    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(None, pretrained=True, seed=0)
    rows = []
    for n in args.seq_lens:
        qkv = extract_qkv(model, tokenizer, default_text(), seq_len=n, layer=0, name=name)
        real = (qkv.q, qkv.k, qkv.v)
        g = torch.Generator().manual_seed(0)
        random = tuple(torch.randn(t.shape, generator=g) for t in real)
        for method in args.methods:
            ms = {label: median_ms(step(method, inputs, args.features), args.repeats)
                  for label, inputs in (("real", real), ("random", random))}
            rows.append({"N": n, "method": method, "real_ms": ms["real"],
                         "random_ms": ms["random"], "ratio": ms["real"] / ms["random"]})
            print(f"N={n:<6} {method:<24} real {ms['real']:8.1f} ms   random "
                  f"{ms['random']:8.1f} ms   ratio {ms['real'] / ms['random']:.2f}", flush=True)
    write_json(args.out.with_suffix(".json"),
               {**run_metadata(__file__, argv, vars(args)), "rows": rows})
    lines = ["| N | method | MiniLM ms | random ms | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['method']} | {r['real_ms']:.1f} | {r['random_ms']:.1f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
