"""``skyformer compare``: every registered method against its exact target on real Q/K/V.

For each method: relative spectral-norm error of the output against the exact
attention it approximates (softmax or Gaussian kernelized, per its capabilities, with
the method's own ``causal`` and ``scale``: ``softmax[causal=True]`` is its own target),
mean and spread over heads, relative Frobenius error, forward time and peak memory.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...checks import check_positive_int
from ...io import environment
from ...ops.shared.inputs import check_attention_inputs
from ...registry import get_method, list_methods
from ...registry.variants import refuse_swept_option
from ...seeds import check_seed
from ..data.qkv import QKV, load_qkv
from ..data.text import read_text
from ..measure.memory import MemoryJob, above_resolution, peak_memory_or_reason
from ..measure.metrics import relative_error, trivial_error
from ..measure.timing import median_seconds
from ..methods import (
    PreparedCall,
    call_shape,
    exact_output,
    refuse_repeated_methods,
    resolve,
    target_options,
)
from .report import COLUMNS, not_measured


@dataclass(frozen=True)
class CompareConfig:
    """Settings of ``skyformer compare``; ``None`` means the method's own default."""

    seq_len: int = 512
    layer: int = 0
    num_features: int | None = None
    seed: int = 0
    text: str | None = None  # path of a UTF-8 text file; None = shipped text
    model: str | None = None  # local model folder; None = pretrained MiniLM-L6
    pretrained: bool = True
    methods: tuple[str, ...] | None = None
    repeats: int = 3
    memory: bool = True

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        # before the model loads; each method's row would say "not supported"
        if self.num_features is not None:  # each method's own
            check_positive_int("num_features (--features)", self.num_features)
        refuse_repeated_methods(self.methods)
        for m in self.methods or ():  # unknown names fail before any work
            method = get_method(m)
            if self.num_features is not None:
                refuse_swept_option(method.name, method.preset, "num_features",
                                    "compare (--features)")


@dataclass
class CompareResult:
    config: CompareConfig
    source: str
    rows: list[dict[str, Any]]
    environment: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "source": self.source,
            "environment": self.environment,
            "columns": COLUMNS,
            "rows": self.rows,
            "not_measured": not_measured(self.rows),
        }


def memory_job(method: str, shape: tuple[int, int, int, int], options: dict[str, Any],
               seed: int, inputs: str) -> MemoryJob:
    """The peak-memory job of the call ``compare`` times: the method bound as a function
    call (``as_layer=False``: no per-layer state, which e.g. Linformer only has for a
    fixed ``max_seq_len``)."""
    return MemoryJob(method, shape, options, seed=seed, inputs=inputs, as_layer=False)


def given_tensors(qkv: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` of a ``QKV`` or of three tensors; a sentence for anything else."""
    if isinstance(qkv, QKV):
        return qkv.q, qkv.k, qkv.v
    if isinstance(qkv, (tuple, list)) and len(qkv) == 3 \
            and all(isinstance(t, Tensor) for t in qkv):
        return tuple(qkv)  # type: ignore[return-value]
    hint = (" (for a dict d of them, pass (d['q'], d['k'], d['v']))"
            if isinstance(qkv, dict) else "")
    raise TypeError(f"compare_on takes the queries, keys and values as (q, k, v), three "
                    f"tensors [B, H, N, D], or a QKV; got a {type(qkv).__name__}{hint}.")


NUMBERS = ("spectral_error", "spectral_error_std", "trivial_error", "worse_than_trivial",
           "frobenius_error", "samples", "time_ms", "peak_mib", "peak_below_resolution")


def compare_on(qkv: QKV | tuple[Tensor, Tensor, Tensor],
               config: CompareConfig) -> list[dict[str, Any]]:
    """Rows of the comparison on given Q/K/V ``[B, H, N, D]`` (a ``QKV`` captured from a
    model, or one's own ``(q, k, v)``): errors are the mean (and spread) over the B * H
    heads, times those of one call on the whole batch.

    Unknown method names and inputs no method can take (``check_attention_inputs``) fail
    before anything runs. A method that cannot run these inputs (e.g. BigBird with
    Nq != Nk, ``causal=True`` with Nq != Nk: the sentence of its ``ValueError``) gets a
    row with ``status`` "not supported" (a call that fails otherwise, e.g. out of
    memory: "failed") and the sentence why in ``reason``, its numbers ``None``; the others are
    measured."""
    q, k, v = given_tensors(qkv)
    check_attention_inputs(q, k, v, None, method="compare_on")
    _say_nonfinite(q, k, v)
    methods = list(config.methods) if config.methods else list_methods()
    for m in methods:
        get_method(m)  # unknown names fail before any work
    targets: dict[tuple, tuple[Tensor, float]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "qkv.pt"
        torch.save({"q": q, "k": k, "v": v}, inputs)
        # a bar on a terminal, nothing when piped (tqdm's disable=None)
        for name in tqdm(methods, desc="compare", unit="method", leave=False, disable=None):
            rows.append(_row(name, (q, k, v), config, targets, str(inputs)))
    return rows


def _say_nonfinite(q: Tensor, k: Tensor, v: Tensor) -> None:
    """A warning naming the inputs that hold NaN or inf: the rows they reach are NaN in
    every method's output and in the exact one, so those heads' errors are NaN (a table
    of NaNs said nothing of why)."""
    spoiled = [f"{name} ({int((~torch.isfinite(t)).sum())} entries)"
               for name, t in (("q", q), ("k", k), ("v", v)) if not torch.isfinite(t).all()]
    if spoiled:
        warnings.warn(f"compare_on: {', '.join(spoiled)} hold NaN or inf: the output rows "
                      f"they reach are NaN, exact and approximate, and so are the errors "
                      f"of their heads; replace them (torch.nan_to_num) or drop those "
                      f"tokens first.", stacklevel=3)


def _target(target: str, resolved: dict[str, Any], q: Tensor, k: Tensor, v: Tensor,
            known: dict[tuple, tuple[Tensor, float]]) -> tuple[Tensor, float]:
    """The exact output ``[B, H, Nq, Dv]`` of ``target`` (``exact_output``: float32 for
    half-precision inputs) with the ``target_options`` of
    ``resolved`` (causal, scale) and the error of the better trivial answer against it,
    every row = mean of V (the softmax target's constant) or all zeros (relative error
    1: the Gaussian target's rows are not weighted means, so mean(V) can be far off
    there); kept in ``known`` for the next method with the same target."""
    same = target_options(resolved)
    key = (target, *sorted(same.items()))
    if key not in known:
        out = exact_output(target, q, k, v, **same)
        known[key] = out, trivial_error(v, out, causal=bool(same.get("causal")))
    return known[key]


def _row(name: str, qkv: tuple[Tensor, Tensor, Tensor], config: CompareConfig,
         targets: dict[tuple, tuple[Tensor, float]], inputs: str) -> dict[str, Any]:
    """The row of method ``name`` on ``qkv`` (``compare_on``)."""
    q, k, v = qkv
    spec = get_method(name)
    named = resolve(name)
    options = named.options(config.num_features)
    row = {"method": name, "target": spec.capabilities.target,
           "exact": spec.capabilities.exact, "num_features": None,
           # the generator's seed where the output depends on it
           "seed": config.seed if spec.capabilities.randomized else None,
           "status": "ok", "reason": "", **dict.fromkeys(NUMBERS)}
    try:
        resolved = named.resolved_options(options, call_shape(q, k)[2])
        row["num_features"] = resolved.get("num_features")
        call = named.prepare(call_shape(q, k), options, device=q.device, dtype=q.dtype)

        def run(call: PreparedCall = call) -> Tensor:
            g = torch.Generator(device=q.device).manual_seed(config.seed)
            with torch.no_grad():
                return call(q, k, v, g)

        out = run()
    except ValueError as err:  # a CapabilityError, or inputs the options exclude
        return {**row, "status": "not supported", "reason": _first_line(err)}
    except (RuntimeError, TypeError) as err:  # e.g. out of memory
        return {**row, "status": "failed",
                "reason": f"{type(err).__name__}: {_first_line(err)}"}
    exact, trivial = _target(row["target"], resolved, q, k, v, targets)
    # one error per head of every sequence, [B * H], as the trivial answer's
    spectral = relative_error(out, exact, ord=2).flatten()
    frobenius = relative_error(out, exact, ord="fro").flatten()
    row.update(spectral_error=spectral.mean().item(),
               spectral_error_std=spectral.std().item() if spectral.numel() > 1 else 0.0,
               trivial_error=trivial, worse_than_trivial=spectral.mean().item() > trivial,
               frobenius_error=frobenius.mean().item(), samples=spectral.numel())
    row["time_ms"] = median_seconds(run, device=q.device, warmup=1,
                                    repeats=config.repeats) * 1e3
    if config.memory:
        job = memory_job(name, tuple(q.shape), options, config.seed, inputs)
        peak, reason = peak_memory_or_reason(job, q.device)
        if reason is not None:  # the row keeps its errors and time
            warnings.warn(f"{name}: {reason}", stacklevel=3)
        row["peak_mib"] = None if peak is None else peak / 2**20
        # a CPU peak under the resolution says only "small" (bench takes no ratio of it)
        row["peak_below_resolution"] = peak is not None and not above_resolution(peak,
                                                                                 q.device)
    return row


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def compare(config: CompareConfig = CompareConfig()) -> CompareResult:
    """Load real Q/K/V (default: pretrained MiniLM-L6 on shipped text) and compare."""
    qkv = load_qkv(
        seq_len=config.seq_len,
        layer=config.layer,
        text=read_text(config.text),
        model_dir=config.model,
        pretrained=config.pretrained,
        seed=config.seed,
    )
    rows = compare_on(qkv, config)
    return CompareResult(config, qkv.describe(), rows, environment(qkv.q.device))
