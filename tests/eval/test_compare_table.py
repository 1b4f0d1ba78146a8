"""The compare table keeps its columns apart for method names of any length."""

from __future__ import annotations

from skyformer.eval.compare import format_table


def test_long_method_names_do_not_run_into_the_target_column():
    row = {"method": "skyformer_multipole_long_name", "target": "gaussian", "exact": False,
           "num_features": 128, "spectral_error": 0.1, "spectral_error_std": 0.01,
           "frobenius_error": 0.2, "time_ms": 1.0, "peak_mib": None}
    lines = format_table([row]).splitlines()
    assert lines[2].split()[:2] == ["skyformer_multipole_long_name", "gaussian"]
    assert lines[0].index("target") == lines[2].index("gaussian")


def test_rows_worse_than_the_trivial_answer_are_marked_with_a_legend():
    base = {"target": "softmax", "exact": False, "num_features": 32, "spectral_error_std": 0.0,
            "frobenius_error": 0.2, "time_ms": 1.0, "peak_mib": None, "trivial_error": 0.5}
    rows = [{**base, "method": "good", "spectral_error": 0.3, "worse_than_trivial": False},
            {**base, "method": "bad", "spectral_error": 0.9, "worse_than_trivial": True}]
    lines = format_table(rows).splitlines()
    assert "trivial" in lines[0]
    assert "0.3000 +- 0.0000 " in lines[2] and "!" not in lines[2]
    assert "0.9000 +- 0.0000!" in lines[3] and "0.5000" in lines[3]
    assert lines[-1].startswith("trivial: spectral error of the better trivial answer")


def test_compare_rows_carry_the_trivial_error_of_their_target():
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float64) for _ in range(3))
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    rows = compare_on(qkv, CompareConfig(methods=("softmax", "linear"), repeats=1,
                                         memory=False))
    by_name = {r["method"]: r for r in rows}
    assert by_name["softmax"]["spectral_error"] < 1e-10
    assert not by_name["softmax"]["worse_than_trivial"]
    assert 0 < by_name["linear"]["trivial_error"] == by_name["softmax"]["trivial_error"]


def test_a_failed_memory_measurement_keeps_the_compare_rows(monkeypatch):
    import pytest
    import torch

    import skyformer.eval.measure.memory as memory
    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV

    def fails(job, device="cpu", timeout=600):
        raise RuntimeError(f"memory measurement of {job.method} took more than 0.01 s")

    monkeypatch.setattr(memory, "peak_memory_bytes", fails)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    with pytest.warns(UserWarning, match="linear: peak memory not measured: memory "
                                         "measurement of linear took more"):
        rows = compare_on(qkv, CompareConfig(methods=("softmax", "linear"), repeats=1))
    assert [r["method"] for r in rows] == ["softmax", "linear"]
    assert all(r["peak_mib"] is None and r["time_ms"] > 0 for r in rows)


def test_a_variant_is_compared_with_the_target_of_its_causal_and_scale():
    """``softmax[causal=True]`` and ``kernelized[scale=0.5]`` are their own targets: error
    0, not their distance to the non-causal target at the default scale; a causal row's
    trivial answer is the causal one (row i = the mean of v_0..v_i)."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV
    from skyformer.eval.measure.metrics import trivial_error
    from skyformer.ops.softmax import softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    names = ("softmax", "softmax[causal=True]", "softmax[scale=0.5]", "kernelized[scale=0.5]",
             "linear[causal=True]")
    rows = {r["method"]: r for r in compare_on(qkv, CompareConfig(methods=names, repeats=1,
                                                                    memory=False))}
    for name in names[:4]:
        assert rows[name]["spectral_error"] < 1e-10, name
    causal = trivial_error(v, softmax_attention(q, k, v, causal=True), causal=True)
    assert rows["linear[causal=True]"]["trivial_error"] == causal
    assert rows["softmax[causal=True]"]["trivial_error"] == causal != rows["softmax"][
        "trivial_error"]


def test_rows_of_randomized_methods_record_their_seed():
    """A randomized method's error depends on the seed it drew with: its row says which;
    a deterministic method's row has none (``None``)."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    rows = compare_on(qkv, CompareConfig(methods=("softmax", "performer"), seed=5, repeats=1,
                                         memory=False))
    assert [r["seed"] for r in rows] == [None, 5]


def test_every_batch_element_counts_in_the_errors():
    """Q/K/V of several sequences, ``[B, H, N, D]``: the errors are the mean over every
    sequence's heads, as the trivial answer's, not those of the first sequence alone."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV
    from skyformer.eval.measure.metrics import relative_error
    from skyformer.ops.linear import linear_attention
    from skyformer.ops.softmax import softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q[1] *= 4  # the second sequence's softmax is sharper: linear's error there is larger
    qkv = QKV(q, k, v, model="gaussian", pretrained=False, layer=0, windows=1)
    row, = compare_on(qkv, CompareConfig(methods=("linear",), repeats=1, memory=False))
    out, exact = linear_attention(q, k, v), softmax_attention(q, k, v)
    spectral = relative_error(out, exact, ord=2)  # [2, 2]
    assert abs(spectral[0].mean() - spectral[1].mean()) > 0.05  # the two sequences differ
    assert abs(row["spectral_error"] - spectral.mean().item()) < 1e-12
    assert abs(row["spectral_error_std"] - spectral.std().item()) < 1e-12
    frobenius = relative_error(out, exact, ord="fro")
    assert abs(row["frobenius_error"] - frobenius.mean().item()) < 1e-12


def test_compare_on_takes_plain_tensors():
    """Q/K/V of one's own, ``(q, k, v)``, need no model name, layer or window count."""
    import pytest
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    config = CompareConfig(methods=("softmax", "linear"), repeats=1, memory=False)
    plain = compare_on((q, k, v), config)
    captured = compare_on(QKV(q, k, v, model="m", pretrained=False, layer=0, windows=1),
                          config)
    for a, b in zip(plain, captured, strict=True):
        assert a["spectral_error"] == b["spectral_error"]
        assert a["trivial_error"] == b["trivial_error"]
    with pytest.raises(TypeError, match=r"compare_on takes the queries, keys and values as "
                                        r"\(q, k, v\), three tensors \[B, H, N, D\], or a QKV; "
                                        r"got a dict"):
        compare_on({"q": q, "k": k, "v": v}, config)


def test_more_keys_than_queries_bind_methods_for_the_keys():
    """Own Q/K/V with Nk > Nq: a fixed-length method is bound for the Nk keys it holds
    (Linformer was bound for Nq and refused them), and the features column is what the
    call runs with (Nystromformer's landmarks are capped by max(Nq, Nk), not Nq)."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 8, generator=g)
    k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(2))
    rows = compare_on((q, k, v), CompareConfig(methods=("linformer", "nystromformer"),
                                               num_features=16, repeats=1, memory=False))
    assert [r["num_features"] for r in rows] == [16, 16]
    assert all(0 < r["spectral_error"] < 2 for r in rows)


def test_a_method_that_cannot_run_the_inputs_gets_a_row_saying_why():
    """Cross-attention (Nq != Nk), which BigBird and Reformer cannot do: their rows say
    "not supported" with the sentence, the other methods are measured, and the table
    counts the rows without numbers."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 8, generator=g)
    k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(2))
    rows = compare_on((q, k, v), CompareConfig(methods=("softmax", "bigbird", "reformer",
                                                        "linear"), repeats=1, memory=False))
    by_name = {r["method"]: r for r in rows}
    assert [r["method"] for r in rows] == ["softmax", "bigbird", "reformer", "linear"]
    assert by_name["softmax"]["status"] == by_name["linear"]["status"] == "ok"
    assert 0 < by_name["linear"]["spectral_error"] < 2
    for name in ("bigbird", "reformer"):
        assert by_name[name]["status"] == "not supported"
        assert by_name[name]["reason"].startswith(
            f"{name} cannot attend with a different number of queries and keys")
        assert by_name[name]["spectral_error"] is None and by_name[name]["time_ms"] is None
    lines = format_table(rows).splitlines()
    assert "not supported: bigbird cannot attend" in lines[3]
    assert "2 of 4 methods not measured" in format_table(rows)


def test_bad_tensors_fail_before_any_method_runs():
    """Inputs no method can take are refused up front in a sentence, not turned into a
    row per method."""
    import pytest
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on

    q = torch.randn(1, 2, 12, 8)
    config = CompareConfig(methods=("bigbird", "linear"), repeats=1, memory=False)
    with pytest.raises(ValueError, match="compare_on: q and k must have the same head dim"):
        compare_on((q, torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 8)), config)
    with pytest.raises(ValueError, match=r"compare_on: empty input"):
        compare_on((q[:, :, :0],) * 3, config)


def test_a_bad_number_of_features_is_refused_before_the_model_loads():
    """--features 0 used to load the model and give every method a "not supported" row
    with exit status 0; bench, approx and hf-eval refuse it up front."""
    import pytest

    from skyformer.cli import main
    from skyformer.eval.compare.run import CompareConfig

    for bad in (0, -5, True, 2.5):
        with pytest.raises(ValueError, match=r"num_features \(--features\) must be a "
                                             r"positive integer, got"):
            CompareConfig(num_features=bad)
    assert main(["compare", "--features", "0", "--methods", "skyformer"]) == 2


def test_cpu_peaks_below_the_measurements_resolution_are_not_printed_as_numbers(
        monkeypatch):
    """A CPU peak under ``CPU_RESOLUTION_BYTES`` says only "small" (as ``bench`` takes no
    ratio and draws no point of it): the table shows "<1", the row says so, and a peak
    above it is printed as measured."""
    import torch

    import skyformer.eval.measure.memory as memory
    from skyformer.eval.compare.run import CompareConfig, compare_on

    peaks = {"softmax": 200 * 1024, "linear": 3 * 2**20}
    monkeypatch.setattr(memory, "peak_memory_bytes",
                        lambda job, device="cpu", timeout=600: peaks[job.method])
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    rows = compare_on((q, k, v), CompareConfig(methods=("softmax", "linear"), repeats=1))
    assert [r["peak_below_resolution"] for r in rows] == [True, False]
    assert rows[1]["peak_mib"] == 3.0
    lines = format_table(rows).splitlines()
    assert lines[2].split()[-1] == "<1" and lines[3].split()[-1] == "3.0"
    assert any("below the measurement's resolution" in line for line in lines[4:])


def test_the_table_and_the_result_file_say_what_every_column_is():
    """Whoever prints ``compare_on``'s rows (not only ``skyformer compare``) reads what
    each column measures, over what its spread is taken and in which unit; the result
    file describes its row keys the same way."""
    import torch

    from skyformer.eval.compare.report import COLUMNS
    from skyformer.eval.compare.run import CompareConfig, CompareResult, compare_on

    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    config = CompareConfig(methods=("softmax", "linear"), repeats=1, memory=False)
    rows = compare_on((q, k, v), config)
    legend = "\n".join(format_table(rows).splitlines()[4:])
    assert "spectral err: relative spectral-norm error" in legend
    assert "mean +- sample std over the B * H heads (4 heads here)" in legend
    for column in ("frob err:", "time ms:", "peak MiB:", "features:"):
        assert column in legend, column
    described = CompareResult(config, "mine", rows).to_dict()["columns"]
    assert described == COLUMNS
    assert set(described) <= set(rows[0]) and "time_ms" in described


def test_half_precision_inputs_are_measured_against_a_float32_target():
    """bfloat16 Q/K/V: the exact target is computed in float32 from them (as ``bench``
    does), so softmax's own bfloat16 rounding shows as an error instead of being the
    reference every other method is measured against."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.measure.metrics import relative_error
    from skyformer.ops.softmax import softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).bfloat16() for _ in range(3))
    row, = compare_on((q, k, v), CompareConfig(methods=("softmax",), repeats=1,
                                               memory=False))
    exact = softmax_attention(q.float(), k.float(), v.float())
    expected = relative_error(softmax_attention(q, k, v), exact).mean().item()
    assert expected > 1e-4
    assert abs(row["spectral_error"] - expected) < 1e-9


def test_a_causal_variant_on_more_keys_than_queries_is_not_supported():
    """``causal=True`` needs Nq == Nk: the methods refuse it in a sentence (a ValueError,
    as every check of inputs against options), which is a configuration they do not
    support, not a failure of the call."""
    import torch

    from skyformer.eval.compare.run import CompareConfig, compare_on

    q = torch.randn(1, 2, 12, 8)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    rows = compare_on((q, k, v), CompareConfig(methods=("linear[causal=True]", "linear"),
                                               repeats=1, memory=False))
    assert rows[0]["status"] == "not supported"
    assert rows[0]["reason"] == "linear: causal=True needs as many queries as keys, got " \
                                "Nq=12, Nk=20."
    assert rows[1]["status"] == "ok"


def test_non_finite_inputs_are_named_in_a_warning():
    """A table of NaNs said nothing of why: the inputs holding NaN or inf are named."""
    import math

    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    k[0, 1, 3, 0] = float("nan")
    with pytest.warns(UserWarning, match=r"compare_on: k \(1 entries\) hold NaN or inf"):
        rows = compare_on((q, k, v), CompareConfig(methods=("performer",), memory=False,
                                                   repeats=1))
    assert math.isnan(rows[0]["spectral_error"])  # what the warning explains
