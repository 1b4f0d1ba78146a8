"""Peak memory of one attention call, or of any call (``CallJob``, e.g. a model's forward).

CUDA: ``torch.cuda.max_memory_allocated`` around the call, in process.
CPU: the call runs in a fresh Python process (so nothing cached by earlier work hides
its peak): after one warm-up call the kernel's peak-RSS counter is reset through
``/proc/self/clear_refs`` and the measured call's peak is VmHWM minus the resident
size just before it. Run as ``python -m skyformer.eval.measure.memory '<job json>'``.

What is measured is the peak above the inputs (and, for a ``MemoryJob`` with
``backward``, above the output gradient too, allocated by the warm-up call): what the
call itself adds, as ``bench`` times it. (Before, the gradient was allocated inside
the measured call: result files written then include one output-sized buffer in their
backward peaks.)

That process runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB: every
tensor buffer of 64 KiB or more is then its own mapping, returned to the system when
freed, so resident size follows live tensors. (By default the threshold grows after
each freed mapping, up to 32 MiB, and later buffers come from a heap that keeps freed
memory resident: the same job measured 30 or 57 MiB from one run to the next.)

The kernel's resident-size counters are kept per thread and folded in batches, so a
CPU peak is good to a few hundred KiB: a 96 KiB buffer measured 728 KiB, a 256 KiB one
132 KiB. Below ``CPU_RESOLUTION_BYTES`` a CPU peak says only "small"; ratios between
such peaks are not taken (``bench``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...registry import get_method
from ..methods import call_shape, resolve

CPU_RESOLUTION_BYTES = 1 << 20  # CPU peaks below this are noise (module docstring)


def above_resolution(peak_bytes: int | None, device: str) -> bool:
    """Whether a peak measured on ``device`` is above the measurement's resolution."""
    return peak_bytes is not None and (
        torch.device(device).type == "cuda" or peak_bytes >= CPU_RESOLUTION_BYTES)


@dataclass(frozen=True)
class MemoryJob:
    """One attention call to measure: random inputs of ``shape`` or tensors from a file."""

    method: str  # a registered name, or "package.module:function" (see ``methods.resolve``)
    shape: tuple[int, int, int, int]  # [B, H, N, D]
    options: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0
    backward: bool = False
    # a file written by torch.save({"q", "k", "v"}), with "key_padding_mask" where the
    # call takes one
    inputs: str | None = None
    as_layer: bool = False  # with the per-layer state a layer owns (``NamedAttention.prepare``)


@dataclass(frozen=True)
class CallJob:
    """Any call to measure: ``setup(**kwargs)`` (an importable ``"package.module:function"``)
    builds what the call needs outside the measurement (e.g. loads a model) and returns
    the zero-argument callable whose peak memory is measured."""

    setup: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    methods: tuple[str, ...] = ()  # the attention methods it runs (their plugins imported)


def available_bytes(device: torch.device | str = "cpu") -> float:
    """Memory a run may use on ``device``: most of what is free now (inf where unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return 0.9 * torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return 0.8 * int(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf


def _resolve(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _inputs(job: MemoryJob, device: torch.device
            ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """q, k, v (requiring grad for a backward job) and the key padding mask (or None)."""
    mask = None
    if job.inputs is not None:
        data = torch.load(job.inputs, map_location=device, weights_only=True)
        tensors = (data["q"], data["k"], data["v"])
        mask = data.get("key_padding_mask")
    else:
        g = torch.Generator(device=device).manual_seed(job.seed)
        dtype = getattr(torch, job.dtype)
        tensors = tuple(
            torch.randn(job.shape, generator=g, device=device, dtype=dtype) for _ in range(3)
        )
    return tuple(t.detach().requires_grad_(job.backward) for t in tensors), mask


class _AttentionCall:
    """One call of ``job``'s method, and its backward pass with ``job.backward``.

    The output gradient is allocated by the first call (the warm-up, which tells the
    output's shape) and kept, as the generator is: the measured call's peak is then
    above the inputs and the output gradient, as ``bench`` times it (its gradient is
    made before the timing)."""

    def __init__(self, job: MemoryJob, call: Any, inputs: tuple[torch.Tensor, ...],
                 mask: torch.Tensor | None, device: torch.device) -> None:
        self.job, self.call, self.inputs = job, call, inputs
        self.masked = {} if mask is None else {"key_padding_mask": mask}
        self.generator = torch.Generator(device=device)
        self.grad: torch.Tensor | None = None

    def __call__(self) -> None:
        out = self.call(*self.inputs, self.generator.manual_seed(self.job.seed),
                        **self.masked)
        if self.job.backward:
            if self.grad is None:
                self.grad = torch.ones_like(out)
            out.backward(self.grad)
            for t in self.inputs:
                t.grad = None
        del out


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/self/status")


def _call(job: MemoryJob | CallJob, device: torch.device) -> Any:
    """The zero-argument callable to measure."""
    if isinstance(job, CallJob):
        return _resolve(job.setup)(**job.kwargs)
    (q, k, v), mask = _inputs(job, device)
    call = resolve(job.method).prepare(call_shape(q, k), job.options, device=device,
                                       dtype=q.dtype, as_layer=job.as_layer)
    return _AttentionCall(job, call, (q, k, v), mask, device)


def measure_in_this_process(job: MemoryJob | CallJob, device: torch.device | str = "cpu") -> int:
    """Peak bytes of one call above what was resident before it: after a warm-up call,
    so above the inputs and, for a backward ``MemoryJob``, its output gradient."""
    device = torch.device(device)
    call = _call(job, device)
    call()  # warm-up: one-time allocations are not the call's cost
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    call()
    return int((_status_kib("VmHWM") - base) * 1024)


def peak_memory_bytes(
    job: MemoryJob | CallJob, device: torch.device | str = "cpu", timeout: float = 600
) -> int:
    """Peak memory of ``job``: in process on CUDA, in a fresh subprocess on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return measure_in_this_process(job, device)
    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("CPU peak memory needs Linux /proc (clear_refs, VmHWM).")
    named = [job.method] if isinstance(job, MemoryJob) else job.methods
    imports = list(dict.fromkeys(m for name in named for m in _registering_module(name)))
    roots = [str(Path(__file__).resolve().parents[3]), *_import_roots(job, imports)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        [*roots, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]))
    env["SKYFORMER_THREADS"] = str(torch.get_num_threads())
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # see the module docstring
    payload = json.dumps({"kind": type(job).__name__, "imports": imports,
                          **dataclasses.asdict(job)})
    what = job.method if isinstance(job, MemoryJob) else job.setup
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "skyformer.eval.measure.memory", payload],
            capture_output=True, text=True, env=env, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"memory measurement of {what} took more than {timeout:g} s and was stopped "
            f"(a call that slow is measured with a larger timeout, or without memory)."
        ) from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no message)"]
        raise RuntimeError(  # the cause first: callers may keep one line
            f"memory measurement of {what} failed: {lines[-1]}\n"
            f"{proc.stderr.strip()[-2000:]}"
        )
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


def peak_memory_or_reason(job: MemoryJob | CallJob, device: torch.device | str = "cpu"
                          ) -> tuple[int | None, str | None]:
    """``(peak_memory_bytes(job, device), None)``, or ``(None, why)`` where the
    measurement failed (its subprocess failed or ran out of time): a report keeps the
    row's other numbers and says why its memory is missing."""
    try:
        return peak_memory_bytes(job, device), None
    except (RuntimeError, OSError) as err:
        lines = str(err).strip().splitlines()
        return None, f"peak memory not measured: {lines[0] if lines else type(err).__name__}"


def _registering_module(method: str) -> list[str]:
    """The module a fresh process must import to know ``method``: [] for the library's
    own methods and ``module:function`` specs (imported when resolved); a method
    registered, or a function defined, in ``__main__`` (a script, a notebook) cannot be
    known there. A name ``resolve`` refuses fails here, before a process is started."""
    named = resolve(method)
    if not named.registered:
        if method.partition(":")[0] == "__main__":
            raise RuntimeError(
                f"{method.partition('@')[0]} is defined in __main__ (a script or a "
                f"notebook), which the fresh process that measures CPU memory cannot "
                f"import; define it in an importable module.")
        return []
    module = getattr(get_method(named.name).function, "__module__", "") or ""
    if module.startswith("skyformer."):
        return []
    if module == "__main__":
        raise RuntimeError(
            f"{method} is registered in __main__ (a script or a notebook), which the fresh "
            f"process that measures CPU memory cannot import; register it in an importable "
            f"module.")
    return [module]


def _import_roots(job: MemoryJob | CallJob, imports: list[str]) -> list[str]:
    """The folders the fresh process needs on its path to import what ``job`` names (the
    module of a ``module:function`` spec or of ``CallJob.setup``, the ``imports`` that
    register its method) from where this process found them: a folder that a notebook
    or a script put on ``sys.path`` is on this process's path only."""
    spec = job.setup if isinstance(job, CallJob) else job.method.partition("@")[0]
    names = [spec.partition(":")[0]] if ":" in spec else []
    roots = []
    for name in [*names, *imports]:
        file = getattr(sys.modules.get(name), "__file__", None) or _origin(name)
        if file:
            path = Path(os.path.abspath(file))
            roots.append(str(path.parents[name.count(".") + (path.stem == "__init__")]))
    return roots


def _origin(name: str) -> str | None:
    """The file this process would import module ``name`` from (not imported yet: a
    script's ``CallJob`` setup beside it), or None where it finds none."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that does not import
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    for module in spec.pop("imports", []):  # where a method from outside is registered
        importlib.import_module(module)
    if spec.pop("kind", "MemoryJob") == "CallJob":
        spec["methods"] = tuple(spec.get("methods", ()))
        job: MemoryJob | CallJob = CallJob(**spec)
    else:
        spec["shape"] = tuple(spec["shape"])
        job = MemoryJob(**spec)
    threads = os.environ.get("SKYFORMER_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    print(json.dumps({"peak_bytes": measure_in_this_process(job, "cpu")}))


if __name__ == "__main__":
    _main(sys.argv[1:])
