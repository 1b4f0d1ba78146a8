"""Training steps/s and peak memory of the LRA model at the paper's configurations.

The Skyformer paper's Table 2 reports training time and peak memory on ListOps
(batch 32, N = 2000) and Image (batch 256, N = 1024) for a 2-layer model (dim 64,
hidden 128, 2 heads), 128 features per method. This script times full training
steps (forward, backward, AdamW) of the same model (``skyformer.lra.model``) on
random tokens of each task's vocabulary, under bfloat16 autocast on CUDA (or the
``--precision`` given), and prints each method's time and memory relative to
softmax next to the paper's ratios (V100, fp32, hours for 50k steps).

    python benchmarks/lra_gpu.py --out benchmarks/results/lra_gpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from run_metadata import run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.io import write_json
from skyformer.lra.model import LRAClassifier, ModelConfig

# Skyformer paper, Table 2: (time h, memory GB) per method for LO and IC.
PAPER = {
    "listops": {"softmax": (2.24, 5.37), "kernelized": (1.99, 5.94),
                "nystromformer": (0.71, 1.37), "performer": (0.73, 1.09),
                "skyformer": (1.29, 1.75)},
    "image": {"softmax": (4.22, 11.47), "kernelized": (4.05, 6.38),
              "nystromformer": (2.70, 6.71), "performer": (2.55, 4.39),
              "skyformer": (3.40, 8.26)},
}
TASKS = {"listops": {"batch": 32, "n": 2000, "vocab": 20, "classes": 10},
         "image": {"batch": 256, "n": 1024, "vocab": 256, "classes": 10}}


def _step_fn(method: str, task: dict, device: torch.device, dtype: torch.dtype | None):
    options = {} if method in ("softmax", "kernelized") else {"num_features": 128}
    model = LRAClassifier(ModelConfig(
        vocab_size=task["vocab"], num_classes=task["classes"], max_len=task["n"],
        attention=method, attention_options=options)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, task["vocab"], (task["batch"], 1, task["n"]), device=device,
                           generator=g)
    lengths = torch.full((task["batch"], 1), task["n"], device=device)
    labels = torch.randint(0, task["classes"], (task["batch"],), device=device, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(tokens, lengths), labels)
        loss.backward()
        opt.step()
    return step


def measure(method: str, task: dict, device: torch.device, dtype: torch.dtype | None,
            steps: int) -> tuple[float, float]:
    """(seconds per step, median of ``steps``; peak bytes of one step)."""
    step = _step_fn(method, task, device, dtype)
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(torch.cuda.max_memory_allocated(device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(PAPER["listops"]))
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=positive_int_argument, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if "softmax" not in args.methods:  # every ratio, measured and the paper's, is to it
        parser.error("the ratios are to softmax: include softmax in --methods.")
    if not torch.cuda.is_available():
        print("lra_gpu.py needs a CUDA device.", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    rows = []
    for name in args.tasks:
        task = TASKS[name]
        results = {}
        for method in args.methods:
            seconds, peak = measure(method, task, device, dtype, args.steps)
            results[method] = (seconds, peak)
            torch.cuda.empty_cache()
        base_t, base_m = results["softmax"]
        paper = PAPER[name]
        print(f"\n{name}: batch {task['batch']}, N = {task['n']}, {args.precision}, "
              f"{torch.cuda.get_device_name()}")
        print(f"{'method':14s} {'steps/s':>8s} {'peak GiB':>9s} {'time/softmax':>13s} "
              f"{'paper':>6s} {'mem/softmax':>12s} {'paper':>6s}")
        for method, (seconds, peak) in results.items():
            p = paper.get(method)
            row = {"task": name, "method": method, "steps_per_s": 1 / seconds,
                   "peak_gib": peak / 2**30, "time_ratio": seconds / base_t,
                   "memory_ratio": peak / base_m,
                   "paper_time_ratio": None if p is None else p[0] / paper["softmax"][0],
                   "paper_memory_ratio": None if p is None else p[1] / paper["softmax"][1]}
            rows.append(row)
            paper_t = "" if p is None else f"{row['paper_time_ratio']:.2f}"
            paper_m = "" if p is None else f"{row['paper_memory_ratio']:.2f}"
            print(f"{method:14s} {row['steps_per_s']:8.2f} {row['peak_gib']:9.2f} "
                  f"{row['time_ratio']:13.2f} {paper_t:>6s} {row['memory_ratio']:12.2f} "
                  f"{paper_m:>6s}", flush=True)
    if args.out:
        write_json(args.out, {**run_metadata(__file__, argv, vars(args), device),
                              "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
