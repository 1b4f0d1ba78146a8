"""``skyformer bench``: speed and memory of attention methods against exact SDPA.

For every method (registered names, or ``module:function`` entries, see
``methods.resolve``; registered methods run as inside a layer, with their per-layer
state), (B, H, D) shape, dtype and sequence length N, on random inputs:

- forward time (under ``torch.no_grad``) and forward + backward time: medians after
  an untimed first call and ``warmup`` untimed calls, the repeats interleaved across
  methods so that load changes on a shared machine hit all of them alike
  (``timing.interleaved_median_seconds``), or with
  ``timing="blocked"`` each call's repeats in a block of its own after an idle pause
  (``timing.blocked_median_seconds``: on a GPU a long, heavy call can slow the light
  one after it); CUDA is synchronised;
- peak memory of forward + backward above the inputs and the output gradient
  (``memory.peak_memory_bytes``: a fresh process per configuration on CPU,
  ``max_memory_allocated`` on CUDA);
- relative spectral error against the exact attention the method approximates, at the
  method's ``scale`` (and causal with ``causal``);
- for methods with a FLOP count (``flops.py``), the "speed of light": that arithmetic at
  the matmul throughput measured on the same device in the same run (for half inputs
  the faster of the half type's and float32's, ``sol_gflops``).

A configuration predicted (from the previous N) to take more than ``max_seconds`` per
call or more memory than is available, or whose inputs do not fit, is skipped, and the
row says so; so is a method whose call fails (its first call, a timed one: the row
says why, the other methods of that length are measured). The summary gives, per
method, the crossover length with the reference (exact SDPA softmax) and the fitted
scaling exponent of its time.

A run resumed from an earlier one's file (``measured``, ``earlier_runs``) keeps every
run's environment and matmul rates (``BenchResult.runs``) and each row says which run
measured it (``run``, an index into them): numbers between rows (N -> 2N growth, the
exponent, the crossover) are taken within one run only, never across runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...checks import check_positive_ints, is_integer
from ...devices import parse_device
from ...io import environment
from ...linalg.implicit_inverse import factorises
from ...logs import first_line
from ...ops.shared.inputs import compute_dtype
from ...registry import Method, get_method, list_methods
from ...registry.outputs import check_output
from ...registry.variants import refuse_swept_option
from ...seeds import check_seed
from ..measure.flops import attention_flops, matmul_flops_per_second
from ..measure.memory import MemoryJob, available_bytes, peak_memory_or_reason
from ..measure.metrics import relative_error, trivial_error
from ..measure.timing import (
    CLOCKS,
    TIMINGS,
    blocked_median_seconds,
    interleaved_median_seconds,
)
from ..methods import (
    NamedAttention,
    PreparedCall,
    exact_output,
    refuse_repeated_methods,
    refuse_repeats,
    resolve_all,
    setting_name,
    target_options,
)
from .summary import summarise

DTYPES = ("float32", "float64", "bfloat16", "float16")
History = dict[str, list[tuple[int, float]]]  # label -> (N, seconds or bytes) measured so far
HALF = ("bfloat16", "float16")


@dataclass(frozen=True)
class BenchConfig:
    """Settings of ``skyformer bench``.

    methods: names to measure (None = every registered method); the reference is
        added if missing.
    seq_lens: sequence lengths N (Nq = Nk).
    shapes: (B, H, D) triples; the value head dim equals D.
    dtypes: input dtypes ("float32", "float64", "bfloat16", "float16").
    device: "cpu" or "cuda" (never chosen for you).
    num_features: for every method that has the option (None = each method's default).
    repeats, warmup: timed runs (median) and untimed runs before them (after the one
        untimed first call every configuration gets).
    backward: also time forward + backward (and measure its peak memory; else forward).
    memory, error: measure peak memory / relative error.
    max_seconds: skip a configuration predicted to take longer per call.
    reference: the method speed and memory ratios are taken against.
    clock: "wall" (default) or "cpu" (process CPU time: robust to the load of a shared
        machine, meaningful with one thread; see ``timing``).
    causal: every method (the reference included) with ``causal=True``, errors against
        the exact causal target; without ``methods``, the methods that can be causal. A
        variant may not set causal itself (it would be timed against a reference of the
        other kind).
    timing: "interleaved" (default: round r runs every call once) or "blocked" (each
        call's runs in a block of its own, after ``pause`` seconds idle; see ``timing``).
    pause: seconds idle before each call's block (``timing="blocked"``).
    """

    methods: tuple[str, ...] | None = None
    seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    shapes: tuple[tuple[int, int, int], ...] = ((1, 2, 32),)
    dtypes: tuple[str, ...] = ("float32",)
    device: str = "cpu"
    num_features: int | None = None
    repeats: int = 3
    warmup: int = 1
    backward: bool = True
    memory: bool = True
    error: bool = True
    seed: int = 0
    max_seconds: float = 60.0
    reference: str = "softmax"
    clock: str = "wall"
    causal: bool = False
    timing: str = "interleaved"
    pause: float = 1.0

    def __post_init__(self) -> None:
        check_positive_ints(setting_name("seq_lens"), self.seq_lens)
        for shape in self.shapes:
            if len(shape) != 3 or any(not is_integer(s) or s < 1 for s in shape):
                raise ValueError(f"a shape is (B, H, D) with positive integers, got {shape!r}.")
        if not self.shapes:
            raise ValueError("give at least one (B, H, D) shape.")
        for name in ("seq_lens", "shapes", "dtypes"):
            refuse_repeats(setting_name(name), getattr(self, name))
        refuse_repeated_methods(self.methods)
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
        self._check_counts()
        check_seed("seed", self.seed)
        for named in resolve_all(self.methods or ()):
            if named.registered:  # functions take no presets
                _refuse_presets(get_method(named.name), self.num_features is not None)
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}.")
        if self.timing not in TIMINGS:
            raise ValueError(f"{setting_name('timing')} must be one of {', '.join(TIMINGS)}, "
                             f"got {self.timing!r}.")
        if not 0 <= self.pause < math.inf:
            raise ValueError(f"{setting_name('pause')} must be a finite number of seconds, "
                             f"at least 0, got {self.pause!r}.")
        device = parse_device(self.device)
        if self.clock == "cpu" and device.type == "cuda":
            raise ValueError("clock 'cpu' times host CPU work only; on CUDA use the wall clock.")

    def _check_counts(self) -> None:
        """The numbers of runs, features and seconds, each named with its flag."""
        if self.repeats < 1:
            raise ValueError(f"{setting_name('repeats')} must be at least 1, got {self.repeats}.")
        if self.warmup < 0:
            raise ValueError(f"{setting_name('warmup')} must be at least 0, got {self.warmup}.")
        if self.num_features is not None and self.num_features < 1:
            raise ValueError(f"{setting_name('num_features', 'features')} must be a positive "
                             f"integer, got {self.num_features}.")
        if not self.max_seconds > 0:
            raise ValueError(f"{setting_name('max_seconds')} must be positive, got "
                             f"{self.max_seconds}.")

    def method_names(self) -> list[str]:
        names = list(self.methods) if self.methods else [
            m for m in list_methods() if not self.causal or get_method(m).capabilities.causal]
        if self.reference not in names:  # speed-ups are taken against it
            names.insert(0, self.reference)
        return names


def _refuse_presets(method: Method, features: bool) -> None:
    """Fail in a sentence where a variant sets an option that the run sets for every
    method: num_features (with ``features``) or causal."""
    if features and method.budget_changes_output():  # --features sets it on this one
        refuse_swept_option(method.name, method.preset, "num_features", "bench (--features)")
    if "causal" in dict(method.preset):
        # a causal method against the non-causal reference would compare unlike things
        raise ValueError(f"{method.name}: bench makes every method causal with --causal, "
                         f"the reference SDPA included; drop causal from the brackets.")


@dataclass
class BenchResult:
    """What a run measured. ``environment`` and ``matmul_gflops`` are this run's;
    ``runs`` holds every run whose rows the result may hold (the earlier ones of
    ``--resume`` first, this one last), each ``{"started", "environment",
    "matmul_gflops"}`` (and ``"command"`` once written); a row's ``run`` indexes them."""

    config: BenchConfig
    environment: dict[str, Any]
    matmul_gflops: dict[str, float]  # dtype -> measured square-matmul throughput
    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "environment": self.environment,
            "matmul_gflops": self.matmul_gflops,
            "runs": self.runs,
            "rows": self.rows,
            "summary": self.summary,
        }


def _extrapolate(history: list[tuple[int, float]], n: int) -> float | None:
    """Value at ``n`` from the last two points, growth exponent clipped to [1, 2]
    (quadratic if only one point is known)."""
    if not history:
        return None
    n1, y1 = history[-1]
    exponent = 2.0
    if len(history) > 1:
        n0, y0 = history[-2]
        if y0 > 0 and y1 > 0 and n1 != n0:
            exponent = min(2.0, max(1.0, math.log(y1 / y0) / math.log(n1 / n0)))
    return y1 * (n / n1) ** exponent


def _inputs(shape: tuple[int, int, int], n: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b, h, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad = (
        torch.randn(b, h, n, d, generator=g, device=device).to(dtype) for _ in range(4)
    )
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), grad


def _inputs_or_reason(shape: tuple[int, int, int], n: int, dtype: torch.dtype,
                      device: torch.device, seed: int, limit: float, backward: bool = True
                      ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor] | None, str]:
    """(q, k, v, the output gradient) of ``_inputs``, or (None, why not): the bytes every
    call holds whatever its method (those four, the output and, with ``backward``, the
    gradients of q, k and v) above ``limit`` (a run that went on would be killed for
    memory, not told), or an allocation that failed; every method at that length is
    then skipped with the why."""
    b, h, d = shape
    tensors = 8 if backward else 5
    size = tensors * b * h * n * d * dtype.itemsize
    if size > limit:
        held = "the output and the gradients of q, k and v" if backward else "the output"
        return None, (f"the inputs (q, k, v and the output gradient), {held}, [{b}, {h}, "
                      f"{n}, {d}] each, take {size / 2**30:.3g} GiB > {limit / 2**30:.3g} "
                      f"GiB available")
    try:
        return _inputs(shape, n, dtype, device, seed), ""
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        return None, f"the inputs [{b}, {h}, {n}, {d}] could not be allocated: {_one_line(err)}"


def _closures(
    call: PreparedCall, q: Tensor, k: Tensor, v: Tensor, grad: Tensor, seed: int,
    check: Callable[[Any], None] | None = None,
) -> tuple[Callable[[], Tensor], Callable[[], None]]:
    """The forward and the forward + backward call timed. Their generator is made once,
    here, and reseeded in place by each call (every call draws the same): a generator
    made per call put its construction, host work, inside the timed region. ``check``
    sees the output of the first call (of either), untimed."""
    generator = torch.Generator(device=q.device)

    def checked(out: Any) -> Any:
        nonlocal check
        if check is not None:
            check, first = None, check
            first(out)
        return out

    def forward() -> Tensor:
        with torch.no_grad():
            return checked(call(q, k, v, generator.manual_seed(seed)))

    def forward_backward() -> None:
        out = checked(call(q, k, v, generator.manual_seed(seed)))
        out.backward(grad[..., : out.shape[-1]])
        for t in (q, k, v):
            t.grad = None

    return forward, forward_backward


def run_bench(
    config: BenchConfig, progress: Callable[[str], None] | None = None, *,
    measured: list[dict[str, Any]] | None = None,
    earlier_runs: list[dict[str, Any]] | None = None,
    after_length: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Measure every configuration of ``config``.

    Args:
        progress: receives one line per row.
        measured: rows of an earlier run of the same configuration (``resumable_rows``):
            a sequence length whose rows are all there is not measured again, and its
            times and peaks feed the predictions of the next lengths as if just measured.
            Each keeps its ``run``, an index into ``earlier_runs``.
        earlier_runs: the runs of the earlier file (``resume.earlier_runs``); this run
            comes after them in ``BenchResult.runs``.
        after_length: receives the result so far after every sequence length (to write
            it, so that an interruption loses at most the length being measured).
    """
    device = torch.device(config.device)
    methods = resolve_all(config.method_names())  # unknown names fail first
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two methods share a name in {labels}; give each once.")
    result = _start(config, device, list(earlier_runs or []))
    earlier = _rows_by_length(measured or [])
    limit = available_bytes(device)
    for shape in config.shapes:
        for dtype_name in config.dtypes:
            times: History = {label: [] for label in labels}
            peaks: History = {label: [] for label in labels}
            for n in sorted(config.seq_lens):
                group = {"device": str(device), "dtype": dtype_name, "batch": shape[0],
                         "heads": shape[1], "head_dim": shape[2], "n": n,
                         "run": len(result.runs) - 1}
                kept = earlier.get(_length_key(group))
                if kept is not None and set(kept) >= set(labels):
                    # their speed of light stays at the matmul rate of the run that measured them
                    new_rows = [{**kept[label], **RATIOS_UNSET} for label in labels]
                    _remember(config, new_rows, n, times, peaks)
                else:
                    new_rows = _measure_length(
                        config, methods, labels, shape, n, getattr(torch, dtype_name), device,
                        limit, times, peaks, sol_gflops(result.matmul_gflops, dtype_name),
                        group,
                    )
                    if progress:
                        for row in new_rows:
                            progress(_progress_line(row))
                result.rows.extend(new_rows)
                if after_length:
                    _finish(result)
                    after_length(result)
    return _finish(result)


def left_to_measure(config: BenchConfig, measured: list[dict[str, Any]] | None
                    ) -> list[tuple[tuple[int, int, int], str, int]]:
    """The (shape, dtype, N) of ``config`` that ``measured`` (``resumable_rows``) lacks a
    row of some method for: those ``run_bench`` measures, the others it keeps."""
    labels = {m.label for m in resolve_all(config.method_names())}
    earlier = _rows_by_length(measured or [])
    device = str(torch.device(config.device))
    return [(tuple(shape), dtype, n) for shape in config.shapes for dtype in config.dtypes
            for n in sorted(config.seq_lens)
            if not set(earlier.get((device, dtype, *shape, n), {})) >= labels]


def _start(config: BenchConfig, device: torch.device, earlier_runs: list[dict[str, Any]]
           ) -> BenchResult:
    """An empty result with this run's environment and matmul rates, after the earlier
    runs' in ``runs``."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = _load()
    throughput = {  # the inputs' dtypes and the float32 that half inputs may compute in
        dtype: matmul_flops_per_second(device, getattr(torch, dtype), clock=config.clock) / 1e9
        for dtype in dict.fromkeys(name for d in config.dtypes for name in (d, _computed(d)))
    }
    env = run_environment(device)
    env["methods"] = config.method_names()  # what runs: None in the config is "every one"
    env["load_average_start"] = load_start
    this_run = {"started": started, "environment": env, "matmul_gflops": throughput}
    return BenchResult(config, env, throughput, [], runs=[*earlier_runs, this_run])


def _finish(result: BenchResult) -> BenchResult:
    """``result`` with the load average now and the summary of its rows so far."""
    result.environment["load_average_end"] = _load()
    result.summary = summarise(result.rows, result.config.reference, result.config.backward)
    return result


# The keys of every row, in the order of the CSV's columns (``--resume`` reads them back;
# ``run``, the index of the run that measured the row in the file's ``runs``, is missing
# from files written before it was kept: their rows are the first run's).
ROW_KEYS = ("method", "spec", "device", "dtype", "batch", "heads", "head_dim", "n", "target",
            "exact", "num_features", "status", "reason", "fwd_ms", "fwd_bwd_ms", "peak_mib",
            "rel_error", "trivial_error", "gflop", "sol_ms", "sol_fraction", "speedup",
            "memory_ratio", "growth", "load_avg", "run")
# Set by ``summarise`` from the rows beside a row: recomputed for rows kept by --resume.
RATIOS_UNSET = {"speedup": None, "memory_ratio": None, "growth": None}


def run_environment(device: torch.device) -> dict[str, Any]:
    """``io.environment`` with the CPU's model name on the CPU."""
    env = environment(device)
    if device.type == "cpu":
        env.setdefault("device_name", _cpu_model())
    return env


def _length_key(row: dict[str, Any]) -> tuple:
    return (row["device"], row["dtype"], row["batch"], row["heads"], row["head_dim"], row["n"])


def _rows_by_length(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(device, dtype, B, H, D, N) -> method label -> row."""
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(_length_key(row), {})[row["method"]] = dict(row)
    return out


def _remember(config: BenchConfig, rows: list[dict[str, Any]], n: int, times: History,
              peaks: History) -> None:
    """Feed earlier rows at length ``n`` to the histories the skip predictions read."""
    key = "fwd_bwd_ms" if config.backward else "fwd_ms"
    for row in rows:
        if row["status"] == "ok" and row.get(key):
            times[row["method"]].append((n, row[key] / 1e3))
        if row.get("peak_mib"):
            peaks[row["method"]].append((n, row["peak_mib"] * 2**20))


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages; None where there are none (Windows has no
    ``os.getloadavg``, and it fails where the system cannot say)."""
    if not hasattr(os, "getloadavg"):
        return None
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _measure_length(
    config: BenchConfig, methods: list[NamedAttention], labels: list[str],
    shape: tuple[int, int, int], n: int, dtype: torch.dtype, device: torch.device, limit: float,
    times: History, peaks: History, gflops: float, group: dict[str, Any],
) -> list[dict[str, Any]]:
    """One row per method at sequence length ``n`` (all methods on the same inputs). A
    method whose call fails (``CALL_ERRORS``) gets a skipped row saying so, and the others
    are measured; any other error escapes with a note naming the method and N."""
    inputs, no_inputs = _inputs_or_reason(shape, n, dtype, device, config.seed, limit,
                                          config.backward)
    rows: dict[str, dict[str, Any]] = {}
    runnable: dict[str, _Runnable] = {}
    for label, method in zip(labels, methods, strict=True):
        rows[label], ready = _first_call(config, method, label, shape, n, dtype, device,
                                         inputs, no_inputs, limit, times[label], peaks[label],
                                         group, gflops)
        if ready is not None:
            runnable[label] = ready
    _time_interleaved(config, runnable, rows, device)
    exact: dict[tuple, tuple[Tensor, float]] = {}
    for label, ready in runnable.items():
        _complete_row(config, rows[label], ready, shape, n, device, inputs, exact,
                      times[label], peaks[label], gflops, group)
    return [rows[label] for label in labels]


# method, options, fwd, step, and its operations (``_flops``: counted once a length)
_Runnable = tuple[NamedAttention, dict[str, Any], Callable, Callable, float | None]
# What a method's call may raise and its row then records (out of memory, inputs its
# options exclude, a function of the wrong kind); anything else escapes (``_escaping``).
CALL_ERRORS = (RuntimeError, ValueError, TypeError)


def _escaping(err: Exception, row: dict[str, Any], when: str) -> Exception:
    """``err`` with a note naming the method, the configuration and ``when`` it was
    raised, to re-raise: an error bench does not record in a row stops the run, and
    its traceback says where."""
    err.add_note(f"raised by {row['method']} at N = {row['n']} (B={row['batch']} "
                 f"H={row['heads']} D={row['head_dim']} {row['dtype']}), {when}")
    return err


def _first_call(
    config: BenchConfig, method: NamedAttention, label: str, shape: tuple[int, int, int],
    n: int, dtype: torch.dtype, device: torch.device, inputs: Any, no_inputs: str | None,
    limit: float, times: list, peaks: list, group: dict[str, Any], gflops: float = math.inf,
) -> tuple[dict[str, Any], _Runnable | None]:
    """The row of ``method`` at length ``n`` and, where it is not skipped, its prepared
    calls after a first, untimed run of them (one that fails, e.g. out of memory, skips
    the row)."""
    b, h, d = shape
    options = method.options(config.num_features)
    if config.causal:
        options["causal"] = True
    row = {**dict.fromkeys(ROW_KEYS), "method": label, "spec": method.name, **group,
           "target": method.target, "exact": method.exact,
           "num_features": method.resolved_options(options, n).get("num_features"),
           "status": "ok", "reason": ""}
    flops = _flops(config, method, options, shape, n, dtype, device)
    floor = None if flops is None else flops / (gflops * 1e9)  # seconds at the matmul rate
    reason = no_inputs or _skip_reason(config, method, group["dtype"], n, times, peaks, limit,
                                       floor)
    if reason:
        row.update(status="skipped", reason=reason)
        return row, None
    try:
        call = method.prepare((b, h, n, d), options, device=device, dtype=dtype,
                              as_layer=True)
        # the registry checks its methods' outputs; a plain function's is checked here
        # with the same rule (timed as it was, one returning one row was reported many
        # times faster than softmax)
        check = None if method.registered else (
            lambda out: check_output(method.function, out, inputs[0], inputs[2]))
        forward, step = _closures(call, *inputs, config.seed, check)
        forward()  # both timed calls once untimed: with --warmup 0 neither is a first
        if config.backward:
            step()
    except CALL_ERRORS as err:
        row.update(status="skipped", reason=_one_line(err))
        return row, None
    except Exception as err:
        _escaping(err, row, "in its first call")
        raise
    return row, (method, options, forward, step, flops)


class _CallFailed(Exception):
    """A timed call of the method ``label`` raised ``error``."""

    def __init__(self, label: str, error: Exception) -> None:
        super().__init__(label, error)
        self.label, self.error = label, error


def _named(label: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn``, its errors raised as ``_CallFailed`` naming ``label``."""
    def call() -> object:
        try:
            return fn()
        except Exception as err:
            raise _CallFailed(label, err) from err

    return call


def _time_interleaved(config: BenchConfig, runnable: dict[str, _Runnable],
                      rows: dict[str, dict[str, Any]], device: torch.device) -> None:
    """``fwd_ms`` (and ``fwd_bwd_ms``) of every runnable row, timed interleaved (or in
    blocks, ``config.timing``), and the load average over the timing (none where nothing
    is timed). A method whose timed call fails leaves ``runnable``, its row skipped
    with the error, and the others are timed again without it: every time in a length
    comes from one timing."""
    while runnable:
        try:
            medians, load = _timed(config, runnable, device)
        except _CallFailed as failed:
            label, error = failed.label, failed.error
        else:
            break
        if not isinstance(error, CALL_ERRORS):  # raised here: no _CallFailed as context
            raise _escaping(error, rows[label], "in a timed call")
        rows[label].update(status="skipped", reason=f"a timed call failed: {_one_line(error)}")
        del runnable[label]
    else:
        return  # nothing (left) to time
    for row in rows.values() if load is not None else ():
        row["load_avg"] = load
    for label in runnable:
        rows[label]["fwd_ms"] = medians[f"{label}/fwd"] * 1e3
        if config.backward:
            rows[label]["fwd_bwd_ms"] = medians[f"{label}/fwd_bwd"] * 1e3


def _timed(config: BenchConfig, runnable: dict[str, _Runnable], device: torch.device
           ) -> tuple[dict[str, float], float | None]:
    """(median seconds of each call of ``runnable``, named ``label/fwd`` and
    ``label/fwd_bwd``; the mean 1-minute load average over the timing, if known)."""
    fns: dict[str, Callable[[], object]] = {}
    for label, (_, _, forward, step, _) in runnable.items():
        fns[f"{label}/fwd"] = _named(label, forward)
        if config.backward:
            fns[f"{label}/fwd_bwd"] = _named(label, step)
    load_before = _load()
    if config.timing == "blocked":
        medians = blocked_median_seconds(fns, device=device, warmup=config.warmup,
                                         repeats=config.repeats, pause=config.pause,
                                         clock=config.clock)
    else:
        medians = interleaved_median_seconds(fns, device=device, warmup=config.warmup,
                                             repeats=config.repeats, clock=config.clock)
    load_after = _load()
    if not (load_before and load_after):
        return medians, None
    return medians, round((load_before[0] + load_after[0]) / 2, 2)


def _complete_row(
    config: BenchConfig, row: dict[str, Any], ready: _Runnable, shape: tuple[int, int, int],
    n: int, device: torch.device, inputs: Any,
    exact: dict[tuple, tuple[Tensor, float]], times: list, peaks: list, gflops: float,
    group: dict[str, Any],
) -> None:
    """A timed row's history entry, peak memory, error and speed of light. A peak or an
    error that fails to be measured is left out, the row saying why in its reason (its
    times stand: they were measured)."""
    b, h, d = shape
    method, options, forward, _, flops = ready
    main = row["fwd_bwd_ms"] if config.backward else row["fwd_ms"]
    times.append((n, main / 1e3))
    if config.memory:
        job = MemoryJob(method.name, (b, h, n, d), options, dtype=group["dtype"],
                        seed=config.seed, backward=config.backward, as_layer=True)
        _guarded(row, "peak memory", lambda: _peak(row, job, device, peaks))
    target_floor = 4 * b * h * n * n * d / (gflops * 1e9)  # its two products, forward
    if config.error and method.target is not None and target_floor > config.max_seconds:
        _add_reason(row, f"relative error not measured: exact attention, its target, takes "
                         f"at least {target_floor:.3g} s here (> max_seconds = "
                         f"{config.max_seconds:g})")
    elif config.error and method.target is not None:
        _guarded(row, "relative error",
                 lambda: _error(row, forward, _target(*inputs[:3], method, options, exact)))
    if flops is not None:
        row["gflop"] = flops / 1e9
        _speed_of_light(row, gflops, config.backward)


def _flops(config: BenchConfig, method: NamedAttention, options: dict[str, Any],
           shape: tuple[int, int, int], n: int, dtype: torch.dtype, device: torch.device
           ) -> float | None:
    """The floating-point operations of one timed call of ``method`` at length ``n``
    (``attention_flops``), None where they are not counted (a plain function's)."""
    if not method.registered:
        return None
    b, h, d = shape
    return attention_flops(
        method.name, batch=b, heads=h, nq=n, nk=n, d=d, dv=d,
        options=method.resolved_options(options, n), backward=config.backward,
        factorised_core=factorises(device, compute_dtype(dtype)), dtype=compute_dtype(dtype),
    )


def _guarded(row: dict[str, Any], what: str, measure: Callable[[], None]) -> None:
    """``measure()``; where it raises one of ``CALL_ERRORS``, ``what`` is not measured and
    the row's reason says why."""
    try:
        measure()
    except CALL_ERRORS as err:
        _add_reason(row, f"{what} not measured: {_one_line(err)}")
    except Exception as err:
        _escaping(err, row, f"measuring its {what}")
        raise


def _add_reason(row: dict[str, Any], reason: str) -> None:
    row["reason"] = "; ".join(filter(None, (row["reason"], reason)))


def _peak(row: dict[str, Any], job: MemoryJob, device: torch.device, peaks: list) -> None:
    """The row's ``peak_mib`` (or its reason where the measurement failed)."""
    peak, reason = peak_memory_or_reason(job, device)
    if peak is None:
        _add_reason(row, reason or "")
    else:
        row["peak_mib"] = peak / 2**20
        peaks.append((row["n"], float(peak)))


def _error(row: dict[str, Any], forward: Callable[[], Tensor],
           target: tuple[Tensor, float]) -> None:
    """The row's ``rel_error`` against ``target`` (the exact output, the trivial answer's
    error), from one more forward call."""
    exact, trivial = target
    out = forward().to(exact.dtype)
    row["rel_error"] = relative_error(out, exact, ord=2).mean().item()
    row["trivial_error"] = trivial


def _computed(dtype_name: str) -> str:
    """The dtype inputs of ``dtype_name`` may be computed in (half types: float32)."""
    return str(compute_dtype(getattr(torch, dtype_name))).removeprefix("torch.")


def sol_gflops(throughput: dict[str, float], dtype_name: str) -> float:
    """The matmul rate (GFLOP/s) a speed of light at ``dtype_name`` inputs is taken at:
    that of the inputs' dtype, or for half types the faster of theirs and float32's.

    Half inputs are computed in their own type or in float32, by method and device
    (Skyformer and ``nystrom_softmax`` upcast on the PyTorch path, ``kernelized`` upcasts
    float16, SDPA on a CPU does not use the float16 matmul, which is there far slower
    than float32's), so the faster rate is the one no call can beat: with the half
    type's alone a CPU float16 call came out at several times the speed of light."""
    return max(throughput[dtype_name], throughput[_computed(dtype_name)])


def _speed_of_light(row: dict[str, Any], gflops: float, backward: bool) -> dict[str, Any]:
    """``row`` with ``sol_ms`` (its ``gflop`` at the matmul rate ``gflops`` of this run)
    and ``sol_fraction`` (that over its time); a row kept by --resume keeps the rate of
    the run that measured it (the report lists each run's rate)."""
    main = row.get("fwd_bwd_ms" if backward else "fwd_ms")
    if row.get("gflop") is not None and main:
        row["sol_ms"] = row["gflop"] / gflops * 1e3
        row["sol_fraction"] = row["sol_ms"] / main
    return row


def _skip_reason(config: BenchConfig, method: NamedAttention, dtype_name: str, n: int,
                 time_history: list[tuple[int, float]], peak_history: list[tuple[int, float]],
                 limit: float, floor: float | None = None) -> str:
    """Why ``method`` is not measured at length ``n``, or "". ``floor``: seconds a call
    takes at least (its operations at this run's matmul rate), which bounds the first
    length too, where no time is known to extrapolate from."""
    if dtype_name in HALF and not method.half_precision:
        return f"{method.name} does not take {dtype_name} inputs"
    seconds = _extrapolate(time_history, n)
    if seconds is not None and seconds > config.max_seconds:
        return f"predicted {seconds:.3g} s per call (> max_seconds = {config.max_seconds:g})"
    if floor is not None and floor > config.max_seconds:
        return (f"at least {floor:.3g} s per call, its operations at this run's matmul rate "
                f"(> max_seconds = {config.max_seconds:g})")
    peak = _extrapolate(peak_history, n)
    if peak is not None and peak > limit:
        return f"predicted peak {peak / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB available"
    return ""


def _target(q: Tensor, k: Tensor, v: Tensor, method: NamedAttention, options: dict[str, Any],
            known: dict[tuple, tuple[Tensor, float]]) -> tuple[Tensor, float]:
    """The exact output ``method`` approximates, with its ``target_options`` (causal,
    scale), in float32 (or the inputs' float64), and the error of the better trivial
    answer against it (mean(V) rows or zeros); kept in ``known`` for the next method."""
    same = target_options(method.resolved_options(options, q.shape[-2]))
    key = (method.target, *sorted(same.items()))
    if key not in known:
        out = exact_output(method.target, q, k, v, **same)
        known[key] = out, trivial_error(v, out, causal=bool(same.get("causal")))
    return known[key]


REASON_CHARS = 600  # the library's sentences fit; a longer first line is cut with "..."


def _one_line(err: BaseException) -> str:
    """The error's type and first line: a row's reason (torch's own messages keep their
    details on the lines after)."""
    line = f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else \
        type(err).__name__
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


def _progress_line(row: dict[str, Any]) -> str:
    shape = f"B={row['batch']} H={row['heads']} D={row['head_dim']} {row['dtype']}"
    head = f"{shape} N={row['n']:>6} {row['method']:<28}"
    if row["status"] != "ok":
        return f"{head} skipped: {row['reason']}"
    parts = [f"fwd {row['fwd_ms']:9.2f} ms"]
    if row["fwd_bwd_ms"] is not None:
        parts.append(f"fwd+bwd {row['fwd_bwd_ms']:9.2f} ms")
    if row["peak_mib"] is not None:
        parts.append(f"peak {row['peak_mib']:8.1f} MiB")
    if row["rel_error"] is not None:
        parts.append(f"err {row['rel_error']:.2e}")
    if row["reason"]:  # what was not measured, and why
        parts.append(row["reason"])
    return head + "  " + "  ".join(parts)
