"""``skyformer approx``: how close each method gets to exact attention, against the
number of features m, on real and synthetic Q/K/V (Skyformer Figure 1, KDEformer
Figure 4), with the best any rank-m method could do and a trivial baseline, plus the
spectral analysis of Skyformer Appendix B / Theorem 2 and KDEformer Figure 2.

For every source, sequence length N, method, m and seed: the relative spectral-norm
error ||O - O_exact||_2 / ||O_exact||_2 per head (and the Frobenius one) against the
exact attention the method approximates (``capabilities.target``: softmax or
Gaussian kernelized). References per target and head:

- ``svd_floor``: the error of A_m V, A_m the best rank-m approximation (truncated SVD)
  of the attention matrix A (the softmax matrix D^-1 A or the Gaussian C);
- ``mean_v`` (softmax): every output row = mean of V, what uniform attention returns;
- ``constant_row`` (both targets): every row = the mean row of the exact output, the
  best answer that ignores the query (in Frobenius norm). For the Gaussian target the
  output C V is not row-normalised, its rows' scale varies with the row sums of C,
  and "mean of V" has no meaning there; the best constant row is the trivial answer.
  Returning zeros scores exactly 1.0 for either target; against a zero output (every
  kernel entry underflowed) the error is NaN, with a note.

See docs/approximation.md.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...checks import check_positive_ints
from ...io import environment
from ...linalg import gaussian_scores, softmax_scores, top_singular_subspace
from ...linalg.subspace import takes_full_svd
from ...logs import get_logger
from ...registry import Method, exact_method, get_method, list_methods
from ...registry.variants import refuse_learned_options, refuse_swept_option
from ...seeds import check_seed
from ..data.sources import (
    DEFAULT_HEADS,
    SOURCES,
    SourceData,
    SourceLoader,
    SourceOptions,
    check_source,
)
from ..measure.memory import available_bytes
from ..measure.metrics import (
    constant_row_error,
    rank_m_floor,
    relative_error,
    sample_statistics,
)
from ..methods import TARGET_OPTIONS, refuse_repeated_methods, refuse_repeats, setting_name
from .leverage import THEOREM_CONSTANT, leverage_analysis
from .progress import PARTS, ProgressFile, block_key, blocks_said, data_stamps
from .spectra import attention_spectra, lsh_mask, oracle_mask

FLOOR = "svd_floor"
MEAN_V = "mean_v"
CONSTANT_ROW = "constant_row"
_CALL_ERRORS = (ValueError, TypeError, RuntimeError, NotImplementedError)


@dataclass(frozen=True)
class ApproxConfig:
    """Settings of the approximation study (defaults: the figure in docs/approximation.md).

    sources: any of ``pretrained`` (MiniLM-L6 or ``model``), ``init`` (same
        architecture, random weights), ``glove`` (needs ``glove``), ``gaussian``.
    seq_lens: sequence lengths N; features: numbers of features m (values >= N are
        dropped for that N: a rank-N approximation is exact); seeds: the methods'
        random seeds.
    methods: names from the registry; ``None`` = every approximate method.
    layer, heads: model layer and head indices (``None`` = all heads); for ``glove``
        and ``gaussian`` the number of heads is the number of independent slices.
    model, text: local BERT-type model folder and UTF-8 text file (``None`` = MiniLM-L6
        and the shipped text); glove: GloVe-format file; gaussian_norm/dim: root-mean-
        square row norm and width of synthetic Q, K; data_seed: random init / synthetic data.
    floor_*: randomized subspace iteration for the rank-m floors (full SVD when
        N <= floor_exact_below).
    sweep: measure the methods (error against m); analysis: the spectra and leverage
        analysis at ``analysis_seq_len``; residual_block: keys per LSH bucket (and
        entries per row of the oracle mask) of the sparse part, lsh_bits: hyperplanes
        of the angular LSH (KDEformer's default 7); eps, delta: Theorem 2.
    """

    sources: tuple[str, ...] = ("pretrained", "init")
    seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096)
    features: tuple[int, ...] = (16, 32, 64, 128, 256)
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] | None = None
    layer: int = 0
    heads: tuple[int, ...] | None = DEFAULT_HEADS
    model: str | os.PathLike[str] | None = None  # a path is kept as its str
    text: str | os.PathLike[str] | None = None
    glove: str | os.PathLike[str] | None = None
    qkv: str | os.PathLike[str] | None = None
    gaussian_norm: float = 6.0
    gaussian_dim: int = 32
    data_seed: int = 0
    floor_oversample: int = 64
    floor_power_iterations: int = 3
    floor_exact_below: int = 1024
    sweep: bool = True
    analysis: bool = True
    analysis_seq_len: int = 512
    residual_block: int = 64
    lsh_bits: int = 7
    eps: tuple[float, ...] = (0.1, 0.01)
    delta: float = 0.1
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("model", "text", "glove", "qkv"):  # as recorded and compared at --resume
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("sources", "seq_lens", "features", "seeds"):
            if not getattr(self, name):
                raise ValueError(f"{setting_name(name)} must not be empty.")
        for s in self.sources:
            check_source(s)
        for name in ("sources", "seq_lens", "features", "seeds", "heads", "eps"):
            refuse_repeats(setting_name(name), getattr(self, name))
        refuse_repeated_methods(self.methods)
        for name in ("seq_lens", "features"):
            check_positive_ints(setting_name(name), getattr(self, name))
        for seed in self.seeds:
            check_seed(setting_name("seeds"), seed)
        check_seed(setting_name("data_seed"), self.data_seed)
        short = [n for n in self.seq_lens if n < 3]
        if short:
            raise ValueError(f"{setting_name('seq_lens')} must be at least 3, got {short}.")
        if self.analysis_seq_len < 3:
            raise ValueError(f"{setting_name('analysis_seq_len', 'analysis_len')} must be at "
                             f"least 3, got {self.analysis_seq_len}.")
        if self.heads is not None and (not self.heads or any(h < 0 for h in self.heads)):
            raise ValueError(f"heads must be non-negative indices, got {list(self.heads)}.")
        if not (self.sweep or self.analysis):
            raise ValueError("nothing to do: both the sweep and the analysis are switched off.")
        short = [n for n in self.seq_lens if n <= min(self.features)] if self.sweep else []
        if short:  # here, not when the sweep reaches N after measuring the others
            raise ValueError(f"every number of features is >= N={short[0]}; pass smaller "
                             f"--features or longer --seq-lens.")
        self._check_counts()
        for e in self.eps:
            if not 0 < e < 1:
                raise ValueError(f"eps must be in (0, 1) (Theorem 2), got {e}.")
        if not 0 < self.delta < 0.5:
            raise ValueError(f"delta must be in (0, 1/2) (Theorem 2), got {self.delta}.")
        if "glove" in self.sources and self.glove is None:
            raise ValueError("the glove source needs a GloVe-format file: pass --glove FILE.")

    def _check_counts(self) -> None:
        """The floors' and the sparse part's counts, each named with its flag."""
        for name, least in (("floor_oversample", 0), ("floor_power_iterations", 0),
                            ("residual_block", 1), ("lsh_bits", 1)):
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"{setting_name(name)} must be at least {least}, got {value}.")

    def source_options(self) -> SourceOptions:
        paths = {name: None if getattr(self, name) is None else os.fspath(getattr(self, name))
                 for name in ("model", "text", "glove", "qkv")}  # strs since __post_init__
        return SourceOptions(
            layer=self.layer, heads=self.heads, gaussian_norm=self.gaussian_norm,
            gaussian_dim=self.gaussian_dim, data_seed=self.data_seed, **paths,
        )


QUICK = {
    "seq_lens": (256,), "features": (16, 32, 64), "seeds": (0, 1, 2), "heads": (0, 1),
    "analysis_seq_len": 256, "eps": (0.1,),
}


def quick_config(**overrides: Any) -> ApproxConfig:
    """The ``--quick`` preset (one short length, three feature counts, two heads)."""
    return ApproxConfig(**{**QUICK, **overrides})


@dataclass
class ApproxResult:
    """Everything the study measured; ``rows`` is the results table. ``progress_left``:
    the blocks of the progress file a resumed run did not ask for (other --seq-lens or
    --sources), which it keeps; not part of the results. ``data``: the data files'
    stamps (size, modification time) when the run began (``progress.data_stamps``)."""

    config: ApproxConfig
    rows: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    analysis: list[dict[str, Any]]
    sources: list[dict[str, Any]]
    notes: list[str]
    environment: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    progress_left: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "data": self.data,
            "environment": self.environment,
            "seconds": self.seconds,
            "sources": self.sources,
            "notes": self.notes,
            "rows": self.rows,
            "analysis": self.analysis,
            "samples": self.samples,
        }

    def table(self) -> str:
        from .report import format_table

        return format_table(self.rows)


def _row(source: str, n: int, kind: str, method: str, target: str, m: int | None,
         spectral: Tensor, frobenius: Tensor) -> dict[str, Any]:
    s = sample_statistics(spectral)
    f = sample_statistics(frobenius)
    return {
        "source": source, "seq_len": n, "kind": kind, "method": method, "target": target,
        "num_features": m, "samples": int(spectral.numel()),
        "nonfinite": int((~torch.isfinite(spectral)).sum()),
        **{f"spectral_{k}": v for k, v in s.items()},
        "frobenius_mean": f["mean"], "frobenius_std": f["std"],
    }


def resolve_methods(names: tuple[str, ...] | None, notes: list[str]) -> list[Method]:
    """The methods to sweep: approximate methods with a ``num_features`` option."""
    explicit = names is not None
    chosen = [get_method(n) for n in (names if explicit else list_methods())]
    out = []
    for spec in chosen:
        refuse_swept_option(spec.name, spec.preset, "num_features", "approx (--features)")
        refuse_learned_options(spec, "approx")
        _refuse_other_target(spec)
        if spec.capabilities.exact:
            if explicit:
                notes.append(f"{spec.name}: skipped: exact, it is the {spec.capabilities.target} "
                             f"target itself (error 0 up to rounding).")
            continue
        if "num_features" not in spec.option_names():
            notes.append(f"{spec.name}: skipped: it has no num_features option to sweep.")
            continue
        out.append(spec)
    if not out:
        raise ValueError("no approximate method to sweep; pass --methods with at least one "
                         "method that has num_features (see `skyformer list`).")
    return out


def _refuse_other_target(spec: Method) -> None:
    """Fail in a sentence where a variant sets causal or scale away from the default: the
    targets, floors and baselines are of the non-causal attention at the default scale."""
    defaults = get_method(spec.base_name).defaults()
    for option in TARGET_OPTIONS:
        if option in dict(spec.preset) and spec.defaults()[option] != defaults[option]:
            raise ValueError(
                f"{spec.name}: approx measures every method against the non-causal "
                f"{spec.capabilities.target} attention at the default scale (its rank-m "
                f"floors and baselines too); drop {option} from the brackets.")


def _call(spec: Method, q: Tensor, k: Tensor, v: Tensor, m: int, seed: int) -> Tensor:
    """One run of ``spec`` with ``num_features=m``, bound for sequences of N tokens
    (fixed-length methods get ``max_seq_len=N``), as a function call: a method with
    learned parameters uses its untrained form (Linformer: random projections)."""
    bound = spec.bind(seq_len=q.shape[2], num_features=m)
    with torch.no_grad():
        return bound(q, k, v, generator=torch.Generator(device=q.device).manual_seed(seed))


def _draws_at(spec: Method, n: int, m: int) -> bool:
    """Whether ``spec`` bound as ``_call`` binds it draws anything: randomized, and its
    options not among those that draw nothing (``draws_nothing_because``: BigBird
    without random blocks, Reformer with one bucket). Options it refuses: True (the
    call says why)."""
    if not spec.capabilities.randomized:
        return False
    try:
        config = spec.bind(seq_len=n, num_features=m).config
    except _CALL_ERRORS:
        return True
    return getattr(config, "draws_nothing_because", None) is None


def _matrix(target: str, q: Tensor, k: Tensor) -> Tensor:
    """The materialised attention matrix of ``target`` for ``q, k: [H, N, D]``: ``[H, N, N]``."""
    if target == "softmax":
        return softmax_scores(q[None], k[None])[0]
    return gaussian_scores(q[None], k[None])[0]


class _Sweep:
    """The measurement loop; one instance per ``run_approx`` call."""

    def __init__(self, config: ApproxConfig, log: Callable[[str], None]) -> None:
        self.config = config
        self.log = log
        self.notes: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.sources: list[dict[str, Any]] = []
        self.analysis: list[dict[str, Any]] = []
        self.seconds: dict[str, float] = {}

    def _parts(self) -> dict[str, list]:
        return {part: getattr(self, part) for part in PARTS}

    @contextmanager
    def block(self, key: str, saved: ProgressFile | None) -> Iterator[bool]:
        """One block of the run (``progress`` module docstring): yields whether it is to
        be measured; False where ``saved`` holds it from before, whose parts are then
        added as they were (less the notes a block before it in this run said: a run
        with other --sources or --seq-lens says them in another block). A measured block
        is saved when it ends."""
        earlier = saved.restore(key) if saved is not None else None
        if earlier is not None:
            for part, items in earlier.items():
                if part == "notes":
                    items = [text for text in items if text not in self.notes]
                getattr(self, part).extend(items)
            yield False
            return
        start = {part: len(items) for part, items in self._parts().items()}
        yield True
        if saved is not None:
            saved.save(key, {part: items[start[part]:] for part, items in self._parts().items()})

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds wall and CPU seconds (all threads, ``cpu_<phase>``) of the block to ``phase``.
        CPU time is what to compare on a shared machine: wall time depends on its load."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            for key, value in ((phase, time.perf_counter() - wall),
                               (f"cpu_{phase}", time.process_time() - cpu)):
                self.seconds[key] = self.seconds.get(key, 0.0) + value

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(text)

    def features_for(self, n: int) -> list[int]:
        ms = sorted(m for m in set(self.config.features) if m < n)
        dropped = sorted(m for m in set(self.config.features) if m >= n)
        said = (f"N={n}: m={','.join(map(str, dropped))} dropped (m >= N: a rank-N "
                f"approximation of an N x N matrix is exact).")
        if dropped and said not in self.notes:  # the same for every source: said once
            self.note(said)
        return ms  # not empty: ApproxConfig refuses an N below every m

    def references(self, data: SourceData, targets: list[str], ms: list[int]) -> dict[str, Tensor]:
        """Exact outputs per target ``[H, N, Dv]`` (float64); records floors and baselines."""
        c = self.config
        q, k, v = (t[0].to(torch.float64) for t in (data.q, data.k, data.v))
        n = q.shape[1]
        exact = {}
        for target in targets:
            out = exact_method(target).function(q[None], k[None], v[None])[0]  # [H, N, Dv]
            exact[target] = out
            zero = _zero_heads(data, out.abs().flatten(-2).amax(-1))
            if zero:
                self.note(f"{data.source} N={n}: the exact {target} output is zero on "
                          f"{_heads_said(zero)} (every kernel entry underflows in float64: "
                          f"each query is far from every key); an error relative to it is "
                          f"undefined, recorded as NaN.")
            spectral, frob = [], []
            for h in range(q.shape[0]):
                # One head at a time: [N, N] float64 is 128 MiB at N = 4096.
                a = _matrix(target, q[h : h + 1], k[h : h + 1])[0]
                if not takes_full_svd(n, n, max(ms), oversample=c.floor_oversample,
                                      exact_below=c.floor_exact_below):
                    # The randomized path is as accurate in float32 as in float64 here
                    # (floors agree to 1e-5 relative at N = 2048) and twice as fast; the
                    # full SVD (also above floor_exact_below where m + p covers N / 2)
                    # stays in float64.
                    a = a.float()
                g = torch.Generator().manual_seed(c.data_seed)
                basis = top_singular_subspace(
                    a, max(ms), generator=g, oversample=c.floor_oversample,
                    power_iterations=c.floor_power_iterations, exact_below=c.floor_exact_below,
                ).u
                spectral.append(rank_m_floor(basis, out[h], ms, ord=2))
                frob.append(rank_m_floor(basis, out[h], ms, ord="fro"))
                del a, basis
            spectral_t = torch.stack(spectral, dim=-1)  # [len(ms), H]
            frob_t = torch.stack(frob, dim=-1)
            for i, m in enumerate(ms):
                self.rows.append(_row(data.source, n, "floor", FLOOR, target, m,
                                      spectral_t[i], frob_t[i]))
                self._samples(data, FLOOR, target, m, None, spectral_t[i], frob_t[i])
            baselines = [(CONSTANT_ROW, None)]
            if target == "softmax":
                baselines.insert(0, (MEAN_V, v.mean(dim=-2)))
            for name, row in baselines:
                s = constant_row_error(out, row, ord=2)
                f = constant_row_error(out, row, ord="fro")
                self.rows.append(_row(data.source, n, "baseline", name, target, None, s, f))
                self._samples(data, name, target, None, None, s, f)
        return exact

    def _samples(self, data: SourceData, method: str, target: str, m: int | None,
                 seed: int | None, spectral: Tensor, frob: Tensor) -> None:
        """One sample per head of ``spectral``, ``frob: [H]``, under the head's index."""
        per_head = zip(data.head_indices(), spectral.tolist(), frob.tolist(), strict=True)
        for h, s, f in per_head:
            self.samples.append({
                "source": data.source, "seq_len": data.q.shape[2], "method": method,
                "target": target, "num_features": m, "seed": seed, "head": h, "spectral": s,
                "frobenius": f,
            })

    def method(self, spec: Method, data: SourceData, exact: Tensor, ms: list[int],
               bar: Any) -> None:
        n = data.q.shape[2]
        target = spec.capabilities.target
        seeds = self.config.seeds
        # a method that draws nothing (or whose options draw nothing: BigBird without
        # random blocks) gives every seed the first one's output (the contract tests and
        # `skyformer check` hold it to that): evaluated once, after a second seed at the
        # first such m agreed (the check ran other options)
        verify, seen_drawing = len(seeds) > 1, False
        for m in ms:
            draws = seen_drawing or _draws_at(spec, n, m)
            checking = verify and not draws
            spectral, frob, first = [], [], None
            for seed in seeds:
                if spectral and not draws and not checking:
                    spectral.append(spectral[0])
                    frob.append(frob[0])
                    bar.update(1)
                    continue
                bar.set_postfix_str(f"{data.source} N={n} {spec.name} m={m} seed={seed}")
                try:
                    out = _call(spec, data.q, data.k, data.v, m, seed)
                except _CALL_ERRORS as err:
                    self.note(f"{spec.name}: skipped at N={n}, m={m} ({data.source}): {err}")
                    bar.update(len(seeds) - len(spectral))
                    spectral = []
                    break
                if first is None:
                    first = out
                elif checking:
                    checking = verify = False
                    if not torch.allclose(out, first, rtol=0, atol=0, equal_nan=True):
                        draws = seen_drawing = True
                        said = ("its options draw nothing" if spec.capabilities.randomized
                                else "not declared randomized")
                        self.note(f"{spec.name}: {said}, but seeds {seeds[0]} and {seed} "
                                  f"gave other outputs at N={n}, m={m} ({data.source}); "
                                  f"every seed is evaluated.")
                if not torch.isfinite(out).all():
                    self.note(f"{spec.name}: non-finite output at N={n}, m={m}, seed={seed} "
                              f"({data.source}); its error is recorded as NaN.")
                s = relative_error(out[0], exact, ord=2)  # [H]
                f = relative_error(out[0], exact, ord="fro")
                spectral.append(torch.where(torch.isfinite(s), s, torch.nan))
                frob.append(torch.where(torch.isfinite(f), f, torch.nan))
                bar.update(1)
            if not spectral:
                continue
            for seed, s, f in zip(seeds, spectral, frob, strict=True):
                self._samples(data, spec.name, target, m, seed, s, f)
            # the row's spread is over distinct outputs: a method that draws nothing has
            # one per head, and its seeds' copies would shrink the std and move quartiles
            distinct = len(spectral) if draws else 1
            self.rows.append(_row(data.source, n, "method", spec.name, target, m,
                                  torch.stack(spectral[:distinct]),
                                  torch.stack(frob[:distinct])))


def _zero_heads(data: SourceData, largest: Tensor) -> list[int]:
    """The heads (as results name them) whose matrix has ``largest: [H]`` entry zero or
    subnormal: nothing left to measure relative to."""
    tiny = torch.finfo(torch.float64).tiny
    return [h for h, x in zip(data.head_indices(), largest.tolist(), strict=True) if x < tiny]


def _heads_said(heads: list[int]) -> str:
    """``"head 3"``, ``"heads 0, 1"``."""
    return ("head " if len(heads) == 1 else "heads ") + ", ".join(map(str, heads))


def _longest(config: ApproxConfig) -> tuple[int, str]:
    """The longest sequence the run loads and the option(s) that ask for it."""
    asked = [(n, "--seq-lens") for n in config.seq_lens] if config.sweep else []
    if config.analysis:
        asked.append((config.analysis_seq_len, "--analysis-len"))
    longest = max(n for n, _ in asked)
    return longest, " / ".join(dict.fromkeys(flag for n, flag in asked if n == longest))


def _refuse_what_cannot_fit(config: ApproxConfig, available: float) -> None:
    """A sentence, before anything loads, where the run would hold more than ``available``
    bytes at once: at least one head's [N, N] float64 attention matrix in the sweep, and
    each head's [2N, 2N] float64 lifted kernel matrix (Theorem 2) in the analysis. A
    length past memory otherwise ran until the system killed it, or said only "out of
    memory"."""
    heads = len(config.heads) if config.heads else 1  # None (all): at least one
    parts = []
    if config.sweep:
        n = max(config.seq_lens)
        parts.append((8 * n * n, n, "--seq-lens", "the [N, N] float64 attention matrix of a "
                      "head"))
    if config.analysis:
        n = config.analysis_seq_len
        parts.append((32 * heads * n * n, n, "--analysis-len",
                      f"the [2N, 2N] float64 lifted kernel matrix of {heads} "
                      f"head{'s' if heads > 1 else ''}"))
    for needed, n, flag, held in parts:
        if needed > available:
            raise ValueError(f"{flag} {n}: approx holds at least {needed / 2**30:.1f} GiB at "
                             f"once at N = {n} ({held}), more than the "
                             f"{available / 2**30:.1f} GiB free; pass a shorter {flag} (the "
                             f"published study goes to N = 4096).")


def analyse_source(data: SourceData, config: ApproxConfig) -> dict[str, Any]:
    """Spectra (softmax matrix, its residuals after KDEformer's LSH blocks and after the
    oracle mask with as many entries per row, outputs) and Theorem 2 leverage
    quantities of one source's Q/K/V; JSON-ready."""
    q, k, v = data.q[0], data.k[0], data.v[0]
    block = config.residual_block
    masks = {"lsh": lsh_mask(block, config.lsh_bits, config.data_seed),
             "oracle": oracle_mask(block)}
    described = {
        "lsh": f"angular LSH, {config.lsh_bits} hyperplanes, equal-sized buckets of {block} "
               f"(KDEformer Def. A.3)",
        "oracle": f"each row's {block} largest entries (oracle)",
    }
    spectra = attention_spectra(q, k, v, masks)
    out: dict[str, Any] = {
        "source": data.source,
        "seq_len": q.shape[1],
        "description": data.description,
        "softmax_srank": spectra.softmax_srank.tolist(),
        "output_srank": spectra.output_srank.tolist(),
        "layer_output_srank": float(spectra.layer_output_srank),
        "residuals": [
            {"mask": r.mask, "description": described[r.mask], "density": r.density.tolist(),
             "srank": r.stable_rank.tolist(), "singular_values": r.singular_values.tolist()}
            for r in spectra.residuals
        ],
        "spectra": {
            "softmax": spectra.softmax.tolist(),
            "output": spectra.output.tolist(),
            "layer_output": spectra.layer_output.tolist(),
        },
        "leverage": [],
    }
    for eps in config.eps:
        lev = leverage_analysis(q, k, eps, delta=config.delta)
        out["leverage"].append({
            "eps": eps, "delta": config.delta, "n": lev.n,
            "theorem_constant": THEOREM_CONSTANT,
            "norm_c": lev.norm_c.tolist(), "lambda": lev.lam.tolist(),
            "d_stat": lev.d_stat.tolist(), "max_leverage": lev.max_leverage.tolist(),
            "beta": lev.beta.tolist(), "d_theorem": lev.d_theorem.tolist(),
            "d_shape": lev.d_shape.tolist(), "leverage_sorted": lev.leverage.tolist(),
        })
    return out


def run_approx(config: ApproxConfig = ApproxConfig(), *,
               log: Callable[[str], None] | None = None,
               progress_file: str | os.PathLike[str] | None = None,
               resume: bool = False) -> ApproxResult:
    """Run the study; returns the results table (``rows``) and everything else measured.

    ``log`` receives notes (skipped methods, dropped m, concatenated windows) as they
    happen; default: the ``skyformer.approx`` logger (the ``skyformer`` command prints it).
    ``progress_file``: where to save each block of the run as it ends (``progress``
    module); with ``resume``, the blocks an earlier run with the same settings saved
    there are taken instead of measured (the numbers are the same). The file stays after
    the run: remove it once the results are saved (``skyformer approx`` does so after
    writing them), or a later run with ``resume`` takes its blocks again; unless the
    result's ``progress_left`` names blocks of it that this run did not ask for (other
    lengths or sources), which only the file holds.
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    cpu_started = time.process_time()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    stamps = data_stamps(config)  # before any is read
    sweep = _Sweep(config, log or get_logger("approx").info)
    methods = resolve_methods(config.methods, sweep.notes)
    saved = None if progress_file is None else ProgressFile(
        progress_file, config, resume=resume, methods=[m.name for m in methods])
    for text in sweep.notes:
        sweep.log(text)
    targets = sorted({s.capabilities.target for s in methods}, key=("softmax", "gaussian").index)
    loader = SourceLoader(config.source_options())
    _refuse_what_cannot_fit(config, available_bytes())
    longest, setting = _longest(config)
    for source in config.sources:  # a text too short or a head missing fails before the sweep
        loader.check(source, longest, setting)
    per_n = {n: len([m for m in set(config.features) if m < n]) for n in config.seq_lens}
    total = len(config.sources) * len(methods) * len(config.seeds) * sum(per_n.values())
    total = total if config.sweep else 0
    with tqdm(total=total, unit="run", desc="approx", disable=None if config.progress else True,
              leave=False) as bar:
        for source in config.sources:
            for n in config.seq_lens if config.sweep else ():
                with sweep.block(block_key("sweep", source, n), saved) as measure:
                    if measure:
                        _sweep_block(sweep, loader, source, n, methods, targets, bar)
                    else:  # its dropped m, where no block before it in this run noted them
                        sweep.features_for(n)
                        bar.update(len(methods) * len(config.seeds) * per_n[n])
            if config.analysis:
                with sweep.block(block_key("analysis", source), saved) as measure:
                    if measure:
                        _analysis_block(sweep, loader, source, bar)
    if saved is not None and saved.resumed:
        sweep.note(f"resumed: {blocks_said(saved.resumed)} (a source at one length, or "
                   f"its analysis) measured by an earlier run, taken from {saved.path}; "
                   f"seconds counts this run's blocks only.")
    sweep.seconds["total"] = time.perf_counter() - started
    sweep.seconds["cpu_total"] = time.process_time() - cpu_started
    env = environment(torch.device("cpu"))
    if load_before is not None:
        env["loadavg_before"] = [round(x, 2) for x in load_before]
        env["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    env["methods"] = [s.name for s in methods]
    return ApproxResult(config, sweep.rows, sweep.samples, sweep.analysis,
                        _listed_once(sweep.sources), sweep.notes, env, sweep.seconds,
                        list(saved.left_out) if saved is not None else [], stamps)


def _listed_once(sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Q/K/V loaded, less an analysis's where the sweep loaded the same source and N
    (every analysis block lists its own, so that a run resumed with other --seq-lens
    lists it where its sweep does not)."""
    swept = {(s["source"], s["seq_len"]) for s in sources if s["part"] == "sweep"}
    return [s for s in sources
            if s["part"] == "sweep" or (s["source"], s["seq_len"]) not in swept]


def _sweep_block(sweep: _Sweep, loader: SourceLoader, source: str, n: int,
                 methods: list[Method], targets: list[str], bar: Any) -> None:
    """Every method, m and seed on ``source`` at length ``n``, with targets and floors."""
    with sweep.timed("load"):
        data = loader.load(source, n)
    sweep.sources.append({"source": source, "seq_len": n, "part": "sweep",
                          "description": data.description, "windows": data.windows})
    if data.windows > 1:
        sweep.note(f"{source} N={n}: Q/K/V concatenated from {data.windows} windows "
                   f"of the model's position limit.")
    ms = sweep.features_for(n)
    with sweep.timed("targets_and_floors"):
        exact = sweep.references(data, targets, ms)
    with sweep.timed("methods"):
        for spec in methods:
            sweep.method(spec, data, exact[spec.capabilities.target], ms, bar)


def _analysis_block(sweep: _Sweep, loader: SourceLoader, source: str, bar: Any) -> None:
    """The spectra and leverage analysis of ``source`` (``analyse_source``)."""
    n = sweep.config.analysis_seq_len
    with sweep.timed("analysis"):
        bar.set_postfix_str(f"{source} analysis N={n}")
        data = loader.load(source, n)
        sweep.sources.append({"source": source, "seq_len": n, "part": "analysis",
                              "description": data.description, "windows": data.windows})
        sweep.analysis.append(analyse_source(data, sweep.config))
    block = sweep.config.residual_block
    if block >= n:  # the sparse part holds every entry: nothing is left to have a rank
        sweep.note(f"{source} N={n}: --residual-block {block} covers every key, so the "
                   f"residuals are zero and their stable ranks 0 by convention; pass a "
                   f"block below {n} to measure them.")
    for lev in sweep.analysis[-1]["leverage"][:1]:  # ||C||_2 is the same for every eps
        zero = _zero_heads(data, torch.tensor(lev["norm_c"], dtype=torch.float64))
        if zero:
            sweep.note(f"{source} N={n}: ||C||_2 = 0 on {_heads_said(zero)} (every Gaussian "
                       f"kernel entry underflows in float64): lambda = eps ||C||_2 = 0 and "
                       f"Theorem 2 says nothing there; its quantities are NaN.")


__all__ = [
    "CONSTANT_ROW",
    "FLOOR",
    "MEAN_V",
    "QUICK",
    "SOURCES",
    "ApproxConfig",
    "ApproxResult",
    "analyse_source",
    "quick_config",
    "resolve_methods",
    "run_approx",
]
