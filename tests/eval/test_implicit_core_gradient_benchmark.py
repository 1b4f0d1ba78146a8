"""benchmarks/implicit_core_gradient.py on small random inputs (no model): its patch
really makes the core's gradient the implicit one, which differs from the unrolled
gradient where the iteration has not converged and equals it where it has."""

from __future__ import annotations

import functools
import json
from unittest import mock

import pytest
import torch

import skyformer
from tests.benchmark_scripts import load_benchmark

benchmark = load_benchmark("implicit_core_gradient")


def inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 48, 8, dtype=torch.float64, generator=g) for _ in range(4))


@functools.cache  # read only
def row(gamma: float, iterations: int, float32: bool = False) -> dict:
    (found,) = benchmark.study(*inputs(), features=[16], iterations=[iterations],
                               seeds=[0, 1], gamma=gamma, float32=float32)
    return found


def test_unconverged_core_gives_another_gradient():
    found = row(gamma=0.1, iterations=1)
    assert found["residual"]["max"] > 1e-2
    for g in ("dq", "dk"):  # a patch that did nothing would give 0 here
        assert found["implicit_vs_unrolled"][g]["max"] > 1e-3
    assert found["implicit_vs_unrolled"]["dv"]["max"] == 0.0  # same forward pass


def test_converged_core_gives_the_same_gradient():
    found = row(gamma=100.0, iterations=6)  # lambda_min(A) > 0.8: converged to rounding
    assert found["lambda_min"]["min"] > 0.8 and found["residual"]["max"] < 1e-13
    for g in ("dq", "dk", "dv"):
        assert found["implicit_vs_unrolled"][g]["max"] < 1e-10
        assert found["implicit_vs_exact"][g]["max"] < 1e-10
        assert found["draws"][g]["median"] > 1e-3  # another draw is another gradient


@pytest.mark.parametrize("iterations", [4, 6, 8])
def test_coinciding_landmarks_reach_the_residual_bound(iterations):
    q = torch.full((1, 1, 40, 8), 0.3, dtype=torch.float64)  # every row the same
    v = torch.randn(1, 1, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    record: list[dict] = []
    with benchmark.implicit_core(record):
        skyformer.attention(q, q, v, "skyformer", num_features=16, pinv_iterations=iterations,
                            kernel="torch", generator=skyformer.random_key(0))
    (found,) = record
    assert found["lambda_min"][0] == pytest.approx(0.1 / 16.1, rel=1e-9)
    bound = benchmark.residual_bound(16, 0.1, iterations)
    assert found["residual"][0] == pytest.approx(bound, rel=1e-9, abs=1e-12)  # rounding
    assert bound > 1e-3 if iterations <= 6 else bound < 1e-12


def test_a_patch_without_effect_is_reported():
    q, k, v, cotangent = inputs()
    same = benchmark.gradients(q, k, v, cotangent, features=16, seed=0)
    with pytest.raises(RuntimeError, match="unchanged"):
        benchmark.check_patch(same, same, [{"iterations": 6}], 6)
    with pytest.raises(RuntimeError, match="did not call"):
        benchmark.check_patch(same, same, [], 6)


def test_float32_gradients_are_near_the_float64_ones():
    found = row(gamma=100.0, iterations=6, float32=True)
    for name in ("float32_unrolled", "float32_implicit"):
        assert 1e-9 < found[name]["dq"]["max"] < 1e-4  # float32 rounding, not another gradient


def test_markdown_has_a_line_per_row():
    found = row(gamma=100.0, iterations=6, float32=True)
    rows = [{"N": 48, "layer": 0, **found}, {"N": 48, "layer": None, **found}]
    lines = benchmark.markdown(rows).splitlines()
    assert sum(line.startswith("| 16 | 6 | ") for line in lines) == 3  # float64, 32, clustered
    assert sum(line.startswith("| 48 | 0 | 16 | 6 |") for line in lines) == 2  # the rest
    assert sum(line.startswith("| 48 | clustered | 16 | 6 |") for line in lines) == 2


def test_clustered_inputs_put_lambda_min_near_its_bound():
    q, k, v, cotangent = benchmark.clustered_inputs(64, 1, 32, seed=0)
    record: list[dict] = []
    benchmark.gradients(q, k, v, cotangent, features=16, seed=0, implicit=True, record=record)
    assert 0.1 / 16.1 <= record[0]["lambda_min"][0] < 2 * 0.1 / 16.1


def _cost_benchmark():
    """benchmarks/implicit_gradient_cost.py as a module."""
    return load_benchmark("implicit_gradient_cost")


def test_the_cost_benchmark_times_both_gradients(tmp_path):
    """benchmarks/implicit_gradient_cost.py at a tiny size: every call timed for both
    gradients and for the implicit one by the steps, the table and the JSON written."""
    cost = _cost_benchmark()
    out = tmp_path / "cost"
    argv = ["--heads", "2", "--features", "8", "--seq-lens", "40", "--repeats", "1",
            "--out", str(out)]
    assert cost.main(argv) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["config"]["heads"] == 2 and saved["config"]["seq_lens"] == [40]
    assert saved["command"] == "python benchmarks/implicit_gradient_cost.py " + " ".join(argv)
    times = saved["ms"]
    assert set(times) == {f"{call} {variant}"
                          for variant in ("unrolled", "implicit", "implicit-steps")
                          for call in ("core fwd", "core fwd+bwd", "N=40")}
    assert all(t > 0 for t in times.values())
    rows = out.with_suffix(".md").read_text().splitlines()[4:]
    assert [row.split(" | ")[0] for row in rows] == ["| core fwd", "| core fwd+bwd", "| N=40"]


def test_the_cost_benchmarks_steps_variant_runs_the_steps():
    """``implicit-steps`` forms the inverse by the steps on the CPU, ``implicit`` by the
    factorisation (what the two columns claim to compare)."""
    cost = _cost_benchmark()
    from skyformer.linalg import implicit_inverse

    solvers = []

    def recorded(name):
        real = getattr(implicit_inverse, name)
        return mock.patch.object(implicit_inverse, name,
                                 lambda *args, **kwargs: solvers.append(name)
                                 or real(*args, **kwargs))

    with recorded("newton_steps"), recorded("_factorised_inverse"):
        for variant in ("implicit", "implicit-steps"):
            _, context = cost._as_variant(variant)
            with context:
                implicit_inverse.implicit_pinv(torch.eye(4).expand(2, 4, 4), 3)
    assert solvers == ["_factorised_inverse", "newton_steps"]
