"""The experiments' "spectral" error columns hold the spectral norm (Skyformer section
3.5), not the Frobenius norm the same runs also report: each run's calls of
``relative_error`` are recorded, and the spectral column is recomputed from them."""

from __future__ import annotations

import pytest
import torch

from skyformer.eval.measure import metrics

SPECTRAL, FROBENIUS = 2, "fro"


@pytest.fixture
def recorded(monkeypatch):
    """Patches ``relative_error`` in the given run module: every (out, exact) pair it
    saw, whatever ``ord`` the run asked for."""
    pairs = []

    def record(module):
        def relative_error(approx, exact, ord=2):
            pairs.append((approx.detach().clone(), exact.detach().clone()))
            return metrics.relative_error(approx, exact, ord=ord)

        monkeypatch.setattr(module, "relative_error", relative_error)
        return pairs

    return record


def errors(pairs, ord):
    """Each recorded pair's mean error in ``ord``, without repeats."""
    values = [metrics.relative_error(a, e, ord=ord).mean().item() for a, e in pairs]
    return sorted(set(values))


def check_column(column, pairs):
    spectral, frobenius = errors(pairs, SPECTRAL), errors(pairs, FROBENIUS)
    assert all(min(abs(c - s) for s in spectral) < 1e-9 for c in column), (column, spectral)
    assert any(min(abs(c - f) for f in frobenius) > 1e-3 for c in column)  # they differ here


def test_bench_rel_error_is_the_spectral_norm(recorded):
    import skyformer.eval.bench.run as bench_run
    from skyformer.eval.bench import BenchConfig, run_bench

    pairs = recorded(bench_run)
    result = run_bench(BenchConfig(methods=("skyformer", "linear"), seq_lens=(64,),
                                   shapes=((1, 2, 8),), num_features=8, repeats=1, warmup=0,
                                   memory=False))
    check_column([r["rel_error"] for r in result.rows if r["method"] != "softmax"], pairs)


def test_compare_spectral_error_is_the_spectral_norm(recorded):
    import skyformer.eval.compare.run as compare_run
    from skyformer.eval.data.qkv import QKV

    pairs = recorded(compare_run)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 8, generator=g) for _ in range(3))
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    rows = compare_run.compare_on(qkv, compare_run.CompareConfig(
        methods=("skyformer", "linear"), repeats=1, memory=False, num_features=8))
    # [H] per method: the mean of the per-head spectral errors
    spectral_heads = [metrics.relative_error(a, e, ord=SPECTRAL)[0] for a, e in pairs]
    for row in rows:
        assert any(abs(row["spectral_error"] - s.mean().item()) < 1e-9
                   for s in spectral_heads), row
        assert abs(row["spectral_error"] - row["frobenius_error"]) > 1e-3


def test_approx_spectral_columns_are_the_spectral_norm(recorded):
    import skyformer.eval.approx.run as approx_run
    from skyformer.eval.approx import ApproxConfig, run_approx

    pairs = recorded(approx_run)
    result = run_approx(ApproxConfig(sources=("gaussian",), seq_lens=(48,), features=(8,),
                                     seeds=(0,), heads=(0,), methods=("skyformer",),
                                     analysis=False, progress=False), log=lambda s: None)
    line = [r for r in result.rows if r.get("kind") == "method"]
    assert line
    spectral = errors(pairs, SPECTRAL)
    for row in line:
        assert min(abs(row["spectral_mean"] - s) for s in spectral) < 1e-9, row
        assert abs(row["spectral_mean"] - row["frobenius_mean"]) > 1e-3
