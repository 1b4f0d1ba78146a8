"""``skyformer compare``: every registered method against its exact target on real Q/K/V.

For each method: relative spectral-norm error of the output against the exact
attention it approximates (softmax or Gaussian kernelized, per its capabilities, with
the method's own ``causal`` and ``scale``: ``softmax[causal=True]`` is its own target),
mean and spread over heads, relative Frobenius error, forward time and peak memory.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...checks import check_positive_int, is_integer
from ...io import check_output_path, environment
from ...logs import first_line
from ...ops.shared.inputs import AttentionInputs, check_attention_inputs
from ...registry import get_method, list_methods
from ...registry.variants import refuse_learned_options, refuse_swept_option
from ...seeds import check_seed
from ..approx.plots import require_figure_format
from ..data.qkv import QKV, MaskedQKV, load_qkv
from ..data.text import read_text
from ..measure.memory import MemoryJob, above_resolution, peak_memory_or_reason
from ..measure.metrics import relative_error, sample_statistics, worse_than_trivial
from ..measure.timing import median_seconds
from ..methods import (
    PreparedCall,
    call_shape,
    exact_output,
    refuse_repeated_methods,
    resolve,
    target_options,
)
from .maps import MapPanel, attention_maps, plot_maps
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
    maps: str | None = None  # a figure of one head's attention matrices (maps.py)
    maps_head: int = 0

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        # before the model loads; each method's row would say "not supported"
        if self.num_features is not None:  # each method's own
            check_positive_int("num_features (--features)", self.num_features)
        refuse_repeated_methods(self.methods)
        if self.maps is not None:  # before the model loads, not after the table
            check_output_path(self.maps)
            require_figure_format(self.maps, "--maps")
            if not is_integer(self.maps_head) or self.maps_head < 0:
                raise ValueError(f"maps_head (--maps-head) must be a head's index, 0 or "
                                 f"more, got {self.maps_head!r}.")
        for m in self.methods or ():  # unknown names fail before any work
            method = registered_method(m)
            refuse_learned_options(method, "compare")
            if self.num_features is not None and method.budget_changes_output():
                refuse_swept_option(method.name, method.preset, "num_features",
                                    "compare (--features)")


def registered_method(name: str) -> Any:
    """``get_method(name)``, with a sentence for a ``module:function`` spec (which
    ``bench`` takes): compare reads a method's capabilities and options, which only a
    registered method declares."""
    if isinstance(name, str) and ":" in name:
        raise ValueError(
            f"compare takes registered methods, not {name!r}: register it (skyformer "
            f"--plugin MODULE compare ...; CONTRIBUTING.md, 'Adding a method'), or time and "
            f"measure a plain function with skyformer bench --methods {name}.")
    return get_method(name)


@dataclass
class CompareResult:
    config: CompareConfig
    source: str
    rows: list[dict[str, Any]]
    environment: dict[str, Any] = field(default_factory=dict)
    maps: list[MapPanel] = field(default_factory=list)  # with config.maps

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "source": self.source,
            "environment": self.environment,
            "columns": COLUMNS,
            "rows": self.rows,
            "not_measured": not_measured(self.rows),
            **({"maps": {"path": self.config.maps, "head": self.config.maps_head,
                         "matrix_errors": [{"method": p.method, "target": p.target,
                                            "error": p.error, "reason": p.reason}
                                           for p in self.maps]}}
               if self.config.maps is not None else {}),
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


NUMBERS = ("spectral_error", "spectral_error_std", "spectral_error_median",
           "spectral_error_max", "trivial_error", "worse_than_trivial",
           "frobenius_error", "samples", "nonfinite", "time_ms", "peak_mib",
           "peak_below_resolution")


@dataclass(frozen=True)
class Target:
    """The exact output a method is measured against, ``[B, H, Nq, Dv]``; ``measured``,
    ``[B * H]``: the heads that have an error against it (output finite and not all
    zero), the same for every method of the target; ``trivial``: the better trivial
    answer's error over them."""

    output: Tensor
    measured: Tensor
    trivial: float


def compare_on(qkv: QKV | tuple[Tensor, Tensor, Tensor], config: CompareConfig, *,
               key_padding_mask: Tensor | None = None,
               maps: list[MapPanel] | None = None) -> list[dict[str, Any]]:
    """Rows of the comparison on given Q/K/V ``[B, H, N, D]`` (a ``QKV`` captured from a
    model, or one's own ``(q, k, v)``): errors are the mean (and spread) over the B * H
    heads, times those of one call on the whole batch. ``key_padding_mask``, ``[B, Nk]``
    bool (True = real token), goes to the exact target and to every method alike (the
    peak memory is measured on the call without it).

    Heads whose exact output is not finite (NaN or inf in the inputs reach it: a
    warning names them) or all zero have no error: they are left out of every row's
    mean and std, and counted, with any head where the method alone is not finite
    (whose row's mean and std are then NaN, as ``approx``'s), in ``nonfinite``.
    Own tensors with more heads than tokens get a warning: the mark of ``[B, N, H, D]``
    tensors read as ``[B, H, N, D]``.

    Unknown method names and inputs no method can take (``check_attention_inputs``) fail
    before anything runs. A method that cannot run these inputs (e.g. BigBird with
    Nq != Nk, ``causal=True`` with Nq != Nk: the sentence of its ``ValueError``) gets a
    row with ``status`` "not supported" (a call that fails otherwise, e.g. out of
    memory: "failed") and the sentence why in ``reason``, its numbers ``None``; the others are
    measured. With ``config.maps``, the figure of head ``config.maps_head`` of the first
    sequence (``maps.py``) is written there, and its panels added to ``maps``."""
    q, k, v = given_tensors(qkv)
    info = check_attention_inputs(q, k, v, key_padding_mask, method="compare_on")
    if not isinstance(qkv, QKV):  # a captured QKV's layout is known
        _say_layout(q, k)
    _say_nonfinite(q, k, v, info)
    _say_keyless(info)
    if config.maps is not None and config.maps_head >= q.shape[1]:
        raise ValueError(f"--maps-head must be below the {q.shape[1]} heads of the Q/K/V, "
                         f"got {config.maps_head}.")
    methods = list(config.methods) if config.methods else list_methods()
    for m in methods:
        registered_method(m)  # unknown names fail before any work
    given = MaskedQKV(q, k, v, key_padding_mask)
    targets: dict[tuple, Target] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "qkv.pt"
        # the mask too: the peak is that of the call whose errors and time the row has
        torch.save({"q": q, "k": k, "v": v, **({} if key_padding_mask is None else
                                                {"key_padding_mask": key_padding_mask})},
                   inputs)
        # a bar on a terminal, nothing when piped (tqdm's disable=None)
        for name in tqdm(methods, desc="compare", unit="method", leave=False, disable=None):
            rows.append(_row(name, given, config, targets, str(inputs)))
    if config.maps is not None:
        panels = attention_maps(given, methods, config.num_features, config.seed,
                                config.maps_head)
        plot_maps(panels, config.maps, f"head {config.maps_head}: the matrix each method "
                  f"applies to V, and its relative spectral error")
        if maps is not None:
            maps.extend(panels)
    return rows


def _say_layout(q: Tensor, k: Tensor) -> None:
    """A warning where the inputs have more heads than tokens: what tensors saved as
    ``[B, N, H, D]`` (the transpose forgotten) look like read as ``[B, H, N, D]``, whose
    "heads" are then tokens and whose errors, excellent-looking, mean nothing. A model
    can have that many heads on short inputs: a warning, not an error."""
    heads, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    if heads > max(nq, nk):
        warnings.warn(
            f"compare_on: q {tuple(q.shape)} and k {tuple(k.shape)}, read as [B, H, N, D], "
            f"have more heads (H={heads}) than tokens (Nq={nq}, Nk={nk}): tensors saved as "
            f"[B, N, H, D] look like that; if yours were, pass q.transpose(1, 2), "
            f"k.transpose(1, 2) and v.transpose(1, 2) instead.", stacklevel=3)


def _real_rows(t: Tensor, valid: Tensor | None) -> Tensor:
    """The rows of ``t: [B, H, N, D]`` at the real tokens of ``valid: [B, N]``."""
    return t if valid is None else t.transpose(1, 2)[valid]


def _say_nonfinite(q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs) -> None:
    """A warning naming the inputs that hold NaN or inf at real tokens (the padding the
    mask leaves out is read by nothing): the rows they reach are NaN in every method's
    output and in the exact one, so those heads have no error and are left out of the
    means (a table of NaNs said nothing of why)."""
    counts = {name: int((~torch.isfinite(_real_rows(t, valid))).sum())
              for name, t, valid in (("q", q, info.query_valid), ("k", k, info.key_valid),
                                     ("v", v, info.key_valid))}
    spoiled = [f"{name} ({count} entries)" for name, count in counts.items() if count]
    if spoiled:
        warnings.warn(f"compare_on: {', '.join(spoiled)} hold NaN or inf: the output rows "
                      f"they reach are NaN, exact and approximate, so their heads have no "
                      f"error and are left out of every row's mean and std (its nonfinite "
                      f"counts them); replace them (torch.nan_to_num) or drop those tokens "
                      f"first.", stacklevel=3)


def _say_keyless(info: AttentionInputs) -> None:
    """A warning naming the batch elements whose key padding mask has no real key: their
    outputs are all zero, exact and approximate, so they give no error (a table of "not
    finite" heads blamed NaN or inf). Almost always a mask of torch's convention (True =
    padding) where True must mark real tokens."""
    if info.key_valid is None:
        return
    keyless = (~info.key_valid.any(dim=-1)).nonzero().flatten().tolist()
    if keyless:
        shown = ", ".join(map(str, keyless[:8])) + (", ..." if len(keyless) > 8 else "")
        warnings.warn(f"compare_on: the key padding mask has no real key in batch element(s) "
                      f"{shown}, so their outputs are all zero and give no error; True must "
                      f"mark real tokens (torch's key_padding_mask marks padding: pass ~mask).",
                      stacklevel=3)


def _target(target: str, resolved: dict[str, Any], given: MaskedQKV,
            known: dict[tuple, Target]) -> Target:
    """The exact output of ``target`` (``exact_output``: float32 for half-precision
    inputs) with the ``target_options`` of ``resolved`` (causal, scale) and the mask,
    the heads it gives an error on (a head's error against itself is defined where
    the exact output is finite and not all zero) and the trivial answer's error; kept
    in ``known`` for the next method with the same target."""
    same = target_options(resolved)
    key = (target, *sorted(same.items()))
    if key not in known:
        out = exact_output(target, given.q, given.k, given.v,
                           key_padding_mask=given.key_padding_mask, **same)
        measured = relative_error(out, out, ord="fro").isfinite().flatten()
        _say_zero_target(target, out, given)
        trivial = _trivial(given, out, measured, causal=bool(same.get("causal")))
        known[key] = Target(out, measured, trivial)
    return known[key]


def _say_zero_target(target: str, exact: Tensor, given: MaskedQKV) -> None:
    """A warning naming the heads whose exact output ``[B, H, Nq, Dv]`` is finite but all
    zero although they have real keys: an error relative to it is undefined, so they are
    left out, and the table alone showed "not finite" with no reason. For the Gaussian
    target that is every kernel entry underflowing (Q and K of large norm)."""
    heads = exact.isfinite().flatten(2).all(-1) & (exact.flatten(2).abs().amax(-1) == 0)
    if given.key_padding_mask is not None:
        heads &= given.key_padding_mask.any(-1, keepdim=True)  # keyless: _say_keyless's
    zero = heads.flatten().nonzero().flatten().tolist()  # [B * H] as the rows count them
    if not zero:
        return
    why = {"gaussian": ": every kernel entry exp(-|q_i - k_j|^2 / (2 sqrt(D))) underflows, "
                       "each query being far from every key (scale Q and K down, as a "
                       "model's layer norm would)",
           "softmax": ": V is zero at every real key"}.get(target, "")
    warnings.warn(f"compare_on: the exact {target} output is all zero on {len(zero)} of "
                  f"{heads.numel()} heads{why}. An error relative to it is undefined, so "
                  f"those heads are left out of every {target} row's mean and std (its "
                  f"nonfinite counts them).", stacklevel=5)


def _trivial(given: MaskedQKV, exact: Tensor, measured: Tensor, *, causal: bool) -> float:
    """Mean spectral error over the ``measured`` heads of the better trivial answer:
    every row the mean of the real values (uniform attention: with ``causal``, row i the
    mean of v_0..v_i; padded queries' rows zero, as every method's), the softmax
    target's constant, or all zeros (relative error 1: the Gaussian target's rows are
    not weighted means, so the mean of V can be far off there)."""
    # zero queries and keys: equal scores, equal weights on every real key
    mean_v = exact_output("softmax", torch.zeros_like(given.q), torch.zeros_like(given.k),
                          given.v, key_padding_mask=given.key_padding_mask, causal=causal)
    errors = relative_error(mean_v, exact, ord=2).flatten()[measured]
    error = errors.mean().item()  # NaN where no head has an error
    return error if math.isnan(error) else min(1.0, error)


def _errors(out: Tensor, target: Target) -> dict[str, Any]:
    """The error numbers of a row: ``out``'s spectral and Frobenius errors per head
    against the target, their statistics over the heads it measures (approx's: NaN
    where the method is not finite on one of them), the heads without a finite error."""
    spectral = relative_error(out, target.output, ord=2).flatten()  # [B * H]
    frobenius = relative_error(out, target.output, ord="fro").flatten()
    s = sample_statistics(spectral[target.measured])
    return {"spectral_error": s["mean"], "spectral_error_std": s["std"],
            "spectral_error_median": s["median"], "spectral_error_max": s["max"],
            "trivial_error": target.trivial,
            "worse_than_trivial": worse_than_trivial(s["mean"], target.trivial),
            "frobenius_error": sample_statistics(frobenius[target.measured])["mean"],
            "samples": spectral.numel(), "nonfinite": int((~spectral.isfinite()).sum())}


def _row(name: str, given: MaskedQKV, config: CompareConfig, targets: dict[tuple, Target],
         inputs: str) -> dict[str, Any]:
    """The row of method ``name`` on ``given`` (``compare_on``)."""
    q, k, v, mask = given.q, given.k, given.v, given.key_padding_mask
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

        generator = torch.Generator(device=q.device)  # made once: not part of the time

        def run(call: PreparedCall = call) -> Tensor:
            with torch.no_grad():  # reseeded in place: every call draws the same
                return call(q, k, v, generator.manual_seed(config.seed),
                            key_padding_mask=mask)

        out = run()
    except ValueError as err:  # a CapabilityError, or inputs the options exclude
        return {**row, "status": "not supported", "reason": first_line(err)}
    except (RuntimeError, TypeError) as err:  # e.g. out of memory
        return {**row, "status": "failed",
                "reason": f"{type(err).__name__}: {first_line(err)}"}
    row.update(_errors(out, _target(row["target"], resolved, given, targets)))
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
    panels: list[MapPanel] = []
    rows = compare_on(qkv, config, maps=panels)
    return CompareResult(config, qkv.describe(), rows, environment(qkv.q.device), panels)
