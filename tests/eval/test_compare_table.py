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
    assert lines[0].index("worst") + len("worst") == lines[2].index(" 0.5000") - 2  # "-"
    assert "worst: largest spectral error over the same heads" in format_table(rows)
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


def test_a_variant_needing_learned_weights_is_refused_before_any_work():
    import pytest

    from skyformer.eval.compare.run import CompareConfig

    with pytest.raises(ValueError, match=r"nystromformer\[conv_kernel=3\]: conv_kernel=3 "
                                         r"convolves V with learned weights, and compare"):
        CompareConfig(methods=("nystromformer[conv_kernel=3]",))


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
    assert abs(row["spectral_error_max"] - spectral.max().item()) < 1e-12  # the worst head
    assert abs(row["spectral_error_median"] - spectral.flatten().quantile(0.5).item()) < 1e-12
    assert f"{spectral.max().item():.4f}" in format_table([row]).splitlines()[2]
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
    assert "mean +- sample std over those with a finite error (all but nonfinite) of the " \
           "B * H heads (4 heads here)" in legend
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
    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    k[0, 1, 3, 0] = float("nan")
    with pytest.warns(UserWarning, match=r"compare_on: k \(1 entries\) hold NaN or inf: .* "
                                         r"left out of every row's mean and std"):
        rows = compare_on((q, k, v), CompareConfig(methods=("performer",), memory=False,
                                                   repeats=1))
    assert rows[0]["nonfinite"] == 1  # what the warning explains


def test_a_mask_without_real_keys_is_named_in_a_warning():
    """A mask of torch's convention (True = padding) gave "n of m heads not finite",
    whose legend blames NaN or inf: the batch elements without a real key are named."""
    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    q, k, v = (torch.randn(2, 2, 16, 4) for _ in range(3))
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 12:] = True  # torch's convention: element 0 has no True, i.e. no real key
    with pytest.warns(UserWarning, match=r"no real key in batch element\(s\) 0, so their "
                                         r"outputs are all zero.*pass ~mask"):
        compare_on((q, k, v), CompareConfig(methods=("performer",), memory=False, repeats=1),
                   key_padding_mask=padding)


def test_a_gaussian_target_that_underflows_is_explained_and_marks_no_method():
    """Q, K of large norm: every Gaussian kernel entry is 0, so the kernelized output
    is zero and no head has an error. The rows read "not finite" with '!' on the exact
    method itself, and nothing said why; a warning names the underflow and the rows of
    that target carry no '!' (the softmax rows are measured as before)."""
    import warnings

    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    config = CompareConfig(methods=("kernelized", "skyformer", "softmax"), memory=False,
                           repeats=1)
    with pytest.warns(UserWarning, match=r"the exact gaussian output is all zero on 2 of 2 "
                                         r"heads: every kernel entry .* underflows"):
        rows = {r["method"]: r for r in compare_on((60 * q, 60 * k, v), config)}
    for name in ("kernelized", "skyformer"):
        assert rows[name]["nonfinite"] == 2 and not rows[name]["worse_than_trivial"]
    assert rows["softmax"]["nonfinite"] == 0 and rows["softmax"]["spectral_error"] < 1e-6
    table = format_table(list(rows.values())).splitlines()
    assert not [line for line in table if line.startswith(tuple(rows)) and "!" in line]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ordinary inputs: nothing to say
        compare_on((q, k, v), config)


SPOILED_METHODS = ("softmax", "linear", "nystromformer")  # deterministic: heads alone agree


def test_a_nan_in_one_head_leaves_the_others_measured():
    """One NaN made every row "nan +- nan" though the other heads were finite: the
    heads it reaches are left out of the mean, the std and the trivial answer, which are
    those of the clean heads alone, and counted in the row and in the table."""
    import math

    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
    config = CompareConfig(methods=SPOILED_METHODS, repeats=1, memory=False,
                           num_features=4)
    clean = compare_on((q[:, :2], k[:, :2], v[:, :2]), config)
    q[0, 2, 5, 1] = float("nan")
    with pytest.warns(UserWarning, match=r"q \(1 entries\) hold NaN or inf"):
        rows = compare_on((q, k, v), config)
    for row, alone in zip(rows, clean, strict=True):
        assert row["samples"] == 3 and row["nonfinite"] == 1, row
        for key in ("spectral_error", "spectral_error_std", "frobenius_error",
                    "trivial_error"):
            assert math.isfinite(row[key]), (row["method"], key)
            assert row[key] == pytest.approx(alone[key], rel=1e-9, abs=1e-12), key
    table = format_table(rows).splitlines()
    assert all(line.endswith("  1 of 3 heads not finite") for line in table[2:5])
    assert any(line.startswith("n of m heads not finite: heads whose spectral error is not "
                               "finite") for line in table[5:])
    assert not any("heads not finite" in line for line in format_table(clean).splitlines())


def test_a_method_not_finite_on_a_measured_head_has_nan_statistics(monkeypatch):
    """Where the exact output is finite and the method's is not, the method failed:
    its mean and std are NaN, as ``approx``'s rows (it must not read as if it had no
    hard heads), and the head is counted."""
    import dataclasses
    import math

    import torch

    from skyformer import registry
    from skyformer.eval.compare import CompareConfig, compare_on
    from skyformer.registry import Capabilities, Method

    @dataclasses.dataclass(frozen=True)
    class Options:
        num_features: int = 8

    def broken(q, k, v, *, key_padding_mask=None, generator=None, num_features=8):
        out = torch.zeros_like(v) + v.mean(-2, keepdim=True)
        out[:, 1, 0, 0] = float("inf")
        return out

    monkeypatch.setitem(registry._REGISTRY, "broken_on_one_head", Method(
        "broken_on_one_head", broken, Options, Capabilities(target="softmax"), "test"))
    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    row, = compare_on((q, k, v), CompareConfig(methods=("broken_on_one_head",), repeats=1,
                                               memory=False))
    assert row["nonfinite"] == 1 and row["samples"] == 2
    assert math.isnan(row["spectral_error"]) and math.isnan(row["frobenius_error"])
    # marked as no better than the trivial answer (NaN compared as neither, unmarked)
    assert row["worse_than_trivial"] and math.isfinite(row["trivial_error"])


def test_more_heads_than_tokens_warn_of_a_forgotten_transpose():
    """[B, N, H, D] tensors read as [B, H, N, D] run as N heads of H tokens, with
    meaningless, excellent-looking errors: a warning says so (not an error: a model may
    have that many heads on short inputs), and names the fix."""
    import warnings

    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on
    from skyformer.eval.data.qkv import QKV

    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    config = CompareConfig(methods=("softmax",), repeats=1, memory=False)
    saved = tuple(t.transpose(1, 2) for t in (q, k, v))  # [1, 16, 2, 4]
    with pytest.warns(UserWarning, match=r"more heads \(H=16\) than tokens \(Nq=2, Nk=2\)"
                                         r".*\[B, N, H, D\].*q\.transpose\(1, 2\)"):
        row, = compare_on(saved, config)
    assert row["status"] == "ok"  # measured all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare_on((q, k, v), config)
        compare_on((q[:, :, :1], k, v), config)  # one query, more keys than heads
        # a captured QKV's layout is known, whatever its length
        compare_on(QKV(*saved, model="m", pretrained=False, layer=0, windows=1), config)


def test_a_key_padding_mask_measures_what_truncation_does():
    """Padding is left out of the exact target, of the trivial answer and of every
    method: a padded sequence's rows are those of the sequence cut to its real tokens,
    whatever the padding holds (NaN included, with no warning)."""
    import warnings

    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 11:] = False
    for t in (q, k, v):
        t[1, :, 11:] = float("nan")
    config = CompareConfig(methods=SPOILED_METHODS, repeats=1, memory=False,
                           num_features=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = compare_on((q, k, v), config, key_padding_mask=mask)
    whole = compare_on((q[:1], k[:1], v[:1]), config)
    cut = compare_on((q[1:, :, :11], k[1:, :, :11], v[1:, :, :11]), config)
    for row, first, second in zip(rows, whole, cut, strict=True):
        assert row["nonfinite"] == 0 and row["samples"] == 4
        for key in ("spectral_error", "frobenius_error"):  # two heads each
            assert row[key] == pytest.approx((first[key] + second[key]) / 2, rel=1e-6), key
    cut_trivial = compare_on((q[:, :, :11], k[:, :, :11], v[:, :, :11]),
                             CompareConfig(methods=("softmax",), repeats=1, memory=False))
    q[1, :, 11:] = k[1, :, 11:] = v[1, :, 11:] = 0.0
    mask[0, 11:] = False  # both sequences cut at 11: the trivial answer of the cut ones
    row, = compare_on((q, k, v), CompareConfig(methods=("softmax",), repeats=1,
                                               memory=False), key_padding_mask=mask)
    assert row["trivial_error"] == pytest.approx(cut_trivial[0]["trivial_error"], rel=1e-9)


def test_a_causal_target_with_a_mask_takes_the_trivial_answer_of_the_real_prefix():
    """With ``causal`` and a mask, the trivial answer's row i is the mean of the real
    values up to i: what the sequence cut to its real tokens gives."""
    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 9:] = False
    config = CompareConfig(methods=("linear[causal=True]",), repeats=1, memory=False)
    row, = compare_on((q, k, v), config, key_padding_mask=mask)
    cut, = compare_on((q[:, :, :9], k[:, :, :9], v[:, :, :9]), config)
    for key in ("spectral_error", "trivial_error"):
        assert row[key] == pytest.approx(cut[key], rel=1e-9), key


def test_a_malformed_key_padding_mask_is_refused_before_anything_runs():
    import pytest
    import torch

    from skyformer.eval.compare import CompareConfig, compare_on

    q, k, v = (torch.randn(2, 2, 16, 4) for _ in range(3))
    config = CompareConfig(methods=("softmax",), repeats=1, memory=False)
    with pytest.raises(TypeError, match=r"compare_on: key_padding_mask must be a bool tensor "
                                        r"\(True = real token\).*mask == 1"):
        compare_on((q, k, v), config, key_padding_mask=torch.ones(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, Nk\] = "
                                         r"\[2, 16\], got \(2, 15\)"):
        compare_on((q, k, v), config, key_padding_mask=torch.ones(2, 15, dtype=torch.bool))


def test_the_legend_says_linformer_runs_untrained_projections():
    """compare calls Linformer as a function, drawing fresh untrained projections every
    call: its time (mostly the drawing) and its error (above the trivial answer) read as
    the method's without a word."""
    from skyformer.eval.compare.report import legend

    said = legend([{"method": "linformer", "samples": 4}, {"method": "softmax", "samples": 4}])
    assert said[-1].startswith("linformer: learned parameters, here drawn anew and untrained "
                               "at every call")
    assert not any("untrained" in line for line in legend([{"method": "softmax",
                                                            "samples": 4}]))


def test_features_with_exact_methods_only_is_said_to_change_nothing(monkeypatch, capsys):
    """``compare --methods softmax --features 64`` ran with no method that has features,
    without a word; one that has them makes the note go."""
    import skyformer.cli.compare_cmd as compare_cmd
    from skyformer.cli import main

    monkeypatch.setattr(compare_cmd, "compare", lambda config: compare_cmd.CompareResult(
        config, "stub", [], {}))
    assert main(["compare", "--methods", "softmax", "--features", "64"]) == 0
    assert "note: --features 64 changes nothing: softmax has no number of features" in \
        capsys.readouterr().err
    assert main(["compare", "--methods", "softmax", "skyformer", "--features", "64"]) == 0
    assert "note" not in capsys.readouterr().err
