"""Fused Triton kernels against the PyTorch path and against flash SDPA, on CUDA.

For each shape and N: forward + backward time (median, synchronised; the calls'
repeats interleaved, or with ``--timing blocked`` each call's in a block of its own
after an idle pause of ``--pause`` seconds, ``eval/measure/timing.py``: at N = 32768 the
132 ms of flash SDPA between two Skyformer calls can slow the second) and peak memory
(``torch.cuda.max_memory_allocated`` above the inputs, the gradients of q, k, v
included; none for the CUDA-graph rows, which replay into memory their capture took) of

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the inputs' dtype
  (the flash backend for bfloat16 / float16),
- ``skyformer`` with ``kernel="torch"`` and ``kernel="triton"``,
- ``kernelized`` (exact) with ``kernel="torch"`` (SDPA augmentation) and ``"triton"``,
  and ``kernelized/fold``: ``fold_key_norms=True`` (SDPA's fused kernels at head dim D,
  ``ops/kernelized/sdpa_fold.py``); with a model's padding as an ``attn_mask``
  (``_padding_mask``), up to N = ``--padding-max-n``: ``sdpa+padding`` (SDPA expands
  the mask to a float ``[B, 1, N, N]``, which its peak memory includes),
  ``kernelized/auto+padding`` (the flash kernels, which take it as key padding) and
  ``kernelized/torch+padding`` (the augmentation, where every ``attn_mask`` went before;
  bfloat16 with gradients computed in float32); their ``vs_sdpa`` is against SDPA
  without the mask, like every row's: compare them with ``sdpa+padding``'s,
- ``skyformer/triton+tf32``: the Triton path where PyTorch allows TF32
  (``torch.set_float32_matmul_precision("high")``: the float32 core's dots in one TF32
  pass instead of three; bfloat16 products keep their bf16x3),
- ``skyformer/triton+implicit``: the Triton path with ``pinv_gradient="implicit"`` (the
  core run to Lemma 3's bound, 9 steps at m = 128, and differentiated as an inverse:
  two products backward instead of the steps' adjoints, ``linalg/implicit_inverse.py``),
  and ``+one-pass``: with the products' backward pass in one pass over the rows
  (``linalg/triton_one_pass.py``, off by default), ``+guard``: with the non-finite
  marks made by the guard's own passes instead of in the product kernels (as before
  ``marks_in_products``; ``+guard+cudagraphs`` in a CUDA graph), ``+composable``: the
  eager call composed of its Functions, not as its two hand-chained autograd nodes
  (``ops/skyformer/two_nodes.py``), ``+rows-bf16``: with
  the rows kernel's value products in one bfloat16 pass (``ROWS_ONE_BF16_PASS``, off by
  default; ``+rows-bf16+cudagraphs`` in a CUDA graph),
- at the lengths in ``--compile-seq-lens``: Skyformer (Triton kernels) under
  ``torch.compile`` (Inductor fuses the small ops around the kernels) and under
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs replay the whole call; warm-up
  and capture inside ``skyformer.cuda_graph_launches()``, the launches made for it), with
  ``kernel="triton"`` (the fused Lemma 3 kernels too; in a CUDA graph with the implicit
  gradient as well, ``skyformer/triton+implicit+cudagraphs``, and with the one-pass
  backward pass too, ``+one-pass+cudagraphs``) and ``kernel="auto"``
  (under ``torch.compile``: the PyTorch core, its batched products fused by Inductor),

and the speed of light of each (matmul FLOPs of the method at the matmul rate measured
in the same run, ``skyformer.eval.measure.flops``); then the m x m core alone: the
landmark block and its Lemma 3 inverse by the PyTorch path (about 130 launches forward
+ backward) and by the one-launch Triton kernels (``linalg/triton_lemma3.py``,
``linalg/triton_lemma3_backward.py``), unrolled and implicit, at each shape's B x H, at
64 landmarks (``CORE_LANDMARKS``) and at ``--features``, forward alone and forward +
backward (``--no-core`` leaves it out). ``--calls PATTERN ...`` times only the calls whose
names match (``fnmatch``; ``sdpa``, the ratios' base, always): for a device lent for a
few minutes. A kernel that failed and gave way to its fallback during the run is printed
at the end and listed in the JSON (``fallbacks``): its rows then time the fallback.
``--tiles FILE ...`` launches the kernels with the fastest options that runs of
``lemma3_tiles.py`` / ``product_tiles.py`` recorded there (``tuned.py``: what the library
does once they are its defaults).
Writes JSON to ``--out``. ``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same
script to check it without a GPU, by default at one tiny shape and length and without
the compiled variants: its times mean nothing and it measures no memory.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels.json
"""

from __future__ import annotations

import argparse
import fnmatch
import sys

import torch
import torch.nn.functional as F
import tuned  # benchmarks/, beside this script
from gpu_device import device_problem  # benchmarks/, beside this script
from kernel_flags import composed, one_pass_backward, rows_one_bf16_pass, tf32
from launch_counts import guard_passes  # benchmarks/, beside this script
from run_metadata import run_metadata

import skyformer
from skyformer.checks import positive_int_argument, shape_dtype_argument
from skyformer.eval.measure.timing import (
    TIMINGS,
    blocked_median_seconds,
    interleaved_median_seconds,
)
from skyformer.io import write_json

CORE_LANDMARKS = 64  # the core is timed at this m too, besides --features


def _calls(q, k, v, grad, features, compiled, compile_kernels=("triton", "auto")):
    def run(fn, in_graph=False, one_pass=False, guard=False, rows_bf16=False,
            composable=False, tf32_dots=False):
        def step():  # the gradients dropped after the call, so that the next call's peak
            # counts its own (as skyformer bench does)
            with one_pass_backward(one_pass), guard_passes(guard), \
                    rows_one_bf16_pass(rows_bf16), \
                    composed(composable), tf32(tf32_dots):
                fn().backward(grad)
            for t in (q, k, v):
                t.grad = None

        def step_in_graph():  # warm-up, capture and replay with the graphed options
            with tuned.graphed_options():
                step()
        return step_in_graph if in_graph else step

    key = skyformer.random_key(0, device=q.device)
    padding = _padding_mask(q)

    def compiled_call(kernel, mode=None, gradient="unrolled", one_pass=False, guard=False,
                      rows_bf16=False):
        # bound once, outside the compiled region; "auto" under torch.compile: the Triton
        # products and the PyTorch core (Inductor fuses it), "triton": the fused core too
        bound = skyformer.get_method("skyformer").bind(num_features=features, kernel=kernel,
                                                       pinv_gradient=gradient)

        def sky(q, k, v):
            return bound(q, k, v, generator=key)

        call = torch.compile(sky, fullgraph=True, dynamic=False, mode=mode)
        return run(lambda: call(q, k, v), in_graph=mode is not None, one_pass=one_pass,
                   guard=guard, rows_bf16=rows_bf16)

    extra = {}
    for kernel in compile_kernels if compiled else ():
        extra |= {f"skyformer/{kernel}+compile": compiled_call(kernel),
                  f"skyformer/{kernel}+cudagraphs": compiled_call(kernel, "reduce-overhead")}
    if compiled and "triton" in compile_kernels:
        extra["skyformer/triton+implicit+cudagraphs"] = compiled_call(
            "triton", "reduce-overhead", "implicit")
        extra["skyformer/triton+implicit+one-pass+cudagraphs"] = compiled_call(
            "triton", "reduce-overhead", "implicit", one_pass=True)
        extra["skyformer/triton+implicit+guard+cudagraphs"] = compiled_call(
            "triton", "reduce-overhead", "implicit", guard=True)
        extra["skyformer/triton+implicit+rows-bf16+cudagraphs"] = compiled_call(
            "triton", "reduce-overhead", "implicit", rows_bf16=True)

    return extra | {
        "sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v)),
        "skyformer/torch": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="torch", generator=key)),
        "skyformer/triton": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton", generator=key)),
        "skyformer/triton+tf32": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton", generator=key),
            tf32_dots=True),
        "skyformer/triton+implicit": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton",
            pinv_gradient="implicit", generator=key)),
        "skyformer/triton+implicit+composable": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton",
            pinv_gradient="implicit", generator=key), composable=True),
        "skyformer/triton+implicit+one-pass": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton",
            pinv_gradient="implicit", generator=key), one_pass=True),
        "skyformer/triton+implicit+guard": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton",
            pinv_gradient="implicit", generator=key), guard=True),
        "skyformer/triton+implicit+rows-bf16": run(lambda: skyformer.attention(
            q, k, v, "skyformer", num_features=features, kernel="triton",
            pinv_gradient="implicit", generator=key), rows_bf16=True),
        "kernelized/torch": run(lambda: skyformer.attention(q, k, v, "kernelized",
                                                            kernel="torch")),
        "kernelized/triton": run(lambda: skyformer.attention(q, k, v, "kernelized",
                                                             kernel="triton")),
        "kernelized/fold": run(lambda: skyformer.attention(q, k, v, "kernelized",
                                                           fold_key_norms=True)),
        "sdpa+padding": run(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=padding)),
        "kernelized/auto+padding": run(lambda: skyformer.kernelized_attention(
            q, k, v, attn_mask=padding)),
        "kernelized/torch+padding": run(lambda: skyformer.kernelized_attention(
            q, k, v, kernel="torch", attn_mask=padding)),
    }


def _padding_mask(q) -> torch.Tensor:
    """``[B, 1, N, N]`` bool, a model's padding as ``skyformer.hf`` passes it: one row
    over the keys repeated over the queries by stride 0; the last eighth of the keys of
    every other sequence hidden (at least one key)."""
    b, _, n, _ = q.shape
    row = torch.ones(b, n, dtype=torch.bool, device=q.device)
    row[::2, n - max(1, n // 8):] = False
    return row[:, None, None, :].expand(b, 1, n, n)


def _flops(name: str, q, v, m: int) -> float:
    """Matmul FLOPs of forward + backward (backward = 2x forward): the exact methods
    4 N^2 D per head forward; Skyformer 2 N m (D + Dv) per product, two products."""
    b, h, n, d = q.shape
    dv = v.shape[-1]
    per_head = 2 * (2 * n * m * (d + dv)) if name.startswith("skyformer") \
        else 2 * n * n * (d + dv)
    return 3.0 * per_head * b * h


def _peak(fn, device: str) -> int | None:
    """Peak CUDA memory of one call above what was allocated before, its gradients
    included (each step drops them after its call; None on the CPU)."""
    if device == "cpu":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _matmul_rate(device: str) -> dict[str, float]:
    """Measured FLOP/s of an 8192^3 matmul (256^3 on the CPU) in bfloat16 and in float32
    (TF32 allowed: the tensor-core rate the Triton kernels' tf32x3 dots run at, a third
    of it each)."""
    size = 256 if device == "cpu" else 8192
    rates = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        with _tf32():
            t = interleaved_median_seconds({"mm": lambda a=a: a @ a}, device=device, warmup=3,
                                           repeats=10)["mm"]
        rates[name] = 2 * size**3 / t
    return rates


def _core_rows(batch: int, heads: int, m: int, repeats: int, device: str) -> list[dict]:
    """``landmark_inverse`` (C(X, X) and its Lemma 3 inverse) for float32 landmark rows
    ``[batch, heads, m, 64]``, PyTorch path against the Triton kernels: forward alone,
    and forward + backward."""
    from skyformer.linalg import half_sq_norm, landmark_inverse

    x = (0.15 * torch.randn(batch, heads, m, 64, device=device)).requires_grad_(True)
    grad = torch.randn(batch, heads, m, m, device=device)

    def run(kernel, backward):
        gradient = "implicit" if kernel.endswith("+implicit") else "unrolled"
        kernel = kernel.removesuffix("+implicit")

        def step():
            x.grad = None
            if backward:
                landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel,
                                 gradient=gradient).backward(grad)
            else:
                with torch.no_grad():
                    landmark_inverse(x, half_sq_norm(x), gamma=0.1, kernel=kernel,
                                     gradient=gradient)
        return step

    calls = {f"core/{kernel}/{'fwd+bwd' if backward else 'fwd'}": run(kernel, backward)
             for backward in (False, True) for kernel in ("torch", "triton", "triton+implicit")}
    times = interleaved_median_seconds(calls, device=device, warmup=3, repeats=repeats)
    rows = []
    for name in calls:
        base = name.replace("triton+implicit", "torch").replace("triton", "torch")
        rows.append({"shape": f"{batch},{heads},m={m}", "call": name,
                     "ms": times[name] * 1e3, "vs_torch": times[base] / times[name]})
        print(f"{rows[-1]['shape']:18s} {name:22s} {rows[-1]['ms']:9.3f} ms "
              f"{rows[-1]['vs_torch']:7.2f}x the PyTorch core", flush=True)
    return rows


def peak_text(mib: float | None) -> str:
    return "   memory -" if mib is None else f"{mib:9.1f} MiB"


def _fallbacks() -> list[str]:
    """The kernel families that failed during the run and gave way to their fallback
    (``KernelFallback.failures``), with the devices and dtypes they failed on."""
    from skyformer.linalg import kernel_matmul_triton, lemma3_triton
    from skyformer.ops.kernelized import flash
    from skyformer.sketch import landmarks

    nets = (kernel_matmul_triton.PRODUCT_FALLBACK, kernel_matmul_triton.ONE_PASS_FALLBACK,
            lemma3_triton.CORE_FALLBACK, flash.FLASH_FALLBACK, landmarks.DRAW_FALLBACK)
    return [f"{net.name} on {', '.join(f'{d} {t}' for d, t in sorted(net.failures, key=str))}"
            for net in nets if net.failed]


class _tf32:
    def __enter__(self):
        self.before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=None,
                        type=shape_dtype_argument("B,H,D"),
                        help="B,H,D,dtype (default 4,16,64,bfloat16 1,2,32,float32; on the "
                        "CPU 1,1,16,float32)")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int_argument, default=None,
                        help="default 1024 ... 32768 (on the CPU 64)")
    parser.add_argument("--features", type=positive_int_argument,
                        default=None, help="default 128 (CPU: 16)")
    parser.add_argument("--repeats", type=positive_int_argument, default=5)
    parser.add_argument("--timing", choices=TIMINGS, default="interleaved",
                        help="the calls' repeats in rounds of every call, or each call's "
                        "in a block of its own (module docstring)")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds idle before each call's block (--timing blocked)")
    parser.add_argument("--compile-seq-lens", nargs="*", type=positive_int_argument,
                        default=None,
                        help="lengths at which the compiled variants are timed too (default "
                        "4096; none on the CPU)")
    parser.add_argument("--compile-kernels", nargs="+", default=["triton", "auto"],
                        choices=["triton", "auto"], help="the kernel options compiled")
    parser.add_argument("--max-exact-n", type=int, default=32768,
                        help="longest N for the exact kernelized variants")
    parser.add_argument("--padding-max-n", type=int, default=4096,
                        help="longest N for the calls with a padding mask (+padding)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: check the script at tiny sizes (TRITON_INTERPRET=1)")
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="JSON of lemma3_tiles.py / product_tiles.py: launch the kernels "
                        "with the fastest options they recorded")
    parser.add_argument("--calls", nargs="+", default=None,
                        help="fnmatch patterns of the calls to time (sdpa always)")
    parser.add_argument("--no-core", action="store_true",
                        help="leave out the m x m core timed alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    # refused before the machine's time goes to the matmul rate and the inputs
    if not 0 <= args.pause < float("inf"):
        parser.error(f"argument --pause: must be a finite number of seconds, at least 0, "
                     f"got {args.pause}")
    names = _call_names(args.compile_kernels) if args.calls else set()
    for pattern in args.calls or ():
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            parser.error(f"argument --calls: {pattern!r} matches no call (it would time sdpa "
                         f"alone); the calls: {', '.join(sorted(names))}")
    with tuned.applied(args.tiles):
        return _main(args, argv)


def _call_names(compile_kernels) -> set[str]:
    """The name of every call ``_calls`` can time, compiled variants included (built on a
    tiny CPU tensor: the calls are only defined, not run)."""
    x = torch.zeros(1, 1, 2, 2, requires_grad=True)
    return set(_calls(x, x, x, x, 2, True, compile_kernels))


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    device = args.device
    problem = device_problem("gpu_kernels.py", device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    on_gpu = device == "cuda"
    if args.features is None:
        args.features = 128 if on_gpu else 16
    if args.shapes is None:
        args.shapes = ["4,16,64,bfloat16", "1,2,32,float32"] if on_gpu else ["1,1,16,float32"]
    if args.seq_lens is None:
        args.seq_lens = [1024, 2048, 4096, 8192, 16384, 32768] if on_gpu else [64]
    if args.compile_seq_lens is None:
        args.compile_seq_lens = [4096] if on_gpu else []
    torch._dynamo.config.cache_size_limit = 64
    rate = _matmul_rate(device)
    print(f"bf16 matmul {rate['bfloat16'] / 1e12:.0f} TFLOP/s, tf32 "
          f"{rate['float32'] / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for spec in args.shapes:
        b, h, d, dtype_name = spec.split(",")
        dtype = getattr(torch, dtype_name)
        for n in args.seq_lens:
            g = torch.Generator(device=device).manual_seed(n)
            q, k, v, grad = (torch.randn(int(b), int(h), n, int(d), device=device, generator=g)
                             .to(dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            calls = _calls(q, k, v, grad, args.features, n in args.compile_seq_lens,
                           args.compile_kernels)
            if n > args.max_exact_n:
                calls = {name: fn for name, fn in calls.items() if "kernelized" not in name}
            if n > args.padding_max_n:
                calls = {name: fn for name, fn in calls.items() if "+padding" not in name}
            if args.calls:
                calls = {name: fn for name, fn in calls.items() if name == "sdpa"
                         or any(fnmatch.fnmatchcase(name, p) for p in args.calls)}
            if args.timing == "blocked":
                times = blocked_median_seconds(calls, device=device, warmup=2,
                                               repeats=args.repeats, pause=args.pause)
            else:
                times = interleaved_median_seconds(calls, device=device, warmup=2,
                                                   repeats=args.repeats)
            for name, fn in calls.items():
                # a graph replays into memory its capture took: a replay's peak is not
                # the call's
                peak = None if name.endswith("+cudagraphs") else _peak(fn, device)
                row = {"shape": spec, "n": n, "call": name, "ms": times[name] * 1e3,
                       "peak_mib": None if peak is None else peak / 2**20,
                       "vs_sdpa": times["sdpa"] / times[name], "flops": _flops(name, q, v,
                                                                              args.features)}
                row["speed_of_light"] = row["flops"] / (times[name] * rate[
                    "bfloat16" if dtype != torch.float32 or name.split("+")[0] == "sdpa"
                    else "float32"])
                rows.append(row)
                print(f"{spec:18s} N={n:6d} {name:18s} {row['ms']:9.3f} ms "
                      f"{row['vs_sdpa']:7.2f}x sdpa  {peak_text(row['peak_mib'])}  "
                      f"SoL {100 * row['speed_of_light']:5.1f} %", flush=True)
            if args.out:  # the rows so far: a run cut by a time limit keeps them
                write_json(args.out, _result(args, argv, rate, rows, [], False), indent=1)
    core = []
    for spec in [] if args.no_core else args.shapes:
        b, h, _, _ = spec.split(",")
        for m in sorted({CORE_LANDMARKS, args.features}):
            core += _core_rows(int(b), int(h), m, args.repeats, device)
    result = _result(args, argv, rate, rows, core, True)
    for fallback in result["fallbacks"]:
        print(f"FALLBACK: {fallback}: the rows timed after it failed timed its fallback",
              flush=True)
    if args.out:
        write_json(args.out, result, indent=1)
    return 0


def _result(args: argparse.Namespace, argv: list[str] | None, rate: dict, rows: list,
            core: list, complete: bool) -> dict:
    """The result file: ``complete`` false while rows are still to come."""
    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (script check)"
    return {"device": name, **run_metadata(__file__, argv, vars(args), device),
            "torch": torch.__version__, "features": args.features, "tiles": args.tiles,
            "matmul_flops_per_s": rate, "complete": complete, "rows": rows,
            "core": core, "fallbacks": _fallbacks()}


if __name__ == "__main__":
    sys.exit(main())
