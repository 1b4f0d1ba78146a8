"""``skyformer compare``: every registered method against its exact target on real Q/K/V.

For each method: relative spectral-norm error of the output against the exact
attention it approximates (softmax or Gaussian kernelized, per its capabilities),
mean and spread over heads, relative Frobenius error, forward time and peak memory.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..io import environment
from ..registry import attention, get_method, list_methods
from .memory import MemoryJob, peak_memory_bytes
from .metrics import relative_error
from .qkv import QKV, load_qkv
from .text import read_text
from .timing import median_seconds

EXACT_METHOD = {"softmax": "softmax", "gaussian": "kernelized"}


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
            "rows": self.rows,
        }


def memory_job(method: str, shape: tuple[int, int, int, int], options: dict[str, Any],
               seed: int, inputs: str) -> MemoryJob:
    """The peak-memory job of the call ``compare`` times: the method's bare function
    (a job given the registered name would call it as inside a layer, with its
    per-layer state, which e.g. Linformer only has for a fixed ``max_seq_len``)."""
    function = get_method(method).function
    return MemoryJob(f"{function.__module__}:{function.__name__}", shape, options,
                     seed=seed, inputs=inputs)


def _options(method: str, num_features: int | None) -> dict[str, Any]:
    spec = get_method(method)
    if num_features is not None and "num_features" in spec.option_names():
        return {"num_features": num_features}
    return {}


def compare_on(qkv: QKV, config: CompareConfig) -> list[dict[str, Any]]:
    """Rows of the comparison on given Q/K/V ``[1, H, N, D]``."""
    methods = list(config.methods) if config.methods else list_methods()
    for m in methods:
        get_method(m)  # unknown names fail before any work
    q, k, v = qkv.q, qkv.k, qkv.v
    exact: dict[str, Tensor] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "qkv.pt"
        torch.save({"q": q, "k": k, "v": v}, inputs)
        for name in methods:
            spec = get_method(name)
            target = spec.capabilities.target
            if target not in exact:
                with torch.no_grad():
                    exact[target] = attention(q, k, v, EXACT_METHOD[target])
            options = _options(name, config.num_features)

            def run(name: str = name, options: dict[str, Any] = options) -> Tensor:
                g = torch.Generator(device=q.device).manual_seed(config.seed)
                with torch.no_grad():
                    return attention(q, k, v, name, generator=g, **options)

            out = run()
            spectral = relative_error(out, exact[target], ord=2)[0]  # [H]
            frobenius = relative_error(out, exact[target], ord="fro")[0]
            seconds = median_seconds(run, device=q.device, warmup=1, repeats=config.repeats)
            peak = None
            if config.memory:
                job = memory_job(name, tuple(q.shape), options, config.seed, str(inputs))
                peak = peak_memory_bytes(job, q.device)
            rows.append(
                {
                    "method": name,
                    "target": target,
                    "exact": spec.capabilities.exact,
                    "num_features": options.get("num_features", spec.defaults().get("num_features")),
                    "spectral_error": spectral.mean().item(),
                    "spectral_error_std": spectral.std().item() if spectral.numel() > 1 else 0.0,
                    "frobenius_error": frobenius.mean().item(),
                    "time_ms": seconds * 1e3,
                    "peak_mib": None if peak is None else peak / 2**20,
                }
            )
    return rows


def compare(config: CompareConfig = CompareConfig()) -> CompareResult:
    """Load real Q/K/V (default: pretrained MiniLM-L6 on shipped text) and compare."""
    qkv = load_qkv(
        seq_len=config.seq_len, layer=config.layer, text=read_text(config.text),
        model_dir=config.model, pretrained=config.pretrained, seed=config.seed,
    )
    rows = compare_on(qkv, config)
    return CompareResult(config, qkv.describe(), rows, environment(qkv.q.device))


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of compare rows (the method column fits the longest name)."""
    width = max([18] + [len(r["method"]) + 2 for r in rows])
    header = f"{'method':<{width}}{'target':<10}{'features':>9}{'spectral err':>22}{'frob err':>10}{'time ms':>10}{'peak MiB':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        feats = "exact" if r["exact"] else str(r["num_features"] if r["num_features"] is not None else "-")
        err = f"{r['spectral_error']:.4f} +- {r['spectral_error_std']:.4f}"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        lines.append(
            f"{r['method']:<{width}}{r['target']:<10}{feats:>9}{err:>22}{r['frobenius_error']:>10.4f}"
            f"{r['time_ms']:>10.2f}{peak:>10}"
        )
    return "\n".join(lines)
