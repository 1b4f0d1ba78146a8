"""``skyformer bench`` in tiny configurations: result schema, ratios, skips, files."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil

import pytest
import torch

from skyformer.cli import main
from skyformer.eval.bench import BenchConfig, crossover, run_bench, summarise
from skyformer.eval.bench.report import format_table, format_wide, write_results
from skyformer.eval.measure.flops import attention_flops, matmul_flops_per_second
from skyformer.eval.methods import resolve
from skyformer.linalg import implicit_iterations

MATERIALISED = "skyformer.ops.skyformer:materialised_skyformer_attention@gaussian"
ROW_KEYS = {
    "method", "spec", "device", "dtype", "batch", "heads", "head_dim", "n", "target", "exact",
    "num_features", "status", "reason", "fwd_ms", "fwd_bwd_ms", "peak_mib", "rel_error",
    "trivial_error", "gflop",
    "sol_ms", "sol_fraction", "speedup", "memory_ratio", "growth", "load_avg", "run",
}


@pytest.fixture(scope="module")
def tiny():
    config = BenchConfig(
        methods=("skyformer", MATERIALISED),
        seq_lens=(64, 128),
        shapes=((1, 2, 8),),
        num_features=16,
        repeats=1,
        warmup=0,
        memory=False,
    )
    return run_bench(config)


def test_rows_have_the_schema_and_sensible_values(tiny):
    rows = tiny.rows
    assert [(r["method"], r["n"]) for r in rows] == [
        (m, n)
        for n in (64, 128)
        for m in ("softmax", "skyformer", "materialised_skyformer_attention")
    ]  # the reference is added first
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert (r["batch"], r["heads"], r["head_dim"], r["dtype"], r["device"]) == (
            1,
            2,
            8,
            "float32",
            "cpu",
        )
        assert r["speedup"] == pytest.approx(
            next(x["fwd_bwd_ms"] for x in rows if x["method"] == "softmax" and x["n"] == r["n"])
            / r["fwd_bwd_ms"]
        )
    by = {(r["method"], r["n"]): r for r in rows}
    assert by[("softmax", 64)]["rel_error"] < 1e-5 and by[("softmax", 64)]["speedup"] == 1.0
    for n in (64, 128):
        sky, before = by[("skyformer", n)], by[("materialised_skyformer_attention", n)]
        assert sky["num_features"] == 16 and sky["target"] == "gaussian"
        # the fused path and the materialised one approximate equally well
        assert 0 < sky["rel_error"] == pytest.approx(before["rel_error"], rel=1e-4)
        assert sky["gflop"] > 0 and sky["sol_fraction"] > 0 and before["gflop"] is None
    assert by[("skyformer", 128)]["growth"] == pytest.approx(
        by[("skyformer", 128)]["fwd_bwd_ms"] / by[("skyformer", 64)]["fwd_bwd_ms"])
    assert {s["method"] for s in tiny.summary} == {
        "softmax",
        "skyformer",
        "materialised_skyformer_attention",
    }
    for s in tiny.summary:  # the reference has no crossover with itself
        assert s["crossover"] in ((None,) if s["method"] == "softmax" else
                                  ("never", "at most", "interpolated"))
        assert math.isfinite(s["exponent"])
    assert tiny.matmul_gflops["float32"] > 0
    assert "torch" in tiny.environment and "load_average_start" in tiny.environment


def test_files_and_table(tiny, tmp_path):
    paths = write_results(tiny, tmp_path / "bench", command="skyformer bench ...")
    assert sorted(p.suffix for p in paths) == [".csv", ".json", ".png"]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data) == {"config", "environment", "matmul_gflops", "runs", "rows", "summary",
                         "command", "complete"}
    assert [run["command"] for run in data["runs"]] == ["skyformer bench ..."]
    assert data["complete"] is True
    assert data["config"]["seq_lens"] == [64, 128] and len(data["rows"]) == 6
    with open(tmp_path / "bench.csv") as handle:  # metadata lines, then the rows
        lines = [line for line in handle if not line.startswith("# ")]
        assert set(next(csv.reader(lines))) == ROW_KEYS
    table = format_table(tiny)
    assert "skyformer" in table and "speed-up" in table and "B=1 H=2 D=8 float32 cpu" in table
    # what precedes the timed calls, and what the memory column counts
    assert "times: median of 1 after an untimed first call and 0 warm-up" in table
    assert ("peak MiB: the peak of one forward+backward call above its inputs and the output "
            "gradient") in table
    assert format_table(tiny, markdown=True).count("| skyformer |") == 2
    wide = format_wide(tiny)
    assert (
        "| method | N=64 | N=128 |" in wide and wide.count("| skyformer |") == 3
    )  # time, error, SOL
    assert "faster than softmax" in wide or "slower than softmax" in wide


def test_small_ratios_keep_their_digits_in_both_tables(tiny):
    """A method 250 times slower and lighter showed 0.00x and 0 % in the narrow table
    and in the wide table's memory column: two significant digits below 0.1x, one below
    1 %."""
    rows = [dict(r) for r in tiny.rows]
    for r in rows:
        if r["method"] == "skyformer":
            r.update(speedup=0.0042, memory_ratio=0.0031, peak_mib=1.0, sol_fraction=0.004)
    slow = dataclasses.replace(tiny, rows=rows)
    table, wide = format_table(slow), format_wide(slow)
    assert "0.0042x" in table and "0.0031x" in table and "0.4%" in table
    assert "0.00x" not in table and " 0% " not in table
    assert "(0.0031x)" in wide and "| 0.4% |" in wide and "(0.00x)" not in wide
    copy = dataclasses.replace(tiny, rows=[dict(r) for r in tiny.rows])  # tiny is shared
    row = next(r for r in copy.rows if r["method"] == "skyformer" and r["speedup"])
    for speedup, shown in ((0.0417, "(0.0417x)"), (12.51, "(12.5x)"), (1234.5, "(1234x)")):
        row["speedup"] = speedup  # far slower: not 0.0x; far faster: not 1.23e+03x
        assert shown in format_wide(copy)


def test_memory_and_skips(capsys, monkeypatch):
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_flops", lambda *args: None)  # no floor: see below
    config = BenchConfig(methods=("skyformer",), seq_lens=(64, 128), shapes=((1, 1, 8),),
                         num_features=8, repeats=1, warmup=0, max_seconds=1e-9, clock="cpu",
                         error=False)
    rows = run_bench(config).rows
    first = [r for r in rows if r["n"] == 64]
    # measured in a fresh process each (tiny: may be 0 pages above the resident size)
    assert all(r["status"] == "ok" and r["peak_mib"] >= 0 and not r["reason"] for r in first)
    second = [r for r in rows if r["n"] == 128]
    assert all(r["status"] == "skipped" and "predicted" in r["reason"] for r in second)
    # a prediction under a second reads as its value, not as "predicted 0 s"
    assert all("predicted 0 s" not in r["reason"] and "(> max_seconds = 1e-09)" in r["reason"]
               for r in second)


def test_the_first_length_is_bounded_by_its_operations_at_the_matmul_rate(monkeypatch):
    """--max-seconds predicted from the lengths before: the first length of a sweep ran
    whatever it cost (N = 2,000,000 of softmax for hours), and so did the exact target of
    the error column."""
    import skyformer.eval.bench.run as bench_run

    config = BenchConfig(methods=("softmax",), seq_lens=(64,), shapes=((1, 1, 8),),
                         repeats=1, warmup=0, max_seconds=1e-9, memory=False)
    (row,) = run_bench(config).rows
    assert row["status"] == "skipped" and row["reason"].startswith("at least ") \
        and "s per call, its operations at this run's matmul rate (> max_seconds = 1e-09)" \
        in row["reason"]
    monkeypatch.setattr(bench_run, "_flops", lambda *args: 0.0)  # the call itself: free
    (row,) = run_bench(config).rows
    assert row["status"] == "ok" and row["rel_error"] is None
    assert "relative error not measured: exact attention, its target, takes at least" \
        in row["reason"]


def test_command_line(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["bench", "--methods", "skyformer", "--seq-lens", "64", "--shapes", "1,1,8",
                 "--features", "8", "--repeats", "1", "--warmup", "0", "--no-memory",
                 "--out", str(out), "--no-plot"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "skyformer" in printed and "load average" in printed
    assert json.loads(out.with_suffix(".json").read_text())["rows"][1]["method"] == "skyformer"
    assert main(["bench", "--methods", "nope", "--no-memory"]) == 2
    assert "unknown attention method 'nope'" in capsys.readouterr().err
    assert main(["bench", "--min-n", "64", "--max-n", "32", "--no-memory"]) == 2
    capsys.readouterr()
    # lengths given twice: --seq-lens, and --min-n / --max-n that would make them
    for extra in (["--min-n", "8"], ["--max-n", "64"]):
        assert main(["bench", "--seq-lens", "16", *extra, "--no-memory"]) == 2
        err = capsys.readouterr().err
        assert f"--seq-lens 16 with {extra[0]} {extra[1]}" in err and "not both" in err
    # a method never timed: its rows say why, and no crossover is claimed for it
    assert main(["bench", "--methods", "linear", "tests.eval.failing_method:attention@softmax",
                 "--seq-lens", "16", "32", "--shapes", "1,1,4", "--repeats", "1", "--warmup",
                 "0", "--no-memory", "--out", str(tmp_path / "failing"), "--no-plot"]) == 0
    printed = capsys.readouterr().out
    assert "this method always fails" in printed
    notes = [line.strip() for line in printed.splitlines()
             if line.strip().startswith("attention:")]
    assert notes == ["attention: skipped at N = 16, 32 (the rows say why)"]
    # one that fails at the longer length: its summary says so, and speaks of the rest
    assert main(["bench", "--methods", "tests.eval.failing_method:short_attention@softmax",
                 "--seq-lens", "16", "32", "--shapes", "1,1,4", "--repeats", "1", "--warmup",
                 "0", "--no-memory"]) == 0
    notes = [line.strip() for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("short_attention:")]
    assert len(notes) == 1 and "of the lengths it ran" in notes[0] \
        and notes[0].endswith("skipped at N = 32 (the rows say why)"), notes
    # a method whose output holds a NaN: timed, its error NaN (null in the file), no stop
    assert main(["bench", "--methods", "tests.eval.failing_method:nan_attention@softmax",
                 "--seq-lens", "32", "--shapes", "1,2,16", "--repeats", "1", "--warmup", "0",
                 "--no-memory", "--out", str(tmp_path / "nan"), "--no-plot"]) == 0
    rows = json.loads((tmp_path / "nan.json").read_text())["rows"]
    assert [r["rel_error"] for r in rows if r["method"].endswith("nan_attention")] == [None]


@pytest.mark.parametrize("flag", ["--no-plot", "--no-plots"])
def test_no_plot_without_out_says_it_has_nothing_to_leave_out(capsys, monkeypatch, flag):
    """Without --out no file is written: --no-plot is said to do nothing, not ignored."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: [])
    assert main(["bench", "--methods", "softmax", "--seq-lens", "16", flag]) == 0
    assert "--no-plot changes nothing without --out" in capsys.readouterr().err


def test_options_that_change_nothing_are_said_to(capsys, monkeypatch):
    """--pause without --timing blocked, and --features where no method has features,
    were taken without a word; with a method that reads them nothing is said."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: [])
    base = ["bench", "--seq-lens", "16"]
    assert main([*base, "--methods", "softmax", "kernelized", "--pause", "2",
                 "--features", "8"]) == 0
    err = capsys.readouterr().err
    assert "note: --pause 2 changes nothing with --timing interleaved" in err
    assert "note: --features 8 changes nothing: none of softmax, kernelized has a number " \
        "of features to set" in err
    assert main([*base, "--methods", "softmax", "skyformer", "--pause", "2", "--features",
                 "8", "--timing", "blocked"]) == 0
    assert "note" not in capsys.readouterr().err


def test_a_cpu_clock_on_several_threads_says_it_adds_them(capsys, monkeypatch):
    """--clock cpu sums the CPU time of every thread: with more than one, a note says
    to pass --threads 1; with one, nothing is said."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: [])
    threads = torch.get_num_threads()
    try:
        args = ["bench", "--methods", "softmax", "--seq-lens", "16", "--clock", "cpu"]
        assert main([*args, "--threads", "2"]) == 0
        assert "pass --threads 1" in capsys.readouterr().err
        assert main([*args, "--threads", "1"]) == 0
        assert "--threads 1" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_an_interrupted_run_keeps_its_lengths_and_resume_measures_only_the_rest(
        tmp_path, capsys, monkeypatch):
    """--out is written after every length; an interruption at N = 128 leaves the N = 64
    rows (marked incomplete); --resume keeps them as they were, measures N = 128 and
    N = 256, and refuses other settings with a sentence naming them."""
    import skyformer.eval.bench.run as bench_run

    out = tmp_path / "resumable"
    argv = ["bench", "--methods", "skyformer", "--shapes", "1,1,8", "--features", "8",
            "--repeats", "1", "--warmup", "0", "--no-memory", "--out", str(out), "--no-plot"]
    measure = bench_run._measure_length
    measured_lengths = []

    def interrupted_at_128(config, methods, labels, shape, n, *rest):
        measured_lengths.append(n)
        if n == 128:
            raise KeyboardInterrupt
        return measure(config, methods, labels, shape, n, *rest)

    monkeypatch.setattr(bench_run, "_measure_length", interrupted_at_128)
    assert main([*argv, "--seq-lens", "64", "128"]) == 130
    partial = json.loads(out.with_suffix(".json").read_text())
    assert partial["complete"] is False
    assert out.with_suffix(".csv").read_text().startswith("# complete: false\n")  # CSV too
    assert [(r["method"], r["n"]) for r in partial["rows"]] == [("softmax", 64),
                                                               ("skyformer", 64)]
    monkeypatch.setattr(bench_run, "_measure_length", measure)
    capsys.readouterr()
    # the command again without --resume: refused, the measured rows kept
    assert main([*argv, "--seq-lens", "64", "128"]) == 2
    assert (f"{out.with_suffix('.json')} holds a run that stopped before its end (N = 64 "
            f"measured): pass --resume to continue it" in capsys.readouterr().err)
    assert json.loads(out.with_suffix(".json").read_text()) == partial
    assert main([*argv, "--seq-lens", "64", "128", "256", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "2 rows measured before" in err
    assert "N=    64" not in err and "N=   128" in err and "N=   256" in err
    final = json.loads(out.with_suffix(".json").read_text())
    assert final["complete"] is True
    assert out.with_suffix(".csv").read_text().startswith("# complete: true\n")
    assert [r["n"] for r in final["rows"]] == [64, 64, 128, 128, 256, 256]
    for before, after in zip(partial["rows"], final["rows"][:2], strict=True):
        assert after["fwd_bwd_ms"] == before["fwd_bwd_ms"]
    # each row says which run measured it; both runs' environments and commands are kept
    assert [r["run"] for r in final["rows"]] == [0, 0, 1, 1, 1, 1]
    assert [run["command"].endswith("--resume") for run in final["runs"]] == [False, True]
    assert final["runs"][1]["environment"] == final["environment"]
    assert final["rows"][2]["growth"] is None  # N = 128 against N = 64: another run's
    assert final["rows"][4]["growth"] is not None  # N = 256 against N = 128: this run's
    # --resume once every length is there: nothing measured, no run added to the file
    finished = out.with_suffix(".json").read_text()
    assert main([*argv, "--seq-lens", "64", "128", "256", "--resume"]) == 0
    assert "nothing to resume: " in capsys.readouterr().err
    assert out.with_suffix(".json").read_text() == finished
    assert main([*argv, "--seq-lens", "64", "--resume", "--repeats", "2"]) == 2
    assert ("other settings or on another machine (--repeats 1 -> 2: pass --repeats 1)"
            in capsys.readouterr().err)
    # without --resume a finished run is replaced, and the command says so
    elsewhere = tmp_path / "replaced"
    shutil.copy(out.with_suffix(".json"), elsewhere.with_suffix(".json"))
    assert main([*argv[:-2], str(elsewhere), "--no-plot", "--seq-lens", "64"]) == 0
    assert (f"note: replacing {elsewhere.with_suffix('.json')} (a finished run, N = 64, "
            f"128, 256); --resume adds to it instead, another --out keeps it."
            in capsys.readouterr().err)
    assert [r["n"] for r in json.loads(elsewhere.with_suffix(".json").read_text())["rows"]
            ] == [64, 64]
    assert main(["bench", "--resume", "--no-memory"]) == 2
    assert "give --out" in capsys.readouterr().err

    # fewer lengths: refused, since rewriting the file would lose the rows left out
    before = out.with_suffix(".json").read_text()
    assert main([*argv, "--seq-lens", "128", "256", "--resume"]) == 2
    assert ("holds 2 rows this run does not ask for (N = 64, or other shapes or dtypes), "
            "which rewriting it would lose; ask for them too (--seq-lens 64 128 256"
            in capsys.readouterr().err)
    assert out.with_suffix(".json").read_text() == before
    # the rows asked for again are kept, and lose their stale ratios
    kept = json.loads(before)
    kept["rows"] = [r for r in kept["rows"] if r["n"] != 64]
    kept["complete"] = False  # as an interrupted run's: a finished one is left as it is
    out.with_suffix(".json").write_text(json.dumps(kept))
    assert main([*argv, "--seq-lens", "128", "256", "--resume"]) == 0
    shorter = json.loads(out.with_suffix(".json").read_text())
    assert [r["n"] for r in shorter["rows"]] == [128, 128, 256, 256]
    assert shorter["rows"][1]["growth"] is None and shorter["rows"][3]["growth"] is not None
    # a file from before a setting existed (here: causal) ran with its default
    older = json.loads(out.with_suffix(".json").read_text())
    del older["config"]["causal"]
    out.with_suffix(".json").write_text(json.dumps(older))
    assert main([*argv, "--seq-lens", "128", "256", "--resume"]) == 0
    # another machine (here: another torch) is refused
    shorter["environment"]["torch"] = "0.0"
    out.with_suffix(".json").write_text(json.dumps(shorter))
    assert main([*argv, "--seq-lens", "128", "--resume"]) == 2
    assert f"torch 0.0 -> {torch.__version__}: resume with torch 0.0" in capsys.readouterr().err


RESUMED_BASE = {"methods": ("softmax", "skyformer"), "seq_lens": (16,), "shapes": ((1, 1, 8),),
                "num_features": 8, "repeats": 1, "warmup": 0}


@pytest.mark.parametrize(("setting", "value", "said"), [
    ("methods", ("softmax", "linear"),
     "--methods softmax skyformer -> softmax linear: pass --methods softmax skyformer"),
    ("dtypes", ("float64",), "--dtypes float32 -> float64: pass --dtypes float32"),
    ("num_features", 16, "--features 8 -> 16: pass --features 8"),
    ("repeats", 2, "--repeats 1 -> 2: pass --repeats 1"),
    ("warmup", 1, "--warmup 0 -> 1: pass --warmup 0"),
    ("backward", False, "the earlier run had no --forward-only: leave it out"),
    ("memory", False, "the earlier run had no --no-memory: leave it out"),
    ("error", False, "the earlier run had no --no-error: leave it out"),
    ("seed", 1, "--seed 0 -> 1: pass --seed 0"),
    ("max_seconds", 5.0, "--max-seconds 60.0 -> 5.0: pass --max-seconds 60.0"),
    ("reference", "skyformer", "reference 'softmax' -> 'skyformer': set reference='softmax'"),
    ("clock", "cpu", "--clock wall -> cpu: pass --clock wall"),
    ("causal", True, "the earlier run had no --causal: leave it out"),
    ("timing", "blocked", "--timing interleaved -> blocked: pass --timing interleaved")])
def test_resume_refuses_rows_measured_with_another_setting(setting, value, said):
    """Every setting a row's numbers depend on is compared with the earlier file's: rows
    measured with 8 features (or another seed, clock, ...) are not kept beside rows of
    16 (the device is part of each row's key, so other devices' rows are never kept).
    The sentence names the option and the value to pass (it named the setting's field,
    "repeats: 1 -> 2", and said "resume with the same ones")."""
    from skyformer.eval.bench.resume import resumable_rows
    from skyformer.eval.bench.run import run_environment
    from skyformer.io import json_ready

    earlier = {"config": json_ready(dataclasses.asdict(BenchConfig(**RESUMED_BASE))),
               "environment": json_ready(run_environment(torch.device("cpu"))), "rows": []}
    assert resumable_rows(BenchConfig(**RESUMED_BASE), earlier) == ([], [])
    with pytest.raises(ValueError) as refused:
        resumable_rows(BenchConfig(**{**RESUMED_BASE, setting: value}), earlier)
    assert f"other settings or on another machine ({said}); resume with the earlier ones" \
        in str(refused.value)


def test_resume_names_the_thread_option_and_the_count_to_pass():
    """Another thread count was said as "torch_threads: 1 -> 2", a field of the file."""
    from skyformer.eval.bench.resume import resumable_rows
    from skyformer.eval.bench.run import run_environment
    from skyformer.io import json_ready

    environment = json_ready(run_environment(torch.device("cpu")))
    threads = environment["torch_threads"]
    earlier = {"config": json_ready(dataclasses.asdict(BenchConfig(**RESUMED_BASE))),
               "environment": {**environment, "torch_threads": threads + 1}, "rows": []}
    with pytest.raises(ValueError, match=rf"\(--threads {threads + 1} -> {threads}: pass "
                                         rf"--threads {threads + 1}\)"):
        resumable_rows(BenchConfig(**RESUMED_BASE), earlier)


def test_resume_takes_the_same_methods_and_dtypes_in_another_order():
    """Their order is only the table's: --methods linear skyformer resumes a run of
    --methods skyformer linear (it was refused as another setting); so does --methods
    skyformer a run of --methods softmax skyformer (softmax runs either way: it was
    refused, the lists given compared instead of those that run)."""
    from skyformer.eval.bench.resume import resumable_rows
    from skyformer.eval.bench.run import run_environment
    from skyformer.io import json_ready

    base = {**RESUMED_BASE, "dtypes": ("float32", "float64")}
    environment = json_ready(run_environment(torch.device("cpu")))
    ran = BenchConfig(**base).method_names()
    # the methods run as the file keeps them, and as a file from before takes them
    for env in ({**environment, "methods": ran}, environment):
        earlier = {"config": json_ready(dataclasses.asdict(BenchConfig(**base))),
                   "environment": env, "rows": []}
        swapped = {**base, "methods": ("skyformer", "softmax"), "dtypes": ("float64", "float32")}
        assert resumable_rows(BenchConfig(**swapped), earlier) == ([], [])
        assert resumable_rows(BenchConfig(**{**base, "methods": ("skyformer",)}),
                              earlier) == ([], [])
        with pytest.raises(ValueError, match=r"\(--methods softmax skyformer -> softmax "
                                             r"linear: pass --methods softmax skyformer\)"):
            resumable_rows(BenchConfig(**{**base, "methods": ("linear",)}), earlier)


def test_resume_without_methods_compares_the_methods_that_ran():
    """Without --methods the config says None (every method) in both runs: a run whose
    registry held another method (--plugin, another version) was resumed, and its
    lengths held different rows. The file now keeps the methods that ran."""
    from skyformer.eval.bench.resume import resumable_rows
    from skyformer.eval.bench.run import run_environment
    from skyformer.io import json_ready

    every = {**RESUMED_BASE, "methods": None}
    environment = json_ready(run_environment(torch.device("cpu")))
    ran = BenchConfig(**every).method_names()
    earlier = {"config": json_ready(dataclasses.asdict(BenchConfig(**every))),
               "environment": {**environment, "methods": ran}, "rows": []}
    assert resumable_rows(BenchConfig(**every), earlier) == ([], [])
    earlier["environment"]["methods"] = [*ran, "local_window"]
    with pytest.raises(ValueError, match=r"\(--methods .* local_window -> .*: pass --methods "
                                         r".* local_window\)"):
        resumable_rows(BenchConfig(**every), earlier)
    del earlier["environment"]["methods"]  # a file from before they were kept
    assert resumable_rows(BenchConfig(**every), earlier) == ([], [])


def test_resume_compares_the_pause_only_where_the_calls_were_timed_in_blocks():
    """The pause changes nothing where the calls are interleaved: rows measured with
    another pause are kept then, and refused where either run timed in blocks."""
    from skyformer.eval.bench.resume import resumable_rows
    from skyformer.eval.bench.run import run_environment
    from skyformer.io import json_ready

    def earlier(**settings):
        return {"config": json_ready(dataclasses.asdict(BenchConfig(**RESUMED_BASE,
                                                                    **settings))),
                "environment": json_ready(run_environment(torch.device("cpu"))), "rows": []}

    assert resumable_rows(BenchConfig(**RESUMED_BASE, pause=0.0), earlier()) == ([], [])
    with pytest.raises(ValueError, match=r"\(--pause 1\.0 -> 0\.0: pass --pause 1\.0\)"):
        resumable_rows(BenchConfig(**RESUMED_BASE, timing="blocked", pause=0.0),
                       earlier(timing="blocked"))


@pytest.mark.parametrize("text", ["[1, 2]", '{"rows": 5}', '{"config": [], "rows": []}',
                                  '{"config": {}, "environment": {}, "rows": [1]}'])
def test_resume_from_a_file_that_is_not_a_bench_result_gets_a_sentence(tmp_path, capsys, text):
    """JSON of another shape (a list, rows that are not a list of rows) is named as not a
    bench result file, not a traceback or a list of settings that differ."""
    out = tmp_path / "other"
    out.with_suffix(".json").write_text(text)
    assert main(["bench", "--methods", "linear", "--seq-lens", "16", "--out", str(out),
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "not a bench result file" in err and "Traceback" not in err, err


@pytest.mark.parametrize("key", ["n", "status", "fwd_bwd_ms"])
def test_resume_from_rows_without_a_key_gets_a_sentence(tmp_path, capsys, key):
    """A result file whose rows lack a key bench writes (edited, or of another version)
    is refused with a sentence naming the keys, not a KeyError."""
    out = tmp_path / "edited"
    argv = ["bench", "--methods", "linear", "--seq-lens", "16", "--shapes", "1,1,4",
            "--repeats", "1", "--warmup", "0", "--no-memory", "--no-plot", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    del data["rows"][1][key]
    out.with_suffix(".json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"its rows lack {key}, which bench writes" in err and "Traceback" not in err, err


def test_non_finite_numbers_are_null_in_the_file_and_resume_reads_them(
        tmp_path, capsys, monkeypatch):
    """--max-seconds inf and an error that came out NaN are null in OUT.json (strict
    JSON); --resume takes that file back as the same settings, the error shown as "-"."""
    import skyformer.eval.bench.run as bench_run

    out = tmp_path / "strict"
    argv = ["bench", "--methods", "skyformer", "--shapes", "1,1,8", "--features", "8",
            "--repeats", "1", "--warmup", "0", "--no-memory", "--out", str(out), "--no-plot",
            "--max-seconds", "inf", "--seq-lens", "64"]
    monkeypatch.setattr(bench_run, "relative_error",
                        lambda *a, **k: torch.tensor([float("nan")]))  # an overflowed output
    assert main(argv) == 0
    text = out.with_suffix(".json").read_text()
    data = json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in the JSON"))
    assert data["config"]["max_seconds"] is None
    assert [r["rel_error"] for r in data["rows"]] == [None, None]
    capsys.readouterr()
    assert main([*argv, "--seq-lens", "64", "128", "--resume"]) == 0
    captured = capsys.readouterr()
    assert "2 rows measured before" in captured.err
    row = next(line for line in captured.out.splitlines() if line.startswith("skyformer"))
    assert row.split()[8] == "-"  # the rel. error column


def test_crossover_and_summary_arithmetic():
    assert crossover([(512, 0.5), (1024, 2.0)]) == (
        pytest.approx(724.08, rel=1e-3),
        "interpolated",
    )
    assert crossover([(512, 1.5), (1024, 3.0)]) == (512.0, "at most")
    assert crossover([(512, 0.5), (1024, 0.9)]) == (None, "never")
    # faster at a short length, slower at the longest: not "slower at every N"
    assert crossover([(32, 2.75), (64, 1.49), (128, 0.07)]) == (None, "not at the largest")
    # faster, slower, then faster for good: the crossover is the last one
    assert crossover([(256, 1.2), (512, 0.8), (1024, 1.6)])[0] > 512
    rows = [
        {
            "device": "cpu",
            "dtype": "float32",
            "batch": 1,
            "heads": 1,
            "head_dim": 8,
            "method": m,
            "n": n,
            "status": "ok",
            "fwd_ms": t,
            "fwd_bwd_ms": t,
            "peak_mib": None,
            "speedup": None,
            "memory_ratio": None,
            "growth": None,
        }
        for m, c, p in (("softmax", 1e-6, 2), ("lin", 1e-3, 1))
        for n in (256, 512, 1024, 2048)
        for t in [c * n**p]
    ]
    summary = {s["method"]: s for s in summarise(rows, "softmax", True)}
    assert summary["softmax"]["crossover"] is None
    lone = [{**rows[0], "method": "never_timed", "status": "skipped", "fwd_bwd_ms": None,
             "reason": "failed"}]
    assert summarise(rows[:4] + lone, "softmax", True)[-1]["crossover"] is None
    assert summary["lin"]["exponent"] == pytest.approx(1.0)
    assert summary["softmax"]["exponent"] == pytest.approx(2.0)
    assert summary["lin"]["crossover_n"] == pytest.approx(1000.0)
    # --resume: a crossover interpolated between two runs' lengths is not given; one
    # between lengths of one run is, whatever run measured the others
    for runs, expected in (((0, 0, 1, 1), None), ((0, 1, 1, 1), pytest.approx(1000.0))):
        resumed = [{**r, "run": runs[(256, 512, 1024, 2048).index(r["n"])]} for r in rows]
        lin = {s["method"]: s for s in summarise(resumed, "softmax", True)}["lin"]
        assert lin["crossover_n"] == expected
        assert lin["crossover"] == ("across runs" if expected is None else "interpolated")
    # N -> 2N growth wherever N/2 was measured, not only at the previous length
    between = [{**rows[0], "n": n, "fwd_bwd_ms": 1e-6 * n**2, "growth": None}
               for n in (256, 384, 512, 768, 1024)]
    summarise(between, "softmax", True)
    assert [r["growth"] for r in between] == [None, None, pytest.approx(4.0),
                                              pytest.approx(4.0), pytest.approx(4.0)]
    # memory ratios: not between CPU peaks below the counters' resolution (1 MiB)
    for device, ref_mib, expected in (("cpu", 0.3, None), ("cpu", 4.0, 0.5),
                                      ("cuda", 0.3, 0.5)):
        pair = [{**rows[0], "device": device, "method": m, "peak_mib": ref_mib * s}
                for m, s in (("softmax", 1.0), ("lin", 0.5))]
        summarise(pair, "softmax", True)
        assert pair[1]["memory_ratio"] == (None if expected is None
                                           else pytest.approx(expected))


def test_flop_counts():
    sky = attention_flops("skyformer", batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                          options={"num_features": 10, "pinv_iterations": 2})
    # 4 products of [100 x 10 x 4]; C(X, X) and W ctx; 4 * 2 - 2 products of 10^3
    assert sky == 2 * (4 * 100 * 10 * 4 + 2 * 10 * 10 * 4 + 6 * 10**3)
    # the implicit gradient raises the steps to Lemma 3's bound, 7 at m = 10 in float32,
    # scaled Newton steps, 2K - 2 products of m x m in all
    implicit = attention_flops("skyformer", batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                               options={"num_features": 10, "pinv_iterations": 2,
                                        "pinv_gradient": "implicit"})
    assert implicit == 2 * (4 * 100 * 10 * 4 + 2 * 10 * 10 * 4 + (2 * 7 - 2) * 10**3)
    # backward: twice the products outside the core, and two m x m products for it
    implicit_bwd = attention_flops("skyformer", batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                                   backward=True, options={"num_features": 10,
                                                           "pinv_gradient": "implicit"})
    outside = 2 * (4 * 100 * 10 * 4 + 2 * 10 * 10 * 4)
    assert implicit_bwd == implicit + 2 * outside + 2 * 2 * 10**3
    # where the call factorises (eager CPU): m^3 for the Cholesky factor and its inverse;
    # the unrolled core never does
    factorised = attention_flops("skyformer", batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                                 backward=True, factorised_core=True,
                                 options={"num_features": 10, "pinv_gradient": "implicit"})
    assert factorised == 3 * outside + 10**3 + 2 * 2 * 10**3
    assert attention_flops("skyformer", batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                           factorised_core=True, options={"num_features": 10,
                                                          "pinv_iterations": 2}) == sky
    assert (
        attention_flops("softmax", batch=2, heads=3, nq=10, nk=20, d=4, dv=4, backward=True)
        == 3 * 6 * 2 * 10 * 20 * 8
    )
    assert attention_flops("not-a-counted-method", batch=1, heads=1, nq=1, nk=1, d=1, dv=1) is None
    assert matmul_flops_per_second("cpu", torch.float32, size=64, repeats=1) > 0


def test_flop_counts_follow_causal_and_the_compute_dtype():
    """A causal exact call visits N (N + 1) / 2 pairs; causal Skyformer is another
    construction, not counted (it was counted as the non-causal one, a wrong speed of
    light); the implicit core's steps are those of the call's dtype."""
    exact = attention_flops("softmax", batch=1, heads=1, nq=10, nk=10, d=4, dv=4,
                            options={"causal": True})
    assert exact == 2 * (10 * 11 / 2) * 8
    for name in ("skyformer", "nystrom_softmax"):
        assert attention_flops(name, batch=1, heads=1, nq=100, nk=100, d=4, dv=4,
                               options={"num_features": 10, "causal": True}) is None
    options = {"num_features": 128, "pinv_gradient": "implicit"}
    steps = {dtype: implicit_iterations(128, 0.1, dtype, at_least=6)
             for dtype in (torch.float32, torch.float64)}
    counts = {dtype: attention_flops("skyformer", batch=1, heads=1, nq=1024, nk=1024, d=4,
                                     dv=4, options=options, dtype=dtype) for dtype in steps}
    assert steps[torch.float64] > steps[torch.float32]
    assert counts[torch.float64] - counts[torch.float32] == pytest.approx(
        2 * 2 * (steps[torch.float64] - steps[torch.float32]) * 128**3)


def test_config_and_names_are_checked():
    with pytest.raises(ValueError, match="dtype"):
        BenchConfig(dtypes=("float8",))
    with pytest.raises(ValueError, match="B, H, D"):
        BenchConfig(shapes=((1, 2),))
    with pytest.raises(ValueError, match="clock"):
        BenchConfig(clock="sundial")
    with pytest.raises(ValueError, match=r"timing \(--timing\) must be one of interleaved, "
                       r"blocked, got 'shuffled'\."):
        BenchConfig(timing="shuffled")
    for pause in (-0.5, math.inf):
        with pytest.raises(ValueError, match=r"pause \(--pause\) must be a finite number of "
                           r"seconds, at least 0"):
            BenchConfig(pause=pause)
    # each refused count is named with its flag and the value given
    for setting, said in (({"repeats": 0}, r"repeats \(--repeats\) must be at least 1, got 0\."),
                          ({"warmup": -1}, r"warmup \(--warmup\) must be at least 0, got -1\."),
                          ({"num_features": 0}, r"num_features \(--features\) must be a "
                                                r"positive integer, got 0\."),
                          ({"max_seconds": 0.0}, r"max_seconds \(--max-seconds\) must be "
                                                 r"positive, got 0\.0\."),
                          ({"seq_lens": (64, 0)}, r"seq_lens \(--seq-lens\) must be positive "
                                                   r"integers, got \[0\]\.")):
        with pytest.raises(ValueError, match=said):
            BenchConfig(**setting)
    for device in ("tpu", "cuda:x"):
        with pytest.raises(ValueError, match=f"device must be cpu, cuda or cuda:K, got '{device}'"):
            BenchConfig(device=device)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            BenchConfig(device="cuda")
    with pytest.raises(ValueError, match="exact target"):
        resolve("skyformer.ops.skyformer:materialised_skyformer_attention@exact")
    with pytest.raises(ValueError, match="cannot load"):
        resolve("skyformer.ops.nothing:here")
    with pytest.raises(ValueError, match="'os:sep' is not a function; expected"):
        resolve("os:sep")
    plain = resolve(
        "skyformer.ops.kernelized:reference_materialised_kernelized_attention@gaussian"
    )
    assert (
        plain.target == "gaussian"
        and not plain.takes_generator
        and plain.label.startswith("reference")
    )
    # a builtin has no signature to read: called as f(q, k, v), no options (it raised
    # "no signature found for builtin")
    sdpa = resolve("torch.nn.functional:scaled_dot_product_attention@softmax")
    assert not sdpa.takes_generator and sdpa.option_names == () and sdpa.options(8) == {}
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    out = sdpa.prepare(tuple(q.shape), {})(q, k, v, None)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_a_functions_options_are_its_parameters_after_q_k_v(tmp_path, monkeypatch):
    """``def f(q, k, v, num_features=64)`` took no --features (only keyword-only
    parameters counted): it ran at 64 beside methods at 32, with no word. Options in
    brackets on a function are refused in a sentence (they failed as an attribute)."""
    (tmp_path / "own_attention.py").write_text(
        "def plain(q, k, v, num_features=64, key_padding_mask=None):\n    return v\n"
        "def keyword(q, k, v, *, num_features=64, generator=None):\n    return v\n"
        "def positional_only(q, k, v, /, scale=1.0):\n    return v\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("own_attention:plain@softmax").options(32) == {"num_features": 32}
    assert resolve("own_attention:keyword@softmax").options(32) == {"num_features": 32}
    assert resolve("own_attention:positional_only@softmax").option_names == ("scale",)
    with pytest.raises(ValueError, match=r"options in brackets are for registered methods; a "
                                         r"function is called with its own defaults"):
        resolve("own_attention:plain[num_features=16]@softmax")


def test_a_function_with_a_wrong_output_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """A function returning one row was timed and reported many times faster than softmax
    (the reason only in the progress line); a NaN error is marked as worse than the
    trivial answer."""
    from skyformer.eval.bench.report import worse_than_trivial

    (tmp_path / "wrong_attention.py").write_text(
        "def one_row(q, k, v):\n    return v[..., :1, :]\n"
        "def doubles(q, k, v):\n    return v.double()\n"
        "def pair(q, k, v):\n    return v, None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = BenchConfig(methods=("wrong_attention:one_row@softmax",
                                  "wrong_attention:doubles@softmax",
                                  "wrong_attention:pair@softmax"), seq_lens=(16,),
                         shapes=((1, 2, 4),), repeats=1, warmup=0, memory=False)
    rows = {row["method"]: row for row in run_bench(config).rows}
    assert rows["one_row"]["status"] == "skipped"
    assert rows["one_row"]["reason"] == (
        "TypeError: the attention method wrong_attention.one_row returned a float32 tensor "
        "of shape [1, 2, 1, 4] for q of shape [1, 2, 16, 4] and v of shape [1, 2, 16, 4]; a "
        "method returns [B, H, Nq, Dv] = [1, 2, 16, 4] in q's dtype (float32).")
    assert "returned a float64 tensor of shape [1, 2, 16, 4]" in rows["doubles"]["reason"]
    assert "returned a tuple; a method returns one tensor" in rows["pair"]["reason"]
    assert worse_than_trivial({"rel_error": float("nan"), "trivial_error": 0.5})


def test_a_reason_keeps_the_whole_sentence_and_cuts_only_a_runaway_line():
    """Reasons were cut at 200 characters, mid-sentence, before the part naming the fix."""
    from skyformer.eval.bench.run import REASON_CHARS, _one_line

    sentence = "x" * 400 + " the fix."
    assert _one_line(ValueError(sentence + "\ndetails")) == f"ValueError: {sentence}"
    cut = _one_line(RuntimeError("y" * 2000))
    assert len(cut) == REASON_CHARS and cut.endswith("...")


def test_every_registered_method_runs():
    """The default method list: all registered methods, including those with a per-layer
    state (Linformer, Nystromformer, Performer) and the multipole/adaptive variants."""
    from skyformer.registry import list_methods

    config = BenchConfig(seq_lens=(64,), shapes=((1, 2, 8),), num_features=8, repeats=1,
                         warmup=0, memory=False)
    rows = run_bench(config).rows
    assert [r["method"] for r in rows] == list_methods()
    failed = {r["method"]: r["reason"] for r in rows if r["status"] != "ok"}
    assert not failed
    assert all(r["rel_error"] is not None and math.isfinite(r["rel_error"]) for r in rows)


def test_errors_above_the_trivial_answer_are_marked(tiny):
    from skyformer.eval.bench.report import _cell, worse_than_trivial

    for r in tiny.rows:
        assert 0 < r["trivial_error"] <= 1.0
    row = {"rel_error": 0.7, "trivial_error": 0.5}
    assert worse_than_trivial(row) and _cell(row, "rel_error", "{:.2e}".format) == "7.00e-01!"
    assert not worse_than_trivial({"rel_error": 0.2, "trivial_error": 0.5})


def test_causal_runs_the_causal_methods_against_causal_sdpa():
    config = BenchConfig(seq_lens=(128,), shapes=((1, 2, 8),), num_features=8, repeats=1,
                         warmup=0, memory=False, causal=True)
    result = run_bench(config)
    by_name = {row["method"]: row for row in result.rows}
    assert set(by_name) == {"softmax", "kernelized", "skyformer", "nystrom_softmax", "linear",
                            "performer"}
    assert all(row["status"] == "ok" for row in by_name.values())
    assert by_name["softmax"]["rel_error"] < 1e-5  # against the causal target
    assert by_name["skyformer"]["rel_error"] < 1.0
    with pytest.raises(ValueError, match="nystromformer cannot do causal masking"):
        run_bench(BenchConfig(methods=("nystromformer",), seq_lens=(64,), shapes=((1, 1, 8),),
                              repeats=1, warmup=0, memory=False, causal=True))


def test_each_row_at_its_runs_matmul_rate_a_dotted_out_and_float64_errors(
        tmp_path, monkeypatch, capsys):
    """Rows kept by --resume keep the speed of light of the run that measured them, at
    its matmul rate, and the file keeps every run's rate (kept rows were given the
    last run's rate, a time of one run over a rate of another); --out keeps a dot in its
    name (OUT.json, not a cut name); exact methods compared in float64 give float64's
    error (none), not float32's."""
    import skyformer.eval.bench.run as bench_run

    out = tmp_path / "bench_torch2.13"
    argv = ["bench", "--methods", "skyformer", "kernelized", "--shapes", "1,1,8",
            "--features", "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--out",
            str(out), "--no-plot", "--dtypes", "float64"]
    for rate, lengths in ((1e11, ["64"]), (2e11, ["64", "128"])):
        monkeypatch.setattr(bench_run, "matmul_flops_per_second", lambda *a, r=rate, **k: r)
        assert main([*argv, "--seq-lens", *lengths, *(["--resume"] if rate > 1e11 else [])]) == 0
    data = json.loads((tmp_path / "bench_torch2.13.json").read_text())
    assert not (tmp_path / "bench_torch2.json").exists()
    assert data["matmul_gflops"] == {"float64": 200.0}  # this (the last) run's
    assert [run["matmul_gflops"] for run in data["runs"]] == [{"float64": 100.0},
                                                             {"float64": 200.0}]
    rows = [r for r in data["rows"] if r.get("gflop")]
    assert {r["n"] for r in rows} == {64, 128}
    for row in rows:
        rate = data["runs"][row["run"]]["matmul_gflops"]["float64"]
        assert rate == {64: 100.0, 128: 200.0}[row["n"]]
        assert row["sol_ms"] == pytest.approx(row["gflop"] / rate * 1e3)
    exact = [r for r in data["rows"] if r["method"] in ("softmax", "kernelized")]
    assert exact and all(r["rel_error"] < 1e-14 for r in exact)
    # the table says which run measured which lengths, and leaves out what would cross
    table = capsys.readouterr().out
    assert "rows of more than one run (--resume): N = 64 by run 0 (started " in table
    assert "float64 100 GFLOP/s" in table and "float64 200 GFLOP/s" in table
    assert "time exponent not given: N 64..128 come from different runs" in table
    assert all(s["exponent"] is None for s in data["summary"])
    sky = next(s for s in data["summary"] if s["method"] == "skyformer")
    speedups = [r["speedup"] for r in sorted(data["rows"], key=lambda r: r["n"])
                if r["method"] == "skyformer"]
    if speedups[0] < 1 <= speedups[1]:  # interpolated between the two runs' lengths
        assert sky["crossover"] == "across runs" and sky["crossover_n"] is None
        assert "skyformer: crossover with softmax not given: the lengths it lies between " \
               "come from different runs" in table


def test_two_settings_of_one_method_are_measured_side_by_side():
    """A variant (``name[key=value]``) is a method of its own in a run: its own rows under
    its own name, its options in force, its FLOPs counted as its method's."""
    config = BenchConfig(
        methods=("skyformer", "skyformer[pinv_gradient=implicit]"), seq_lens=(64,),
        shapes=((1, 2, 8),), num_features=16, repeats=1, warmup=0, memory=False)
    rows = {row["method"]: row for row in run_bench(config).rows}
    assert set(rows) == {"softmax", "skyformer", "skyformer[pinv_gradient=implicit]"}
    implicit, unrolled = rows["skyformer[pinv_gradient=implicit]"], rows["skyformer"]
    assert implicit["status"] == "ok" and implicit["sol_fraction"] > 0
    # forward + backward, 16 landmarks: the bound's 7 steps forward against 6, but two
    # m x m products backward against twice the steps' (flops.BACKWARD_FLOPS)
    assert implicit["gflop"] < unrolled["gflop"]


def test_a_variant_that_sets_the_swept_num_features_is_refused():
    """--features sets num_features on every call: a variant setting it too would be
    measured with --features under its own name (as approx and hf-eval refuse)."""
    from skyformer.eval.compare.run import CompareConfig

    with pytest.raises(ValueError, match=r"bench \(--features\) sets num_features"):
        BenchConfig(seq_lens=(32,), methods=("skyformer[num_features=16]",), num_features=8)
    with pytest.raises(ValueError, match=r"compare \(--features\) sets num_features"):
        CompareConfig(methods=("skyformer[num_features=16]",), num_features=32)
    BenchConfig(seq_lens=(32,), methods=("skyformer[num_features=16]",))  # no sweep: fine
    CompareConfig(methods=("skyformer[num_features=16]", "linear"))
    with pytest.raises(ValueError, match="unknown attention method 'nope'"):
        CompareConfig(methods=("nope",))
    with pytest.raises(ValueError, match=r"compare takes registered methods, not "
                                         r"'my_attn:window@softmax'.*skyformer bench --methods "
                                         r"my_attn:window@softmax\.$"):
        CompareConfig(methods=("my_attn:window@softmax",))
    with pytest.raises(ValueError, match=r"methods \(--methods\) lists linear more than once; "
                                         r"give each"):
        CompareConfig(methods=("linear", "linear"))
    with pytest.raises(ValueError, match=r"seq_lens \(--seq-lens\) lists 16 more than once"):
        BenchConfig(seq_lens=(16, 16))
    with pytest.raises(ValueError, match=r"shapes \(--shapes\) lists \(1, 1, 4\) more than once"):
        BenchConfig(seq_lens=(16,), shapes=((1, 1, 4), (1, 1, 4)))


@pytest.mark.parametrize("features", [None, 8])
def test_a_method_registered_by_a_function_module_may_come_first(monkeypatch, tmp_path,
                                                                  features):
    """`--methods first_keys_mean tests.eval.registering_method:exact`: the module that
    registers the method is imported before any name is looked up, with or without
    --features (whose check read the names first: "unknown attention method")."""
    import sys

    import skyformer.registry.methods as registry_methods

    monkeypatch.setattr(registry_methods, "_REGISTRY", dict(registry_methods._REGISTRY))
    monkeypatch.delitem(sys.modules, "tests.eval.registering_method", raising=False)
    argv = ["bench", "--methods", "first_keys_mean", "tests.eval.registering_method:exact",
            "--seq-lens", "16", "--shapes", "1,1,4", "--repeats", "1", "--warmup", "0",
            "--no-memory", "--out", str(tmp_path / "b"), "--no-plot"]
    assert main(argv + (["--features", str(features)] if features else [])) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"softmax", "first_keys_mean", "exact"}
    assert by_method["first_keys_mean"]["num_features"] == (features or 4)


def test_a_variant_is_measured_against_the_target_at_its_scale_and_causal_is_a_flag():
    """``softmax[scale=0.5]`` is its own target (error 0); causal in the brackets is
    refused for --causal, which makes the reference causal too."""
    config = BenchConfig(methods=("softmax[scale=0.5]", "kernelized[scale=0.5]"),
                         seq_lens=(32,), shapes=((1, 2, 8),), repeats=1, warmup=0,
                         memory=False, backward=False)
    rows = {row["method"]: row for row in run_bench(config).rows}
    assert rows["softmax[scale=0.5]"]["rel_error"] < 1e-6
    assert rows["kernelized[scale=0.5]"]["rel_error"] < 1e-6
    for causal in (False, True):
        with pytest.raises(ValueError, match=r"softmax\[causal=True\]: bench makes every "
                                             r"method causal with --causal"):
            BenchConfig(methods=("softmax[causal=True]",), seq_lens=(32,), causal=causal)


def test_a_platform_without_load_averages_runs(monkeypatch):
    """Windows has no ``os.getloadavg``: the load average is left out of the result
    instead of the run stopping with an AttributeError."""
    import os

    monkeypatch.delattr(os, "getloadavg")
    config = BenchConfig(methods=("softmax",), seq_lens=(16,), shapes=((1, 1, 8),),
                         repeats=1, warmup=0, memory=False)
    result = run_bench(config)
    assert result.environment["load_average_start"] is None
    assert [r["status"] for r in result.rows] == ["ok"]
    assert result.rows[0]["load_avg"] is None


def test_half_inputs_get_a_speed_of_light_no_call_can_beat(monkeypatch):
    """Half inputs are computed in float32 by several methods (and CPU SDPA does not use
    the float16 matmul, far slower there): their speed of light takes the faster of the
    half type's and float32's matmul rates, both in the file."""
    import skyformer.eval.bench.run as bench_run

    rates = {torch.float16: 1e9, torch.float32: 5e10, torch.bfloat16: 2e11}
    monkeypatch.setattr(bench_run, "matmul_flops_per_second",
                        lambda device, dtype, **kwargs: rates[dtype])
    config = BenchConfig(methods=("skyformer",), seq_lens=(32,), shapes=((1, 1, 8),),
                         dtypes=("float16", "bfloat16"), num_features=8, repeats=1, warmup=0,
                         memory=False, error=False)
    result = run_bench(config)
    assert result.matmul_gflops == {"float16": 1.0, "float32": 50.0, "bfloat16": 200.0}
    for row in result.rows:
        rate = {"float16": 50.0, "bfloat16": 200.0}[row["dtype"]]
        assert row["gflop"] and row["sol_ms"] == pytest.approx(row["gflop"] / rate * 1e3)
    assert "half inputs at the faster of theirs and float32's" in format_table(result)


def test_inputs_too_large_to_hold_skip_their_length_and_the_run_goes_on(monkeypatch, capsys):
    """A length whose inputs exceed the memory available, or fail to allocate, is a
    skipped row with a sentence for every method; the other shapes are still measured
    (the run stopped with the allocator's message)."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "available_bytes", lambda device: 32 * 1024)
    config = BenchConfig(methods=("softmax", "linear"), seq_lens=(16, 1024),
                         shapes=((1, 1, 4), (2, 1, 4)), repeats=1, warmup=0, memory=False)
    rows = {(r["batch"], r["n"], r["method"]): r for r in run_bench(config).rows}
    assert len(rows) == 8
    for (_, n, _), row in rows.items():
        assert row["status"] == ("ok" if n == 16 else "skipped")
    reason = rows[(2, 1024, "linear")]["reason"]
    assert reason.startswith("the inputs (q, k, v and the output gradient), the output and "
                             "the gradients of q, k and v, [2, 1, 1024, 4] each, take ") \
        and "GiB available" in reason
    # a table whose every row is skipped is printed (its widths failed on no rows)
    alone = run_bench(dataclasses.replace(config, seq_lens=(1024,)))
    assert all(r["status"] == "skipped" for r in alone.rows)
    assert "skipped: the inputs" in format_table(alone)

    def no_memory(shape, n, *args):
        if n > 16:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")
        return real(shape, n, *args)

    real = bench_run._inputs
    monkeypatch.setattr(bench_run, "available_bytes", lambda device: math.inf)
    monkeypatch.setattr(bench_run, "_inputs", no_memory)
    assert main(["bench", "--methods", "linear", "--seq-lens", "16", "32", "--shapes", "1,1,4",
                 "--repeats", "1", "--warmup", "0", "--no-memory"]) == 0
    out = capsys.readouterr().out
    assert "skipped: the inputs [1, 1, 32, 4] could not be allocated: RuntimeError: " \
           "DefaultCPUAllocator" in out


def test_the_memory_panel_leaves_out_cpu_peaks_below_resolution_and_says_so(
        tiny, tmp_path, monkeypatch):
    """A CPU peak under 1 MiB says only "small" (no ratio is taken from it): the plot drew
    such peaks as values (0.004 MiB) and dropped peaks of 0 silently (the reference's
    line vanished); it draws the peaks above resolution and notes the rest."""
    import skyformer.eval.bench.report as report

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path, **kw: figures.append(fig))
    copy = dataclasses.replace(tiny, rows=[dict(r) for r in tiny.rows])
    peaks = {"softmax": 0.0, "skyformer": 0.004, "materialised_skyformer_attention": 3.0}
    for row in copy.rows:
        row["peak_mib"] = peaks[row["method"]]
    report.plot_results(copy, tmp_path / "bench.png")
    time_axes, memory_axes = figures[0].axes
    assert len(time_axes.lines) == 3
    assert [line.get_label() for line in memory_axes.lines] == [
        "materialised_skyformer_attention"]
    assert [t.get_text() for t in memory_axes.texts] == [
        "peaks under 1 MiB (the CPU measurement's resolution) not drawn"]
    for row in copy.rows:
        row["peak_mib"] = None  # --no-memory: an empty panel over the lengths, said so
    copy = dataclasses.replace(copy, config=dataclasses.replace(copy.config, memory=False))
    report.plot_results(copy, tmp_path / "bench.png")
    time_axes, memory_axes = figures[1].axes
    assert not memory_axes.lines
    assert [t.get_text() for t in memory_axes.texts] == [
        "peak memory not measured (--no-memory)"]
    assert memory_axes.get_xlim() == time_axes.get_xlim()


def test_a_length_with_nothing_timed_gets_no_load_average(monkeypatch):
    """A length whose every row was skipped (its inputs too large) had the load average
    read around no timing, listed as the load "while timing" it; it has none."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "available_bytes", lambda device: 32 * 1024)
    monkeypatch.setattr(bench_run, "_load", lambda: [1.5, 1.0, 0.5])
    config = BenchConfig(methods=("linear",), seq_lens=(16, 1024), shapes=((1, 1, 4),),
                         repeats=1, warmup=0, memory=False)
    result = run_bench(config)
    assert {r["n"]: r["load_avg"] for r in result.rows} == {16: 1.5, 1024: None}
    assert "1-minute load average while timing: N=16: 1.5\n" in format_table(result) + "\n"


def test_a_second_run_writing_the_same_out_is_refused(tmp_path, capsys, monkeypatch):
    """Two runs with one --out (a job requeued while the first still runs) both rewrote
    OUT.json after every length, each over the other's rows; the second is now refused,
    naming the process, and a run writing another prefix of the folder is not."""
    import skyformer.eval.bench.run as bench_run
    from skyformer.io import LOCK_FILE, results_lock

    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: [])
    out = tmp_path / "shared"
    argv = ["bench", "--methods", "linear", "--seq-lens", "16", "--no-plot", "--out"]
    with results_lock(out.with_suffix(".json")):  # the run writing there now
        assert main([*argv, str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out.with_suffix('.json')} is being written by another run (process" in err
        assert "choose another --out" in err and not out.with_suffix(".json").exists()
        assert main([*argv, str(tmp_path / "other")]) == 0
    assert main([*argv, str(out)]) == 0
    assert not list(tmp_path.glob(f"*{LOCK_FILE}"))


def test_blocked_timing_times_each_call_alone_after_its_pause(monkeypatch, capsys):
    """``--timing blocked --pause S``: every call's repeats go to the blocked timer with
    that pause (none to the interleaved one), and the summary line says so."""
    from skyformer.eval.bench import run as bench_run

    seen = {}

    def blocked(fns, **kwargs):
        seen.update(kwargs, calls=list(fns))
        return dict.fromkeys(fns, 1e-3)

    monkeypatch.setattr(bench_run, "blocked_median_seconds", blocked)
    monkeypatch.setattr(bench_run, "interleaved_median_seconds",
                        lambda *args, **kwargs: pytest.fail("interleaved timing used"))
    args = ["bench", "--methods", "softmax", "linear", "--seq-lens", "16", "--shapes", "1,1,8",
            "--no-memory", "--no-error", "--no-plot", "--timing", "blocked", "--pause", "0.25"]
    assert main(args) == 0
    assert seen["pause"] == 0.25 and "linear/fwd_bwd" in seen["calls"]
    printed = capsys.readouterr().out
    assert "blocked timing" in printed
    assert "each method's repeats in a block after 0.25 s idle" in printed


def test_a_method_failing_after_its_first_call_skips_its_row_and_not_the_length(
        tmp_path, capsys, monkeypatch):
    """A method whose timed call fails (out of memory at its second call, say) stopped
    the whole sweep with the error's own message, naming neither the method nor N, and
    no row of that length was written. Its row is now skipped with the error, the other
    methods of the length are timed (again, without it) and written; one whose error
    measurement fails keeps its times, its reason saying why the error is missing."""
    import tests.eval.failing_method as failing

    monkeypatch.setattr(failing, "CALLS", {})
    out = tmp_path / "flaky"
    assert main(["bench", "--methods", "linear",
                 "tests.eval.failing_method:fails_when_timed@softmax",
                 "tests.eval.failing_method:fails_for_its_error@softmax", "--seq-lens", "16", "32",
                 "--shapes", "1,1,4", "--repeats", "1", "--warmup", "0", "--no-memory",
                 "--out", str(out), "--no-plot"]) == 0
    rows = {(r["method"], r["n"]): r for r in json.loads(out.with_suffix(".json").read_text())
            ["rows"]}
    assert len(rows) == 8 and all(rows[(m, 16)]["status"] == "ok" for m, _ in rows)
    timed = rows[("fails_when_timed", 32)]
    assert timed["status"] == "skipped" and timed["fwd_bwd_ms"] is None
    assert timed["reason"] == ("a timed call failed: RuntimeError: fails_when_timed fails "
                               "from its call 3 on (call 3)")
    for method in ("softmax", "linear"):
        assert rows[(method, 32)]["status"] == "ok" and rows[(method, 32)]["fwd_bwd_ms"] > 0
    late = rows[("fails_for_its_error", 32)]
    assert late["status"] == "ok" and late["fwd_bwd_ms"] > 0 and late["rel_error"] is None
    assert late["reason"] == ("relative error not measured: RuntimeError: fails_for_its_error "
                              "fails from its call 5 on (call 5)")
    captured = capsys.readouterr()
    assert "skipped: a timed call failed: RuntimeError: fails_when_timed" in captured.out
    assert "relative error not measured: RuntimeError: fails_for_its_error" in captured.err


def test_an_error_bench_does_not_record_names_the_method_and_the_length(monkeypatch):
    """An error that is no failure of a call (a bug, say) still stops the run, with a
    note naming the method, N and when it was raised."""
    import tests.eval.failing_method as failing

    monkeypatch.setattr(failing, "CALLS", {})
    config = BenchConfig(methods=("tests.eval.failing_method:breaks_when_timed@softmax",),
                         seq_lens=(16, 32), shapes=((1, 1, 4),), repeats=1, warmup=0,
                         memory=False)
    with pytest.raises(LookupError, match="breaks_when_timed fails from its call 3") as raised:
        run_bench(config)
    assert raised.value.__notes__ == [
        "raised by breaks_when_timed at N = 32 (B=1 H=1 D=4 float32), in a timed call"]


def test_the_timed_calls_share_one_generator_reseeded_in_place():
    """A generator was made and seeded inside every timed call (~4.5 us on a CPU): each
    call now reseeds one made beforehand, so that each still draws the same."""
    from skyformer.eval.bench.run import _closures

    seen = []

    def call(q, k, v, generator):
        seen.append((generator, generator.initial_seed(), torch.rand(1, generator=generator)))
        return q.clone().requires_grad_()

    q, k, v, grad = (torch.randn(1, 1, 4, 2) for _ in range(4))
    forward, step = _closures(call, q, k, v, grad, seed=7)
    for fn in (forward, forward, step):
        fn()
    assert all(g is seen[0][0] and seed == 7 and draw == seen[0][2] for g, seed, draw in seen)


@pytest.mark.parametrize(("bounds", "said"), [
    (["--max-n", "256"], "--max-n 256 is below --min-n's default 512: pass --min-n too, "
                         "e.g. --min-n 64."),
    (["--min-n", "32768"], "--min-n 32768 is above --max-n's default 16384: pass --max-n "
                           "too, e.g. --max-n 131072."),
    (["--min-n", "64", "--max-n", "32"], "--min-n 64 is above --max-n 32"),
    (["--min-n", "0"], "--min-n must be at least 1, got 0.")])
def test_lengths_out_of_order_name_the_bounds_given_and_the_defaults(capsys, bounds, said):
    """`bench --max-n 256` said "need 1 <= --min-n <= --max-n, got 512 and 256": a 512
    never typed. The default is named as such, with the option to pass."""
    assert main(["bench", *bounds, "--no-memory"]) == 2
    assert said in capsys.readouterr().err


def test_a_file_from_before_runs_were_kept_resumes_as_one_run(tmp_path, capsys):
    """A file without ``runs`` (rows without ``run``) is resumed: its rows are its one
    earlier run's, that run made of the file's environment, rates and command; rows
    naming a run the file does not record get a sentence."""
    out = tmp_path / "older"
    argv = ["bench", "--methods", "linear", "--shapes", "1,1,4", "--repeats", "1",
            "--warmup", "0", "--no-memory", "--no-plot", "--out", str(out)]
    assert main([*argv, "--seq-lens", "16"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    del data["runs"]
    for row in data["rows"]:
        del row["run"]
    out.with_suffix(".json").write_text(json.dumps(data))
    assert main([*argv, "--seq-lens", "16", "32", "--resume"]) == 0
    resumed = json.loads(out.with_suffix(".json").read_text())
    assert [r["run"] for r in resumed["rows"]] == [0, 0, 1, 1]
    first = resumed["runs"][0]
    assert first["started"] is None and first["command"] == data["command"]
    assert first["environment"] == data["environment"]
    assert first["matmul_gflops"] == data["matmul_gflops"]
    resumed["rows"][0]["run"] = 5
    out.with_suffix(".json").write_text(json.dumps(resumed))
    capsys.readouterr()
    assert main([*argv, "--seq-lens", "16", "32", "--resume"]) == 2
    assert "its rows name runs [5] of 2 it records (a file edited?)" in capsys.readouterr().err


def test_backward_peaks_of_a_file_from_before_runs_are_not_mixed_with_new_ones(tmp_path,
                                                                                capsys):
    """Files written before runs were kept measured backward peaks with the output
    gradient inside; new rows leave it out: resuming such a file with memory and
    backward would put two definitions in one table, so it is refused in a sentence."""
    out = tmp_path / "older"
    argv = ["bench", "--methods", "linear", "--shapes", "1,1,4", "--repeats", "1",
            "--warmup", "0", "--no-plot", "--out", str(out)]
    assert main([*argv, "--seq-lens", "16"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    del data["runs"]
    out.with_suffix(".json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main([*argv, "--seq-lens", "16", "32", "--resume"]) == 2
    assert "before backward peaks left out the output gradient" in capsys.readouterr().err


def test_a_method_faster_at_every_length_says_so(tiny):
    """Faster already at the smallest length measured read "faster than softmax from
    N <= 16384", also where that was the only length."""
    summary = [dict(s, crossover="at most", crossover_n=64.0) if s["method"] == "skyformer"
               else dict(s) for s in tiny.summary]
    assert ("skyformer: faster than softmax at every N measured, the smallest N = 64 (the "
            "crossover lies at or below it)") in format_table(
        dataclasses.replace(tiny, summary=summary))


def test_a_method_slower_at_the_largest_length_alone_names_where_it_was_faster(tiny):
    """Faster at short lengths and slower at the largest read "slower than softmax at
    every N measured", beside a table of speed-ups above 1."""
    base = {"device": "cpu", "dtype": "float32", "batch": 1, "heads": 1, "head_dim": 8,
            "status": "ok", "peak_mib": None, "speedup": None, "memory_ratio": None,
            "growth": None}
    times = {"softmax": {32: 1.0, 64: 1.0, 128: 1.0}, "lin": {32: 0.4, 64: 0.7, 128: 3.0}}
    rows = [{**base, "method": m, "n": n, "fwd_ms": t, "fwd_bwd_ms": t}
            for m, by_n in times.items() for n, t in by_n.items()]
    lin = {s["method"]: s for s in summarise(rows, "softmax", True)}["lin"]
    assert (lin["crossover"], lin["crossover_n"], lin["faster_at"]) == (
        "not at the largest", None, [32, 64])
    summary = [dict(s, crossover="not at the largest", crossover_n=None, faster_at=[16, 32])
               if s["method"] == "skyformer" else dict(s) for s in tiny.summary]
    table = format_table(dataclasses.replace(tiny, summary=summary))
    assert ("skyformer: faster than softmax at N = 16, 32 alone, slower at the largest N "
            "measured") in table
    assert "skyformer: slower than softmax at every N" not in table
