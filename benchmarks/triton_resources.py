"""What the GPU compiler makes of the Triton kernels, read without a GPU.

Registers per thread, stack frame bytes (spilled registers), shared memory, the
resulting occupancy, and the tensor-core (MMA), exponential (MUFU.EX2) and spill
(STL / LDL) instructions of each Triton kernel that Skyformer and exact kernelized
attention launch, compiled ahead of time for a GPU architecture (default sm_90, the
H100) by Triton's own ``ptxas`` and read back with ``cuobjdump``. Nothing runs on a
GPU: these are properties of the compiled code (a spill or a low occupancy shows up
here before a device measures it), not times.

Two steps: the calls run once on the CPU under Triton's interpreter at a small N and
record every kernel launch (kernel, argument dtypes, compile-time constants, warps:
exactly what the library chooses for the shape on the target, whose compute
capability stands in for the device's, ``triton_kernels.device_capability``); each
distinct launch is then compiled for the target. Head dim, dtype, number of landmarks
and method come from the options; N only enters as a runtime argument.

    python benchmarks/triton_resources.py --out benchmarks/results/triton_resources
        [--pinv-gradient implicit] [--one-pass-backward] [--matmul-precision high]
        [--graph-launches] [--only TEXT ...]

``--only``: compile only the launches whose label (the table's kernel column) contains
one of the texts, e.g. ``--only has_vn`` for the rows kernel's gradient launches.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD_ENV = "SKYFORMER_RECORD_LAUNCHES"
DTYPE_CODES = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16",
               "uint8": "u8", "int8": "i8", "int32": "i32", "int64": "i64", "bool": "u8"}
# Limits of the architectures (CUDA occupancy tables): registers, threads and shared
# memory in bytes per SM, the register allocation granularity (per warp), the most
# shared memory one block may have ("block_shared", the opt-in maximum: a kernel that
# needs more cannot launch) and what the driver reserves per block ("reserved").
_LIMIT_FIELDS = ("registers", "threads", "shared", "granularity", "block_shared", "reserved")
SM_LIMITS = {arch: dict(zip(_LIMIT_FIELDS, values, strict=True)) for arch, values in {
    75: (65536, 1024, 65536, 256, 65536, 0),
    80: (65536, 2048, 167936, 256, 166912, 1024),
    86: (65536, 1536, 102400, 256, 101376, 1024),
    89: (65536, 1536, 102400, 256, 101376, 1024),
    90: (65536, 2048, 233472, 256, 232448, 1024),
    100: (65536, 2048, 233472, 256, 232448, 1024),
    120: (65536, 1536, 102400, 256, 101376, 1024),
}.items()}


# --------------------------------------------------------------------------------------
# Step 1 (a child process with TRITON_INTERPRET=1): run the calls, record the launches.

def _record_launches(spec: dict) -> list[dict]:
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import skyformer

    if not hasattr(InterpretedFunction, "run"):
        raise SystemExit("triton_resources.py records launches through the interpreter of "
                         "Triton 3.5 or later (InterpretedFunction.run); this Triton has none.")
    launches: list[dict] = []
    original_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = list(inspect.signature(self.fn).parameters)
        arguments, constants = {}, {}
        for name, value in zip(names, args, strict=False):
            if isinstance(value, torch.Tensor):
                arguments[name] = {"pointer": DTYPE_CODES[str(value.dtype).split(".")[-1]],
                                   "aligned": value.data_ptr() % 16 == 0}
            elif isinstance(value, bool):
                constants[name] = value
            elif isinstance(value, int):
                arguments[name] = {"int": value}
            elif isinstance(value, float):
                arguments[name] = {"float": value}
            else:
                constants[name] = value
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        constants.update(kwargs)
        launches.append({"module": self.fn.__module__, "kernel": self.fn.__name__,
                         "names": names, "arguments": arguments, "constants": constants,
                         "options": options})
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    # the tiles and precision the library would choose on the target GPU
    from skyformer.linalg import triton_kernels

    arch = spec.get("arch", 90)
    triton_kernels.device_capability = lambda device: (arch // 10, arch % 10)
    torch.set_float32_matmul_precision(spec.get("matmul_precision", "highest"))
    if spec.get("one_pass_backward"):
        from skyformer.linalg import kernel_matmul_triton

        kernel_matmul_triton.ONE_PASS_BACKWARD = True
    triton_kernels.ROWS_ONE_BF16_PASS = bool(spec.get("rows_one_bf16_pass"))
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(0)
    shape = (1, 2, spec["n"], spec["head_dim"])
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
               for _ in range(3))
    mask = torch.ones(1, spec["n"], dtype=torch.bool)
    mask[0, -7:] = False
    options = {"kernel": "triton"}
    if spec["method"] != "kernelized":
        options["num_features"] = spec["features"]
    if "pinv_gradient" in skyformer.get_method(spec["method"]).option_names():
        options["pinv_gradient"] = spec["pinv_gradient"]
    graphed = skyformer.cuda_graph_launches() if spec.get("graph_launches") \
        else contextlib.nullcontext()
    with graphed:  # the launches a CUDA graph would hold (a launch per pass)
        out = skyformer.attention(q, k, v, spec["method"], key_padding_mask=mask,
                                  generator=skyformer.random_key(0), **options)
        out.float().square().sum().backward()
    InterpretedFunction.run = original_run
    return launches


# --------------------------------------------------------------------------------------
# Step 2: compile each distinct launch for the target and read the cubin.

def _launch_key(launch: dict) -> str:
    return json.dumps({k: launch[k] for k in ("module", "kernel", "constants", "options")}
                      | {"types": {n: a.get("pointer", "i" if "int" in a else "f")
                                   for n, a in launch["arguments"].items()}}, sort_keys=True)


def _source(launch: dict):
    import importlib

    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(launch["names"]):
        if name in launch["constants"]:
            signature[name] = "constexpr"
            constexprs[(index,)] = launch["constants"][name]
            continue
        argument = launch["arguments"][name]
        if "pointer" in argument:
            signature[name] = "*" + argument["pointer"]
            if argument["aligned"]:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif "int" in argument:
            value = argument["int"]
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _cubin_facts(cubin: bytes, tools: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]

    def count(pattern: str) -> int:
        return sum(1 for line in lines if re.search(pattern, line))

    return {"registers": int(fields.get("REG", 0)), "stack": int(fields.get("STACK", 0)),
            "local": int(fields.get("LOCAL", 0)), "shared_static": int(fields.get("SHARED", 0)),
            "instructions": len(lines), "mma": count(r"\b(HMMA|HGMMA|DMMA|IMMA)\b"),
            "exp2": count(r"MUFU\.EX2"), "spill_stores": count(r"\bSTL\b"),
            "spill_loads": count(r"\bLDL\b")}


def _occupancy(registers: int, shared: int, warps: int, arch: int) -> dict:
    """Resident warps per SM as the register file and shared memory allow, with the
    shared memory the driver reserves per block; 0 where the kernel needs more shared
    memory than one block may have (it cannot launch)."""
    limits = SM_LIMITS.get(arch, SM_LIMITS[90])
    per_warp = -(-registers * 32 // limits["granularity"]) * limits["granularity"]
    by_registers = limits["registers"] // max(1, per_warp * warps)
    if shared > limits["block_shared"]:
        return {"blocks_per_sm": 0, "warps_per_sm": 0, "occupancy": 0.0}
    by_shared = limits["shared"] // (shared + limits["reserved"]) if shared else 10**9
    by_threads = limits["threads"] // (32 * warps)
    blocks = min(by_registers, by_shared, by_threads)
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps * 32 / limits["threads"]}


def compile_launch(launch: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": 4, "num_stages": 3} | launch["options"]
    constants = {name: value.removesuffix("-interpreted") if isinstance(value, str)
                 else value for name, value in launch["constants"].items()}
    launch = launch | {"constants": constants}  # what CUDA takes
    compiled = triton.compile(_source(launch), target=GPUTarget("cuda", arch, 32),
                              options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    facts = _cubin_facts(compiled.asm["cubin"], tools)
    shared = int(getattr(compiled.metadata, "shared", 0))
    facts |= {"shared": shared, "num_warps": options["num_warps"]}
    facts |= _occupancy(facts["registers"], shared, options["num_warps"], arch)
    return facts


def _label(launch: dict) -> str:
    c = launch["constants"]
    flags = [name.lower() for name, value in c.items()
             if value is True and name not in ("HAS_A", "HAS_B")]
    tiles = "x".join(str(c[n]) for n in ("BLOCK_N", "BLOCK_M", "BLOCK", "BLOCK_D", "BLOCK_R",
                                         "BLOCK_DV") if n in c)
    types = "/".join(sorted({a["pointer"] for a in launch["arguments"].values()
                             if "pointer" in a and a["pointer"] in ("fp32", "bf16", "fp16",
                                                                     "fp64")}))
    precision = c.get("PRECISION", "").replace("-interpreted", "")
    values = c.get("VALUE_PRECISION", "").replace("-interpreted", "")
    if values and values != precision:  # the value products' own (ROWS_ONE_BF16_PASS)
        precision = f"{precision}/{values}"
    if "PASS" in c:  # a kernel launched once a pass (the Lemma 3 chain): which one
        flags.append(f"pass {c['PASS']} rows {c['ROWS']}")
    return f"{launch['kernel']} [{types}; {tiles}; {precision}; {' '.join(flags)}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--methods", nargs="+", default=["skyformer", "kernelized"])
    parser.add_argument("--configs", nargs="+", default=["64:bfloat16", "32:float32"],
                        help="head_dim:dtype pairs (default: the model and LRA shapes)")
    parser.add_argument("--features", type=int, nargs="+", default=[128, 64],
                        help="numbers of landmarks m")
    parser.add_argument("--n", type=int, default=256, help="N of the recording run")
    parser.add_argument("--pinv-gradient", default="unrolled",
                        choices=["unrolled", "implicit"],
                        help="pinv_gradient of the methods that have it")
    parser.add_argument("--one-pass-backward", action="store_true",
                        help="the products' backward pass in one pass over the rows "
                             "(kernel_matmul_triton.ONE_PASS_BACKWARD)")
    parser.add_argument("--rows-one-bf16-pass", action="store_true",
                        help="the rows kernel's value products in one bfloat16 pass for "
                             "half-type rows (triton_kernels.ROWS_ONE_BF16_PASS)")
    parser.add_argument("--graph-launches", action="store_true",
                        help="record the launches made for CUDA graphs "
                             "(inside skyformer.cuda_graph_launches(): a launch per pass)")
    parser.add_argument("--matmul-precision", default="highest",
                        choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision of the recording run "
                             "(high, medium: one TF32 pass where float32 dots take three)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="compile only the launches whose label contains one of these")
    parser.add_argument("--out", type=Path, default=None,
                        help="write OUT.json and OUT.md (atomically)")
    args = parser.parse_args(argv)
    if os.environ.get(RECORD_ENV):  # the child: record and print the launches
        print(json.dumps(_record_launches(json.loads(os.environ[RECORD_ENV]))))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # compiling needs Triton's JIT functions, which the interpreter replaces
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]] if argv is None
                              else [sys.executable, __file__, *argv], env=env).returncode
    import triton

    rows, seen = [], {}
    combos = [(method, config, m) for method in args.methods for config in args.configs
              for m in (args.features if method != "kernelized" else args.features[:1])]
    for method, config, m in combos:
        head_dim, dtype = config.split(":")
        spec = {"method": method, "head_dim": int(head_dim), "dtype": dtype,
                "features": m, "n": args.n, "arch": args.arch, "pinv_gradient": args.pinv_gradient,
                "one_pass_backward": args.one_pass_backward,
                "rows_one_bf16_pass": args.rows_one_bf16_pass,
                "graph_launches": args.graph_launches,
                "matmul_precision": args.matmul_precision}
        env = os.environ | {RECORD_ENV: json.dumps(spec), "TRITON_INTERPRET": "1"}
        child = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                               text=True, check=False)
        if child.returncode != 0:
            print(child.stderr[-2000:], file=sys.stderr)
            return 1
        launches = json.loads(child.stdout.strip().splitlines()[-1])
        for launch in launches:
            if args.only and not any(text in _label(launch) for text in args.only):
                continue
            key = _launch_key(launch)
            if key not in seen:
                seen[key] = compile_launch(launch, args.arch)
            rows.append({"method": method, "m": m if method != "kernelized" else "-",
                         "head_dim": int(head_dim), "dtype": dtype,
                         "kernel": _label(launch), "key": key} | seen[key])
    unique = []
    for row in rows:  # one line per (method, config, distinct compiled kernel)
        match = next((u for u in unique if all(u[k] == row[k] for k in
                                                ("method", "m", "head_dim", "dtype",
                                                 "key"))),
                     None)
        if match:
            match["launches"] += 1
        else:
            unique.append(row | {"launches": 1})
    for row in unique:
        del row["key"]
    precision = ("" if args.matmul_precision == "highest"
                 else f", matmul precision {args.matmul_precision}")
    header = (f"Triton {triton.__version__}, sm_{args.arch}, forward + backward of each "
              f"method with kernel=\"triton\", pinv_gradient={args.pinv_gradient}"
              f"{', the one-pass backward' if args.one_pass_backward else ''}"
              f"{', the rows kernel in one bfloat16 pass' if args.rows_one_bf16_pass else ''}"
              f"{', launches made for CUDA graphs' if args.graph_launches else ''}"
              f"{precision}; "
              "registers per thread, stack frame bytes a "
              "thread (where spilled registers go), spill stores / loads, MMA and EX2 "
              "instructions in the compiled code (static counts of loop bodies: compare "
              "them only between equal tiles), "
              "shared memory, resident warps per SM (0: the kernel cannot launch)")
    table = [header, "",
             "| method | m | D | dtype | kernel | launches | warps | regs | stack B | STL/LDL "
             "| MMA | EX2 | shared KiB | warps/SM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for u in unique:
        table.append(
            f"| {u['method']} | {u['m']} | {u['head_dim']} | {u['dtype']} | {u['kernel']} | "
            f"{u['launches']} | {u['num_warps']} | {u['registers']} | {u['stack']} | "
            f"{u['spill_stores']}/{u['spill_loads']} | {u['mma']} | {u['exp2']} | "
            f"{u['shared'] / 1024:.1f} | {u['warps_per_sm']} |")
    text = "\n".join(table)
    print(text)
    if args.out is not None:
        from run_metadata import run_metadata  # imports torch: only where it writes

        from skyformer.io import atomic_write_text, write_json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out.with_suffix(".json"),
                   {**run_metadata(__file__, argv, vars(args)), "triton": triton.__version__,
                    "arch": args.arch, "pinv_gradient": args.pinv_gradient,
                    "one_pass_backward": args.one_pass_backward,
                    "rows_one_bf16_pass": args.rows_one_bf16_pass,
                    "graph_launches": args.graph_launches,
                    "matmul_precision": args.matmul_precision, "rows": unique}, indent=1)
        atomic_write_text(args.out.with_suffix(".md"), text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
