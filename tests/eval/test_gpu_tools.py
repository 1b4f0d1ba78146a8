"""benchmarks/gpu_profile.py, triton_resources.py, host_time.py ... on the CPU (tiny shapes):
the tools the GPU measurement depends on run, and say so where they cannot."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.devices import needs_interpreter

# These run the GPU tools on CPU tensors, most with the Triton kernels: under the
# interpreter only (on a GPU machine, where it is off, the tools themselves run there).
pytestmark = needs_interpreter


def _assert_run_recorded(result, script, argv):
    """``result`` (a script's JSON) holds the settings, the environment and the command
    of the run of ``script`` with ``argv`` (``run_metadata.py``)."""
    assert result["config"]["out"] == argv[argv.index("--out") + 1]
    assert result["environment"]["torch_threads"] == torch.get_num_threads()
    assert result["environment"]["triton"]
    assert result["command"] == f"python benchmarks/{script} " + " ".join(argv)


def test_a_command_run_inside_the_repository_records_its_folder(monkeypatch):
    """The command was recorded as run from the root whatever the folder: one run from
    benchmarks/ with --out results/x.md, run again as recorded, wrote <root>/results."""
    run_metadata = load_benchmark("run_metadata")
    script = str(BENCHMARKS / "host_time.py")
    monkeypatch.chdir(BENCHMARKS)
    assert run_metadata.run_metadata(script, ["--out", "results/x.md"], {})["command"] \
        == "cd benchmarks && python host_time.py --out results/x.md"
    monkeypatch.chdir(BENCHMARKS.parent)
    assert run_metadata.run_metadata(script, ["--out", "x.md"], {})["command"] \
        == "python benchmarks/host_time.py --out x.md"


def test_profile_summarises_every_method_on_the_cpu(tmp_path):
    gpu_profile = load_benchmark("gpu_profile")
    out = tmp_path / "profile"
    argv = ["--device", "cpu", "--shape", "1,2,8,float32", "--seq-lens", "32", "--features",
            "8", "--iterations", "1", "--top", "3", "--out", str(out)]
    assert gpu_profile.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "gpu_profile.py", argv)
    assert result["config"]["seq_lens"] == [32] and result["config"]["iterations"] == 1
    assert {row["method"] for row in result["rows"]} == set(gpu_profile.METHODS)
    for row in result["rows"]:
        assert row["wall_ms"] > 0 and row["launches"] >= 1 and 0 <= row["idle_share"] <= 1
        assert 0 < row["host_ms"] <= row["wall_ms"] and row["syncs"] == 0  # no CUDA calls
        assert 1 <= len(row["host_top"]) <= 3 and all(t["own_ms"] >= 0 for t in row["host_top"])
        assert 1 <= len(row["top"]) <= 3
        assert sum(t["share"] for t in row["top"]) <= 1 + 1e-6
    assert "| 32 | skyformer |" in out.with_suffix(".md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_profile_without_cuda_says_how_to_check_the_script(capsys):
    assert load_benchmark("gpu_profile").main(["--seq-lens", "32"]) == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["gpu_profile", "gpu_host_split"])
def test_cpu_runs_without_the_interpreter_are_refused_up_front(script, monkeypatch, capsys):
    """--device cpu without TRITON_INTERPRET=1 ran the PyTorch rows, then died with a
    traceback at the first Triton kernel."""
    import sys

    module = load_benchmark(script)
    monkeypatch.setattr(sys.modules["gpu_device"], "interpreter_on", lambda: False)
    try:
        code = module.main(["--device", "cpu"])
    except SystemExit as exit_:  # argparse's error
        code = exit_.code
    assert code == 2 and "set TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize(("script", "argv"), [
    ("gpu_kernels", ["--shapes", "1,1,16,float32", "4,16,bf16"]),
    ("gpu_profile", ["--shape", "1,1,float32"]),
    ("col_slices", ["--shape", "1,1,16"]),
    ("flash_tiles", ["--shape", "1,x,16,float32"]),
    ("product_tiles", ["--shape", "1,1,16,int8"]),
    ("lemma3_tiles", ["--shape", "1,1,16"]),
    ("one_pass_sweep", ["--batch-heads", "1"]),
])
def test_the_gpu_scripts_refuse_a_malformed_shape_in_one_line(script, argv, capsys):
    """A shape such as ``4,16,bf16`` died in a ValueError traceback from an unpacking
    deep in the run, on the GPU machine, after the setup."""
    with pytest.raises(SystemExit) as exit_:
        load_benchmark(script).main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"argument {argv[0]}: must be B,H" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_a_numbered_cuda_device_is_checked_as_cuda():
    """--device cuda:0 passed the check (it compared the string with "cuda") and failed
    later with torch's 'not compiled with CUDA'."""
    device_problem = load_benchmark("gpu_device").device_problem
    assert device_problem("x.py", "cuda:0") == device_problem("x.py", "cuda") is not None


def test_occupancy_follows_the_register_file_and_shared_memory():
    resources = load_benchmark("triton_resources")
    # 128 registers x 128 threads = 16K of the 64K registers: 4 blocks, 16 warps
    assert resources._occupancy(128, 0, 4, 90)["warps_per_sm"] == 16
    # 255 registers round up to 256 a thread: 2 blocks of 4 warps
    assert resources._occupancy(255, 0, 4, 90)["warps_per_sm"] == 8
    # 100 KiB of shared memory: 2 blocks on sm_90 (227 KiB), none past the limit
    assert resources._occupancy(64, 100 * 1024, 4, 90)["blocks_per_sm"] == 2
    assert resources._occupancy(64, 384 * 1024, 8, 90)["blocks_per_sm"] == 0
    # a block may hold 99 KiB on sm_86 (100 per SM, 1 reserved per block): the 112 KiB
    # of nystrom_softmax's widest float32 launch cannot launch; 99 KiB can, once
    assert resources._occupancy(64, 112 * 1024, 8, 86)["warps_per_sm"] == 0
    assert resources._occupancy(64, 99 * 1024, 4, 86)["blocks_per_sm"] == 1
    assert resources._occupancy(64, 50 * 1024, 4, 86)["blocks_per_sm"] == 1  # 2 x 51 > 100


def test_triton_resources_compiles_the_launches_for_an_h100(tmp_path):
    """The kernels exact kernelized attention launches with ``kernel="triton"`` (recorded
    under the interpreter), compiled for sm_90 by Triton's ptxas and read back: no GPU
    involved."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not hasattr(InterpretedFunction, "run"):
        pytest.skip("the tool records launches through Triton >= 3.5's interpreter")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "resources"
    subprocess.run([sys.executable, str(BENCHMARKS / "triton_resources.py"), "--methods",
                    "kernelized", "--configs", "16:float32", "--n", "32", "--features", "8",
                    "--out", str(out)], env=env, check=True, capture_output=True, text=True)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    kernels = {row["kernel"].split()[0] for row in rows}
    assert kernels == {"_flash_forward_kernel", "_flash_key_grad_kernel",
                       "_flash_query_grad_kernel"}
    for row in rows:
        assert 16 <= row["registers"] <= 255 and row["mma"] > 0 and row["exp2"] > 0
        assert row["warps_per_sm"] >= row["num_warps"]  # it can launch on an H100


def test_kernel_benchmark_runs_on_the_cpu_under_the_interpreter(tmp_path, monkeypatch):
    """benchmarks/gpu_kernels.py with --device cpu (its tiny defaults, TRITON_INTERPRET=1
    from conftest): every eager call and the m x m core at both sizes run, and the JSON
    holds them (no memory on the CPU). The compiled variants are not among the CPU
    defaults: Inductor takes a minute there. The core's fixed size is 16 here, not 64:
    the interpreter took half a minute of the test's minute there."""
    pytest.importorskip("triton")
    out = tmp_path / "kernels.json"
    argv = ["--device", "cpu", "--seq-lens", "40", "--features", "8", "--repeats", "1",
            "--out", str(out)]
    benchmark = load_benchmark("gpu_kernels")
    monkeypatch.setattr(benchmark, "CORE_LANDMARKS", 16)
    assert benchmark.main(argv) == 0
    result = json.loads(out.read_text())
    _assert_run_recorded(result, "gpu_kernels.py", argv)
    assert result["config"]["shapes"] == ["1,1,16,float32"] and result["config"]["repeats"] == 1
    assert [row["call"] for row in result["rows"]] == [
        "sdpa", "skyformer/torch", "skyformer/triton", "skyformer/triton+tf32",
        "skyformer/triton+implicit", "skyformer/triton+implicit+composable",
        "skyformer/triton+implicit+one-pass", "skyformer/triton+implicit+guard",
        "skyformer/triton+implicit+rows-bf16",
        "kernelized/torch", "kernelized/triton", "kernelized/fold", "sdpa+padding",
        "kernelized/auto+padding", "kernelized/torch+padding"]
    assert all(row["ms"] > 0 and row["peak_mib"] is None for row in result["rows"])
    assert {(row["shape"], row["call"]) for row in result["core"]} == {
        (f"1,1,m={m}", f"core/{kernel}/{mode}") for m in (8, 16)
        for kernel in ("torch", "triton", "triton+implicit") for mode in ("fwd", "fwd+bwd")}
    assert result["fallbacks"] == [] and result["complete"] is True
    # a short loan: the calls named (and sdpa, the ratios' base), no core; a run cut by
    # its time limit (SIGINT) at the second length keeps the rows of the first
    benchmark = load_benchmark("gpu_kernels")
    timed = benchmark.interleaved_median_seconds
    lengths = []

    def cut_at_the_second_length(calls, **options):
        lengths.extend(["a length"] if "sdpa" in calls else [])  # not the matmul rate's
        if len(lengths) == 2:
            raise KeyboardInterrupt
        return timed(calls, **options)

    benchmark.interleaved_median_seconds = cut_at_the_second_length
    with pytest.raises(KeyboardInterrupt):
        benchmark.main([
            "--device", "cpu", "--seq-lens", "40", "48", "--features", "8", "--repeats", "1",
            "--calls", "skyformer/triton+implicit*", "--no-core", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["call"] for row in result["rows"]] == [
        "sdpa", "skyformer/triton+implicit", "skyformer/triton+implicit+composable",
        "skyformer/triton+implicit+one-pass", "skyformer/triton+implicit+guard",
        "skyformer/triton+implicit+rows-bf16"]
    assert {row["n"] for row in result["rows"]} == {40}
    assert result["core"] == [] and result["complete"] is False


def test_the_guard_rows_leave_the_marks_to_the_guards_passes():
    """``+guard``: the guard runs and the product kernels do not mark (the A/B of the
    marks made in the kernels); outside, the kernels mark and the guard does not run."""
    from unittest import mock

    from skyformer.linalg import triton_kernels
    from skyformer.registry import autocast, guard

    gpu_kernels = load_benchmark("gpu_kernels")
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    seen = []

    def recorded(launch):
        def run(*args, **options):
            seen.append(options.get("show_nonfinite", False))
            return launch(*args, **options)
        return run

    calls = []
    for on in (False, True, False):
        seen.clear()
        with mock.patch.object(autocast, "show_nonfinite", wraps=guard.show_nonfinite) as shown, \
                mock.patch.object(triton_kernels, "rows_product",
                                  recorded(triton_kernels.rows_product)), \
                gpu_kernels.guard_passes(on):
            import skyformer
            skyformer.attention(q, k, v, "skyformer", num_features=8, kernel="triton",
                                generator=skyformer.random_key(0))
        calls.append((shown.call_count, list(seen)))
    assert calls == [(0, [True]), (1, [False]), (0, [True])]


@pytest.mark.parametrize(("argv", "message"), [
    (["--calls", "skyformr/*"], "argument --calls: 'skyformr/*' matches no call (it would "
                                "time sdpa alone); the calls: kernelized/auto+padding, "),
    (["--pause", "-1"], "argument --pause: must be a finite number of seconds, at least 0, "
                        "got -1.0"),
])
def test_the_kernel_benchmark_refuses_a_call_pattern_or_pause_before_it_starts(
        argv, message, monkeypatch, capsys):
    """A misspelt --calls pattern timed sdpa alone (a short GPU loan spent on nothing), a
    negative --pause failed in a traceback after the matmul rate was measured: both are
    refused in argparse's line first. The compiled variants' names count as calls."""
    benchmark = load_benchmark("gpu_kernels")
    monkeypatch.setattr(benchmark, "_matmul_rate", lambda device: pytest.fail("measured"))
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--device", "cpu", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert "skyformer/triton+implicit+cudagraphs" in benchmark._call_names(["triton", "auto"])


def test_the_tf32_row_allows_tf32_in_the_backward_launches_too(monkeypatch):
    """``skyformer/triton+tf32`` put torch's float32 precision back before the backward
    ran, so its backward kernels ran three TF32 passes as the plain row's did: every
    launch of the row, forward and backward, reads TF32 allowed, and the setting is
    restored after it."""
    import traceback

    from skyformer.linalg import triton_kernels

    gpu_kernels = load_benchmark("gpu_kernels")
    allowed = triton_kernels.tf32_allowed
    seen = []

    def recorded():
        backward = any(frame.name == "backward" for frame in traceback.extract_stack())
        seen.append(("backward" if backward else "forward", allowed()))
        return seen[-1][1]

    monkeypatch.setattr(triton_kernels, "tf32_allowed", recorded)
    q, k, v, grad = (torch.randn(1, 1, 32, 8) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    calls = gpu_kernels._calls(q, k, v, grad, 8, False)
    calls["skyformer/triton+tf32"]()
    assert {"forward", "backward"} <= {kind for kind, _ in seen}
    assert all(on for _, on in seen), seen
    assert matmul.fp32_precision == before
    # the other rows leave the setting alone: with the per-backend setting made (as
    # docs/gpu.md shows), the legacy getter they once called raised in every row
    matmul.fp32_precision = "ieee"
    try:
        seen.clear()
        calls["skyformer/triton"]()
    finally:
        matmul.fp32_precision = before
    assert seen and not any(on for _, on in seen)


def test_the_kernel_benchmark_names_a_kernel_that_fell_back(monkeypatch):
    """A row timed after its kernel gave way to the fallback times the fallback: the
    run says so (``fallbacks``)."""
    from skyformer.linalg import kernel_matmul_triton

    gpu_kernels = load_benchmark("gpu_kernels")
    assert gpu_kernels._fallbacks() == []
    failures = {(torch.device("cuda", 0), torch.bfloat16)}
    monkeypatch.setattr(kernel_matmul_triton.ONE_PASS_FALLBACK, "failures", failures)
    [line] = gpu_kernels._fallbacks()
    assert line.startswith(kernel_matmul_triton.ONE_PASS_FALLBACK.name)
    assert "cuda:0 torch.bfloat16" in line


def test_the_one_pass_sweep_runs_on_the_cpu_under_the_interpreter(tmp_path):
    """benchmarks/one_pass_sweep.py with --device cpu: both backward passes of each size
    run and are written (CPU operators' times, meaningless but positive)."""
    pytest.importorskip("triton")
    out = tmp_path / "sweep"
    argv = ["--device", "cpu", "--seq-lens", "24", "--head-dims", "8", "--dtypes", "float32",
            "--features", "8", "--iterations", "1", "--out", str(out)]
    assert load_benchmark("one_pass_sweep").main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "one_pass_sweep.py", argv)
    assert result["config"]["batch_heads"] == ["1,1"] and result["config"]["head_dims"] == [8]
    [row] = result["rows"]
    assert (row["b"], row["h"], row["n"], row["d"]) == (1, 1, 24, 8)
    assert row["two_ms"] > 0 and row["one_ms"] > 0 and row["ratio"] > 0
    assert "| float32 | 8 | 1,1 | 24 |" in out.with_suffix(".md").read_text()


def test_lemma3_tile_sweep_runs_on_the_cpu_under_the_interpreter(tmp_path):
    """benchmarks/lemma3_tiles.py end to end at one tiny size: each kernel's options timed
    against the PyTorch core (a launch per pass among them), the defaults marked, the
    fastest of each kernel recorded (the GPU run decides launch_options; on the CPU
    eager only, no CUDA graph), and ``applied`` launches what it recorded, the graphed
    options while a CUDA graph is captured and in the warm-up before it."""
    import json

    from skyformer.linalg import triton_lemma3, triton_lemma3_backward
    from skyformer.linalg.graph_launches import graph_launches_on

    out = tmp_path / "tiles.json"
    tiles = load_benchmark("lemma3_tiles")
    argv = ["--device", "cpu", "--options", "16,16,4,2", "32,16,4,1", "16,16,4,1,pass",
            "--out", str(out)]
    assert tiles.main(argv) == 0
    result = json.loads(out.read_text())
    _assert_run_recorded(result, "lemma3_tiles.py", argv)
    assert result["config"]["shape"] == "1,1" and result["config"]["features"] == [16]
    names = {(row["options"], row["kernel"], row["pass"], row["mode"])
             for row in result["rows"]}
    default = "rows 16 kc 16 warps 4 stages 1"
    options = (default, "rows 16 kc 16 warps 4 stages 2", f"{default} per pass")
    assert names == {("torch", "-", "fwd", "eager"), ("torch", "-", "fwd+bwd", "eager"),
                     (f"{default} keep", "backward", "fwd+bwd", "eager")} | {
        (option, kernel, what, "eager") for option in options
        for kernel, what in (("forward", "fwd"), ("backward", "fwd+bwd"))}  # 32 > m: out
    assert {row["options"] for row in result["rows"] if row["default"]} == {default}
    stored = {row["options"]: row["stored_mib"] for row in result["rows"]
              if row["kernel"] == "backward"}  # 6 iterates, or 22 matrices of 16 x 16
    assert stored[default] * 2**20 == 6 * 16 * 16 * 4
    assert stored[f"{default} keep"] * 2**20 == 22 * 16 * 16 * 4
    assert set(result["best"]) == {"16"}
    best = result["best"]["16"]
    assert set(best) == {"forward", "backward"} and best["forward"]["ROWS"] == 16
    per_pass = dict(best["backward"], PER_PASS=True, num_warps=2)
    with tiles.applied({"16": {**best, "backward_graphed": per_pass}}):
        assert triton_lemma3.launch_options(16) == best["forward"]
        assert triton_lemma3_backward.launch_options(16, backward=True) == best["backward"]
        assert triton_lemma3_backward.launch_options(16, backward=True,
                                                     graphed=True) == per_pass
        assert triton_lemma3.launch_options(16, graphed=True) == best["forward"]
        assert not graph_launches_on()
        with tiles.graphed_options():  # the warm-up before a capture: the same kernels
            assert graph_launches_on()
        assert triton_lemma3.launch_options(64)["BLOCK"] == 64  # not measured: the default
    keep = dict(best["backward"], KEEP_PRODUCTS=True)
    with tiles.applied({"16": {**best, "backward": keep}}):  # the forward keeps them then
        assert triton_lemma3.keeps_products(16) and not triton_lemma3.keeps_products(32)
    assert triton_lemma3.launch_options(16)["num_stages"] == 1
    assert triton_lemma3.launch_options(16, graphed=True)["PER_PASS"]  # the library's own
    assert not triton_lemma3.launch_options(16)["PER_PASS"]
    assert triton_lemma3.keeps_products(16, graphed=True) and not triton_lemma3.keeps_products(16)


def test_product_tile_sweep_runs_on_the_cpu_under_the_interpreter(tmp_path):
    """benchmarks/product_tiles.py end to end at one tiny size: each product kernel's
    candidates timed in a Skyformer call, the defaults marked, the fastest recorded, and
    ``tuned.applied`` launches what it recorded (other head dims keep the defaults)."""
    from skyformer.linalg import triton_kernels

    out = tmp_path / "tiles.json"
    argv = ["--device", "cpu", "--features", "16",  # a 16 x 16 core
            "--rows", "32,16,4,1", "--cols", "32,32,4,2", "--out", str(out)]
    assert load_benchmark("product_tiles").main(argv) == 0
    result = json.loads(out.read_text())
    _assert_run_recorded(result, "product_tiles.py", argv)
    assert result["config"]["shape"] == "1,1,16,float32" and result["config"]["seq_len"] == 64
    assert {(row["kernel"], row["tiles"]) for row in result["rows"]} == {
        ("rows", "n 64 m 32 warps 4 stages 1"), ("rows", "n 32 m 16 warps 4 stages 1"),
        ("cols", "n 64 m 64 warps 4 stages 1"), ("cols", "n 32 m 32 warps 4 stages 2")}
    assert sum(row["default"] for row in result["rows"]) == 2
    best = result["best"]
    assert best["width"] == 16 and len(best["rows"]) == len(best["cols"]) == 4
    with load_benchmark("tuned").applied([str(out)]):
        assert list(triton_kernels._row_tiles(16, 16, torch.float32)) == best["rows"]
        assert list(triton_kernels._col_tiles(16, 8, torch.float32)) == best["cols"]
        assert triton_kernels._row_tiles(64, 64, torch.float32) == (64, 32, 4, 1)
    assert triton_kernels._row_tiles(16, 16, torch.float32) == (64, 32, 4, 1)
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not the output of"), \
            load_benchmark("tuned").applied([str(bad)]):
        pass


def test_flash_tile_sweep_runs_on_the_cpu_under_the_interpreter(tmp_path):
    """benchmarks/flash_tiles.py end to end at one tiny size: each flash kernel's
    candidates timed in an exact kernelized call, the defaults marked, the fastest
    recorded, and ``tuned.applied`` launches what it recorded (other dtypes and head dims
    keep the defaults)."""
    from skyformer.ops.kernelized import triton_flash

    out = tmp_path / "flash.json"
    argv = ["--device", "cpu", "--forward", "32,16,4,1", "--keys", "16,32,4,2",
            "--queries", "64,32,4,2", "--out", str(out)]
    assert load_benchmark("flash_tiles").main(argv) == 0
    result = json.loads(out.read_text())
    _assert_run_recorded(result, "flash_tiles.py", argv)
    assert result["config"]["shape"] == "1,1,16,float32" and result["config"]["repeats"] == 1
    default = "own 64 step 32 warps 4 stages 2"  # float32 at head dim 16
    assert {(row["kernel"], row["tiles"]) for row in result["rows"]} == {
        ("forward", default), ("forward", "own 32 step 16 warps 4 stages 1"),
        ("keys", default), ("keys", "own 16 step 32 warps 4 stages 2"),
        ("queries", default)}  # a candidate equal to the default is timed once
    assert sum(row["default"] for row in result["rows"]) == 3
    best = result["best"]
    assert (best["dtype"], best["head_dim"]) == ("float32", 16)
    with load_benchmark("tuned").applied([str(out)]):
        keys = triton_flash.flash_tiles(torch.float32, 16, "keys")
        assert [keys["BLOCK_N"], keys["BLOCK_M"], keys["num_warps"], keys["num_stages"]] \
            == best["keys"]
        assert triton_flash.flash_tiles(torch.bfloat16, 64, "forward")["BLOCK_M"] == 128
    assert triton_flash.flash_tiles(torch.float32, 16, "forward")["BLOCK_M"] == 64


def test_timed_calls_leave_no_gradient_for_the_next_to_add_into(monkeypatch):
    """Each timed forward + backward makes its own gradients: host_time's calls (which
    gpu_host_split times too) and gpu_host_split's SDPA call kept the last call's, so
    every later call added into them, one accumulation more than the calls they are
    compared with."""
    host_time = load_benchmark("host_time")
    split = load_benchmark("gpu_host_split")
    leaves = []
    real_randn = torch.randn

    def recorded(*args, **kwargs):
        leaves.append(real_randn(*args, **kwargs))
        return leaves[-1]

    monkeypatch.setattr(torch, "randn", recorded)
    calls = [host_time.call_of("skyformer", 1, 1, 16, 8, 8),
             split.sdpa_call((1, 1, 16, 8), torch.float32, torch.device("cpu"))]
    monkeypatch.undo()
    assert len(leaves) == 6 and all(t.requires_grad for t in leaves)
    for call in calls:
        call()
    assert all(t.grad is None for t in leaves)


def test_host_time_stubs_every_launch_and_reports_each_method(tmp_path, monkeypatch):
    """Host time with the Triton launches stubbed: no kernel may run (under the
    interpreter a launch that escaped the stubs would be timed as host work)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    host_time = load_benchmark("host_time")

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self.fn.__name__} was launched")

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", refuse)
    out = tmp_path / "host.md"
    argv = ["--shape", "1,2,32,16", "--features", "8", "--calls", "2", "--profile", "3",
            "--guard-passes", "--out", str(out)]
    assert host_time.main(argv) == 0
    text = out.read_text()
    for method in (*host_time.METHODS, "skyformer, guard's passes"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{method}` |"))
        median, least = (float(cell) for cell in row.split("|")[2:4])
        assert 0 < least <= median
    result = json.loads(out.with_suffix(".json").read_text())  # the table's numbers beside
    _assert_run_recorded(result, "host_time.py", argv)
    assert [row["method"] for row in result["rows"]] == [*host_time.METHODS,
                                                         "skyformer, guard's passes"]
    assert all(0 < row["min_ms"] <= row["median_ms"] for row in result["rows"])


def test_host_split_times_the_call_with_and_without_its_kernels(tmp_path, monkeypatch):
    """The device's host split (gpu_host_split.py), checked on CPU tensors: the stubbed
    call must launch no kernel, so under the interpreter it is far cheaper than the call;
    the rows compared are timed in one interleaved run (the stubbed call had a run of its
    own, after the others)."""
    pytest.importorskip("triton")
    split = load_benchmark("gpu_host_split")
    runs = []
    timed = split.interleaved_seconds
    monkeypatch.setattr(split, "interleaved_seconds",
                        lambda calls, **options: runs.append(list(calls)) or timed(calls,
                                                                                   **options))
    out = tmp_path / "split.md"
    argv = ["--device", "cpu", "--shape", "1,2,32,16", "--dtype", "float32", "--features", "8",
            "--calls", "1", "--warmup", "1", "--out", str(out)]
    assert split.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "gpu_host_split.py", argv)
    assert [row["call"] for row in result["rows"]] == runs[0]
    assert result["config"]["dtype"] == "float32" and result["launch_us"][0]["us"] > 0
    cells = {line.split("|")[1].strip(): float(line.split("|")[2])
             for line in out.read_text().splitlines()
             if line.startswith("| ") and line.split("|")[2].strip()[:1].isdigit()}
    assert runs == [["skyformer, as it is", "skyformer, Triton kernels stubbed", "SDPA"]]
    assert cells["skyformer, Triton kernels stubbed"] < cells["skyformer, as it is"] / 10
    assert cells["SDPA"] > 0 and cells["PyTorch operation (x.add_(0))"] > 0
    assert cells["Triton, kernel[grid](...)"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_host_split_without_cuda_says_how_to_check_the_script(capsys):
    with pytest.raises(SystemExit):
        load_benchmark("gpu_host_split").main([])
    assert "--device cpu" in capsys.readouterr().err


def test_stubbed_memory_counts_what_each_variant_holds(tmp_path):
    """benchmarks/stubbed_memory.py at a tiny shape: the step products kept hold exactly
    16 more m x m float32 matrices a matrix from the forward to the backward pass, and
    an inference call's peak is no more than a differentiated call's."""
    pytest.importorskip("triton")
    memory = load_benchmark("stubbed_memory")
    out = tmp_path / "memory.md"
    b, h, m = 1, 4, 64  # 1 MiB of kept products: the table has 0.1 MiB steps
    argv = ["--shape", f"{b},{h},128,16", "--features", str(m), "--dtype", "float32",
            "--kept-products", "--rows-copied", "--out", str(out)]
    assert memory.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "stubbed_memory.py", argv)
    assert len(result["rows"]) == 6 and result["rows"][0]["peak_mib"] > 0
    rows = {}
    for line in out.read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = (float(cells[1]), float(cells[3]), float(cells[4]))
    assert len(rows) == 6
    for method in memory.METHODS:
        peak, held, inference = rows[f"`{method}`"]
        kept = rows[f"`{method}`, step products kept"]
        assert kept[1] - held == pytest.approx(b * h * 16 * m * m * 4 / 2**20, abs=0.1)
        assert 0 < inference <= peak and held <= peak


def test_gpu_script_runs_every_stage_past_failures_limits_and_reruns(tmp_path):
    """benchmarks/gpu.sh with a stand-in ``python3`` (CUDA present, one CUDA test failing,
    the kernel benchmark crashing, the LRA stage past its time limit): every later stage
    still runs, stages.txt records each exit and the script's status says a stage failed.
    A rerun with the same folder runs only the stage stopped by its limit; once the
    failed stages pass (their markers deleted), the status is 0. Ctrl-C (SIGINT to the
    script) stops the running stage and the script, and marks nothing done."""
    import os
    import signal
    import subprocess
    import time

    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls.txt"
    (stub / "python3").write_text(
        "#!/usr/bin/env bash\n"
        'echo "$*" >> "$CALLS"\n'
        'case "$*" in\n'
        '  *"import xdist"*) exit 1;;\n'
        '  *"-m pytest"*) echo "1 failed, 9 passed in 3.0s"; exit "$TESTS_EXIT";;\n'
        '  *gpu_kernels.py*) echo "kernels crashed" >&2; exit "$KERNELS_EXIT";;\n'
        '  *lra_gpu.py*) echo "lra started"; sleep "$LRA_SLEEP";;\n'
        '  *_tiles.py*) [ -z "$TILES" ] || echo "{}" > "${@: -1}";;\n'
        '  *"-m skyformer bench"*) echo "| method | N=1024 |";;\n'
        "esac\n")
    (stub / "python3").chmod(0o755)
    out = tmp_path / "gpu"

    def env(**settings):
        return {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "CALLS": str(calls),
                "STAGE_SECONDS": "2", "TESTS_EXIT": "1", "KERNELS_EXIT": "2",
                "LRA_SLEEP": "0", "TILES": "", **settings}

    def run(**settings):
        return subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), str(out)],
                              env=env(**settings), capture_output=True, text=True, timeout=60)

    def stages():
        lines = (out / "stages.txt").read_text().splitlines()
        return {line.split(": exit ")[0]: line.split(": exit ")[1] for line in lines}

    first = run(LRA_SLEEP="30")
    assert first.returncode == 1, first.stdout + first.stderr
    assert {name: status.split()[0] for name, status in stages().items()} == {
        "tests": "1", "profile": "0", "split": "0", "kernels": "2", "bench_float32": "0",
        "bench_bfloat16": "0", "lra": "124", "tiles": "0", "ptiles": "0", "ftiles": "0"}
    assert stages()["lra"].endswith("(time limit)")
    assert "1 failed" in (out / "tests.txt").read_text()
    assert "kernels crashed" in (out / "kernels.log").read_text()
    assert "| method | N=1024 |" in (out / "bench_bfloat16.md").read_text()
    assert "--resume" in calls.read_text()
    assert not (out / ".done-lra").exists() and (out / ".done-kernels").exists()

    before = len(calls.read_text().splitlines())
    second = run()
    assert second.stdout.count("done in an earlier run") == 9
    # the CUDA check, the versions for machine.txt, the xdist check; lra
    assert len(calls.read_text().splitlines()) == before + 4
    assert stages()["lra"].startswith("0 ") and len(stages()) == 10
    # the rerun of the stage stopped by its limit keeps that run's output beside its own
    assert "lra started" in (out / "lra.earlier.log").read_text()
    assert second.returncode == 1  # tests and kernels failed, and stay so
    (out / ".done-tests").unlink()
    (out / ".done-kernels").unlink()
    assert run(TESTS_EXIT="0", KERNELS_EXIT="0").returncode == 0

    (out / ".done-lra").unlink()
    (out / "lra.log").unlink()
    script = subprocess.Popen(  # SIGINT as a terminal's Ctrl-C: not ignored by the script
        ["bash", str(BENCHMARKS / "gpu.sh"), str(out)],
        env=env(LRA_SLEEP="30", STAGE_SECONDS="40"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 20
        while "lra started" not in (out / "lra.log").read_text() \
                if (out / "lra.log").exists() else True:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        started = time.monotonic()
        script.send_signal(signal.SIGINT)
        printed, _ = script.communicate(timeout=20)
    finally:
        script.kill()
    assert script.returncode == 130, printed
    assert time.monotonic() - started < 10  # the stage was stopped, not waited for
    assert stages()["lra"].endswith("(interrupted)") and not (out / ".done-lra").exists()
    assert stages()["lra"].startswith("130 ")  # the stage's own status: stopped by SIGINT

    bad = run(STAGE_SECONDS="2m")
    assert bad.returncode == 2 and "whole number of seconds" in bad.stderr

    import tarfile  # ARCHIVE: the whole folder in one file, after every stage

    (out / ".done-lra").unlink(missing_ok=True)
    packed = tmp_path / "back" / "gpu.tar.gz"
    packed.parent.mkdir()
    assert run(ARCHIVE=str(packed), TESTS_EXIT="0", KERNELS_EXIT="0").returncode == 0
    with tarfile.open(packed) as archive:
        names = set(archive.getnames())
    assert {"./stages.txt", "./lra.log", "./bench_float32.md", "./.done-lra"} <= names
    assert list(packed.parent.iterdir()) == [packed]  # no partial file left

    # ONLY: the stages named; the kernels and the profile launch the timed tile options
    calls.write_text("")
    only = tmp_path / "only"
    chosen = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), str(only)],
                            env=env(ONLY="tiles ptiles ftiles kernels", TILES="1",
                                    KERNELS_EXIT="0"),
                            capture_output=True, text=True, timeout=60)
    assert chosen.returncode == 0, chosen.stdout + chosen.stderr
    assert set(stages_of(only)) == {"tiles", "ptiles", "ftiles", "kernels"}
    kernels = [line for line in calls.read_text().splitlines() if "gpu_kernels.py" in line]
    assert len(kernels) == 1 and (f"--tiles {only}/lemma3_tiles.json {only}/product_tiles.json "
                                  f"{only}/flash_tiles.json") in kernels[0]
    assert "gpu_profile.py" not in calls.read_text()
    assert "gpu_host_split.py" not in calls.read_text()

    # PYTHON names the interpreter of every stage (no python3 of the stand-in's on PATH)
    calls.write_text("")
    (stub / "python3").rename(stub / "cuda-python")
    named = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), str(tmp_path / "named")],
                           env=env(ONLY="kernels bench_float32", KERNELS_EXIT="0",
                                   PYTHON=str(stub / "cuda-python")),
                           capture_output=True, text=True, timeout=60)
    assert named.returncode == 0, named.stdout + named.stderr
    assert "gpu_kernels.py" in calls.read_text() and "-m skyformer bench" in calls.read_text()


def test_the_short_gpu_check_runs_its_own_stages_through_the_same_runner(tmp_path):
    """benchmarks/gpu_short.sh (SHORT=1 of gpu.sh) with a stand-in ``python3``: the CUDA
    tests, the model shape blocked and interleaved (exact kernelized attention's forms
    among the blocked calls), the paired steps, the LRA shape, the causal bench and the
    bfloat16 accuracy, each a stage of stages.txt; machine.txt names the code measured; a
    rerun skips them all."""
    import os
    import subprocess

    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls.txt"
    (stub / "python3").write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS"\n'
                                  'case "$*" in *"import torch, triton"*) echo "torch x";;'
                                  ' *"-m pytest"*) echo "9 passed in 3.0s";; esac\n')
    (stub / "python3").chmod(0o755)
    out = tmp_path / "short"
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "CALLS": str(calls),
           "CODE": "abc123"}

    def run():
        return subprocess.run(["bash", str(BENCHMARKS / "gpu_short.sh"), str(out)], env=env,
                              capture_output=True, text=True, timeout=60)

    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert list(stages_of(out)) == ["tests", "kernels_model", "kernels_model_interleaved",
                                    "paired_steps", "kernels_lra", "bench_causal",
                                    "half_gradients"]
    assert "code abc123" in (out / "machine.txt").read_text()
    blocked = [line for line in calls.read_text().splitlines()
               if "gpu_kernels.py --timing blocked" in line and "4,16,64" in line]
    assert len(blocked) == 1 and "kernelized/*" in blocked[0]
    assert "tests/ops/test_kernelized_fold.py" in calls.read_text()
    assert "half_gradients.py --device cuda" in calls.read_text()
    assert run().stdout.count("done in an earlier run") == 7
    usage = subprocess.run(["bash", str(BENCHMARKS / "gpu_short.sh")], env=env,
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode != 0 and "usage" in usage.stderr
    # a misspelt ONLY, or a stage of the whole measurement, ran nothing and exited 0: it
    # stops before the machine is used, naming the stages it takes
    calls.write_text("")
    for only in ("kernels_modle", "tiles"):
        wrong = subprocess.run(["bash", str(BENCHMARKS / "gpu_short.sh"),
                                str(tmp_path / "wrong")], env={**env, "ONLY": only},
                               capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 2
        assert f"ONLY names '{only}', which is not a stage of this run (SHORT=1)" in wrong.stderr
        assert "its stages: tests kernels_model " in wrong.stderr
    blank = subprocess.run(["bash", str(BENCHMARKS / "gpu_short.sh"), str(tmp_path / "wrong")],
                           env={**env, "ONLY": "  "}, capture_output=True, text=True,
                           timeout=60)
    assert blank.returncode == 2 and "ONLY names no stage" in blank.stderr
    skipped = subprocess.run(["bash", str(BENCHMARKS / "gpu_short.sh"),
                              str(tmp_path / "wrong")],
                             env={**env, "ONLY": "tests", "SKIP_TESTS": "1"},
                             capture_output=True, text=True, timeout=60)
    assert skipped.returncode == 2 and "SKIP_TESTS skips them" in skipped.stderr
    assert calls.read_text() == "" and not (tmp_path / "wrong").exists()


def stages_of(out):
    lines = (out / "stages.txt").read_text().splitlines()
    return {line.split(": exit ")[0]: line.split(": exit ")[1] for line in lines}


def _strict(text):
    """``json.loads`` that refuses the NaN and Infinity tokens, as strict JSON readers do."""
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} written"))


NAN, INF = float("nan"), float("inf")


def _kernels_with_a_nan_time(monkeypatch, out):
    module = load_benchmark("gpu_kernels")
    monkeypatch.setattr(module, "_matmul_rate", lambda device: {"bfloat16": INF,
                                                                "float32": INF})
    monkeypatch.setattr(module, "_calls", lambda *args: {"sdpa": lambda: None})
    monkeypatch.setattr(module, "interleaved_median_seconds",
                        lambda calls, **kwargs: dict.fromkeys(calls, NAN))
    monkeypatch.setattr(module, "_peak", lambda fn, device: None)
    monkeypatch.setattr(module, "_core_rows", lambda *args: [])
    assert module.main(["--device", "cpu", "--seq-lens", "8", "--out", str(out)]) == 0
    return _strict(out.read_text())["rows"][0]["ms"]


def test_gpu_kernels_times_each_call_in_its_own_block_when_asked(monkeypatch, tmp_path):
    """``--timing blocked --pause S``: the calls go to the blocked timer with that pause,
    and the JSON says how they were timed."""
    module = load_benchmark("gpu_kernels")
    monkeypatch.setattr(module, "_matmul_rate", lambda device: {"bfloat16": 1.0,
                                                                "float32": 1.0})
    monkeypatch.setattr(module, "_calls", lambda *args: {"sdpa": lambda: None})
    seen = {}

    def blocked(calls, **kwargs):
        seen.update(kwargs)
        return dict.fromkeys(calls, 1e-3)

    monkeypatch.setattr(module, "blocked_median_seconds", blocked)
    monkeypatch.setattr(module, "interleaved_median_seconds",
                        lambda *args, **kwargs: pytest.fail("interleaved timing used"))
    monkeypatch.setattr(module, "_peak", lambda fn, device: None)
    monkeypatch.setattr(module, "_core_rows", lambda *args: [])
    out = tmp_path / "kernels.json"
    assert module.main(["--device", "cpu", "--seq-lens", "8", "--timing", "blocked",
                        "--pause", "0.25", "--out", str(out)]) == 0
    assert seen["pause"] == 0.25
    result = json.loads(out.read_text())
    assert result["config"]["timing"] == "blocked" and result["rows"][0]["ms"] == 1.0


def _profile_with_a_nan_time(monkeypatch, out):
    module = load_benchmark("gpu_profile")
    monkeypatch.setattr(module, "profile_call", lambda *args: {
        "wall_ms": NAN, "host_ms": NAN, "syncs": 0, "busy_ms": NAN, "idle_share": NAN,
        "launches": 1, "host_top": [], "top": []})
    assert module.main(["--device", "cpu", "--shape", "1,1,8,float32", "--seq-lens", "8",
                        "--methods", "sdpa", "--out", str(out)]) == 0
    return _strict(out.with_suffix(".json").read_text())["rows"][0]["wall_ms"]


def _lra_with_a_nan_time(monkeypatch, out):
    module = load_benchmark("lra_gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stub")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(module, "measure", lambda *args: (NAN, 1.0))
    assert module.main(["--tasks", "listops", "--methods", "softmax", "--out", str(out)]) == 0
    return _strict(out.read_text())["rows"][0]["steps_per_s"]


def _lemma3_with_a_nan_time(monkeypatch, out):
    module = load_benchmark("lemma3_tiles")
    monkeypatch.setattr(module, "measure", lambda *args: ([{"ms": NAN}], {}))
    assert module.main(["--device", "cpu", "--out", str(out)]) == 0
    return _strict(out.read_text())["rows"][0]["ms"]


def _sweep_with_a_nan_time(monkeypatch, out):
    load_benchmark("tile_sweep").record("products", [{"ms": NAN}], {}, [], str, str(out), False, {})
    return _strict(out.read_text())["rows"][0]["ms"]


def _stubbed_triton_resources(monkeypatch, exp2):
    """benchmarks/triton_resources.py with one recorded launch and its compiler stubbed
    (``exp2`` exp2 instructions)."""
    pytest.importorskip("triton")
    module = load_benchmark("triton_resources")
    launch = {"module": "m", "kernel": "k", "constants": {}, "options": {}, "arguments": {}}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(module.subprocess, "run", lambda *args, **kwargs: _completed(
        json.dumps([launch])))
    monkeypatch.setattr(module, "compile_launch", lambda launch, arch: {
        "registers": 32, "stack": 0, "spill_stores": 0, "spill_loads": 0, "mma": 1,
        "exp2": exp2, "shared": 0, "num_warps": 4, "warps_per_sm": 16})
    return module


def _resources_with_a_nan_count(monkeypatch, out):
    module = _stubbed_triton_resources(monkeypatch, exp2=NAN)
    assert module.main(["--methods", "kernelized", "--configs", "16:float32",
                        "--out", str(out)]) == 0
    return _strict(out.with_suffix(".json").read_text())["rows"][0]["exp2"]


def test_triton_resources_records_its_settings_environment_and_command(monkeypatch,
                                                                        tmp_path):
    """The JSON names the methods, head dims, dtypes and landmark counts compiled, the
    environment and the command (it held Triton's version and the kernel options alone);
    the recording and the compiler stubbed."""
    module = _stubbed_triton_resources(monkeypatch, exp2=2)
    out = tmp_path / "resources"
    argv = ["--methods", "kernelized", "--configs", "16:float32", "--features", "8",
            "--out", str(out)]
    assert module.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "triton_resources.py", argv)
    assert result["config"]["methods"] == ["kernelized"]
    assert result["config"]["configs"] == ["16:float32"] and result["config"]["features"] == [8]
    assert result["rows"][0]["exp2"] == 2


def _completed(stdout):
    import subprocess

    return subprocess.CompletedProcess([], 0, stdout=stdout, stderr="")


def _causal_window_with_a_nan_error(monkeypatch, out):
    row = {"layer": 0, "method": "skyformer", "causal_local": True, "n": 8,
           "num_features": 4, "error_mean": NAN, "error_std": NAN, "seeds": 1}
    load_benchmark("causal_window").write([row], out, {"max": INF})
    result = _strict(out.with_suffix(".json").read_text())
    assert result["config"] == {"max": None}
    return result["rows"][0]["error_mean"]


@pytest.mark.parametrize("script", [
    _kernels_with_a_nan_time, _profile_with_a_nan_time, _lra_with_a_nan_time,
    _lemma3_with_a_nan_time, _sweep_with_a_nan_time, _resources_with_a_nan_count,
    _causal_window_with_a_nan_error], ids=lambda script: script.__name__.strip("_"))
def test_benchmark_json_holds_null_for_a_non_finite_number(script, monkeypatch, tmp_path):
    """A NaN or infinite measurement (stubbed here) is written as null, not as the NaN /
    Infinity tokens that strict JSON readers refuse."""
    assert script(monkeypatch, tmp_path / "out.json") is None


def test_the_paired_steps_benchmark_says_it_needs_a_gpu(capsys):
    """benchmarks/paired_steps.py times CUDA graphs: without CUDA it says so and exits 2
    (on a GPU the CUDA test run does not start it; docs/gpu-record.md has its measurement)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would time it")
    assert load_benchmark("paired_steps").main(["--repeats", "1"]) == 2
    assert "run it on a machine with a GPU" in capsys.readouterr().err


def test_col_slices_launches_the_cols_kernel_with_each_target_and_reports_it(monkeypatch,
                                                                          tmp_path):
    """``col_slices.py`` on the CPU (a GPU of one SM): each target reaches the cols
    kernel's grid as its number of row slices, and the table and JSON list every target."""
    pytest.importorskip("triton")
    from skyformer.linalg import triton_kernels

    module = load_benchmark("col_slices")
    grids = []
    launch = triton_kernels._cols_kernel

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return launch[grid]

    monkeypatch.setattr(triton_kernels, "_cols_kernel", Recording())
    out = tmp_path / "slices.txt"
    argv = ["--device", "cpu", "--shape", "1,1,16,float32", "--seq-lens", "256",
            "--features", "8", "--targets", "1", "4", "--repeats", "1", "--out", str(out)]
    assert module.main(argv) == 0
    assert {grid[2] for grid in grids} == {1, 4}  # four row blocks of 64
    result = json.loads(out.with_suffix(".json").read_text())
    assert [row["programs_per_sm"] for row in result["rows"]] == [1, 4]
    assert result["command"] == "python benchmarks/col_slices.py " + " ".join(argv)
    assert "| 256 | 4 |" in out.read_text()


def test_paired_steps_writes_its_times_settings_environment_and_command(monkeypatch,
                                                                        tmp_path):
    """Beside the text table, a JSON of the times with what they were measured with (the
    CUDA calls stubbed: they need a GPU)."""
    module = load_benchmark("paired_steps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stub")
    monkeypatch.setattr(module, "calls", lambda matrices, m: {f"{matrices}, eager": None})
    monkeypatch.setattr(module, "interleaved_median_seconds",
                        lambda calls, **kwargs: dict.fromkeys(calls, 2e-3))
    out = tmp_path / "paired.txt"
    argv = ["--matrices", "4", "2", "--repeats", "1", "--out", str(out)]
    assert module.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["config"]["matrices"] == [4, 2] and result["environment"]["device_name"] == "stub"
    assert result["command"] == "python benchmarks/paired_steps.py " + " ".join(argv)
    assert result["rows"] == [{"matrices": 4, "call": "4, eager", "ms": 2.0},
                              {"matrices": 2, "call": "2, eager", "ms": 2.0}]
    assert "4, eager" in out.read_text()


def test_launch_counts_writes_its_counts_settings_environment_and_command(monkeypatch,
                                                                          tmp_path):
    """Beside the Markdown table, a JSON of the counts with what they were counted with
    (the counting stubbed)."""
    module = load_benchmark("launch_counts")
    monkeypatch.setattr(module, "count", lambda method, b, h, n, d, m: m)
    out = tmp_path / "counts.md"
    argv = ["--features", "8", "--out", str(out)]
    assert module.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    _assert_run_recorded(result, "launch_counts.py", argv)
    assert result["config"]["shape"] == [1, 2, 256, 64]
    assert result["rows"][0] == {"method": "skyformer", "m": 8, "pytorch_core": 8,
                                 "as_chosen": 8}
    assert "| `skyformer` | 8 | 8 | 8 |" in out.read_text()


def test_the_kernel_benchmarks_one_pass_row_runs_the_one_pass_kernel(monkeypatch):
    """``skyformer/triton+implicit+one-pass`` turns the option on for its call's backward
    pass alone (what its A/B against ``skyformer/triton+implicit`` claims)."""
    pytest.importorskip("triton")
    from skyformer.linalg import kernel_matmul_triton, triton_ops

    seen = []
    real = triton_ops.one_pass_product
    monkeypatch.setattr(triton_ops, "one_pass_product",
                        lambda *args: seen.append("one pass") or real(*args))
    q, k, v, grad = (torch.randn(1, 1, 40, 8) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    calls = load_benchmark("gpu_kernels")._calls(q, k, v, grad, 8, compiled=False)
    calls["skyformer/triton+implicit"]()
    assert seen == [] and not kernel_matmul_triton.ONE_PASS_BACKWARD
    calls["skyformer/triton+implicit+one-pass"]()
    assert seen == ["one pass", "one pass"] and not kernel_matmul_triton.ONE_PASS_BACKWARD


def test_the_half_gradient_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/half_gradients.py at a tiny size: both paths in both dtypes against
    float64, errors finite and float32 far closer than bfloat16."""
    pytest.importorskip("triton")
    out = tmp_path / "half"
    argv = ["--methods", "nystrom_softmax", "--noise", "0.1", "--n", "24", "--head-dim", "8",
            "--features", "8", "--out", str(out)]
    assert load_benchmark("half_gradients").main(argv) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["config"]["methods"] == ["nystrom_softmax"] and saved["config"]["noise"] == [0.1]
    assert saved["environment"]["torch_threads"] == torch.get_num_threads()
    assert saved["command"] == "python benchmarks/half_gradients.py " + " ".join(argv)
    rows = saved["rows"]
    assert [(r["kernel"], r["dtype"]) for r in rows] == [
        ("torch", "float32"), ("torch", "bfloat16"), ("triton", "float32"),
        ("triton", "bfloat16")]
    for r in rows:
        bound = 1e-3 if r["dtype"] == "float32" else 5e-2
        assert all(0 <= r[name] < bound for name in ("out", "dq", "dk", "dv")), r
    assert "| nystrom_softmax | 0.1 | 3 | triton | bfloat16 |" in out.with_suffix(".md").read_text()


def test_half_gradients_draws_landmarks_per_seed_and_may_share_one_upstream_row(
        monkeypatch):
    """``--landmark-seeds``: one row per seed, path and dtype, each call with that draw;
    ``--one-upstream-row``: every output row weighted by the same gradient row."""
    half_gradients = load_benchmark("half_gradients")
    seen = []

    def fake_call(method, inputs, dtype, device, kernel, features, seed):
        seen.append((seed, bool((inputs[3] == inputs[3][..., :1, :]).all())))
        return [torch.ones(1)] * 4

    monkeypatch.setattr(half_gradients, "call", fake_call)
    argv = ["--methods", "skyformer", "--noise", "0.0", "--n", "8", "--head-dim", "4",
            "--features", "4", "--landmark-seeds", "0", "5", "--one-upstream-row"]
    assert half_gradients.main(argv) == 0
    assert [seed for seed, _ in seen] == [0] * 5 + [5] * 5  # float64 and four calls each
    assert all(shared for _, shared in seen)


def test_half_gradients_gives_every_call_the_same_output_weights(monkeypatch):
    """The gradients are compared against float64 for the same upstream gradient: the
    output weights rounded to bfloat16 as q, k and v are, in the reference too (rounded
    in the bfloat16 call alone, their rounding counted as the call's gradient error)."""
    half_gradients = load_benchmark("half_gradients")
    monkeypatch.setattr(half_gradients.skyformer, "attention",
                        lambda q, k, v, method, **options: q + k + v)  # dv = the weights
    inputs = half_gradients.clustered(8, 4, 2, 0.1, seed=0)
    exact = half_gradients.call("skyformer", inputs, torch.float64, "cpu", "torch", 4)
    for dtype in (torch.float32, torch.bfloat16):
        got = half_gradients.call("skyformer", inputs, dtype, "cpu", "torch", 4)
        for grad, reference in zip(got[1:], exact[1:], strict=True):
            assert torch.equal(grad.double(), reference)


def test_triton_resources_records_the_graph_launches_on_request(monkeypatch):
    """``--graph-launches``: the calls run inside ``cuda_graph_launches()``, so the Lemma 3
    core launches a kernel per pass instead of one program per matrix."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not hasattr(InterpretedFunction, "run"):
        pytest.skip("the tool records launches through Triton >= 3.5's interpreter")
    from skyformer.linalg import triton_kernels

    # the recording stands the target's capability in for the device's: undone after
    monkeypatch.setattr(triton_kernels, "device_capability", triton_kernels.device_capability)
    record = load_benchmark("triton_resources")._record_launches
    spec = {"method": "skyformer", "head_dim": 16, "dtype": "float32", "features": 8,
            "n": 24, "pinv_gradient": "implicit"}
    kernels = {flag: {launch["kernel"] for launch in record(spec | {"graph_launches": flag})}
               for flag in (False, True)}
    assert {"_forward_kernel", "_backward_kernel"} <= kernels[False]
    assert not kernels[False] & {"_forward_pass_kernel", "_backward_pass_kernel"}
    assert {"_forward_pass_kernel", "_backward_pass_kernel"} <= kernels[True]
    assert not kernels[True] & {"_forward_kernel", "_backward_kernel"}


def test_importing_a_benchmark_leaves_the_interpreter_setting_alone():
    """The scripts import each other (gpu_kernels.py imports launch_counts.py), so one
    that set TRITON_INTERPRET when imported turned the interpreter on for a GPU run of
    its importer. Every module is imported in one process started without the variable,
    as on the GPU machine, and the variable is dropped again after a module set it."""
    import os
    import subprocess

    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    code = ("import importlib, os, sys\n"
            f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    if 'TRITON_INTERPRET' in os.environ:\n"
            "        print(name, os.environ.pop('TRITON_INTERPRET'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True,
                          text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "", f"set TRITON_INTERPRET when imported: {done.stdout}"


def test_lra_gpu_refuses_methods_without_softmax(capsys):
    """Its columns are ratios to softmax; without it they were to the first method,
    still labelled time/softmax."""
    with pytest.raises(SystemExit):
        load_benchmark("lra_gpu").main(["--tasks", "listops", "--methods", "skyformer",
                                        "kernelized"])
    assert "the ratios are to softmax: include softmax in --methods." in capsys.readouterr().err


def test_lra_gpu_records_its_settings_environment_and_command(monkeypatch, tmp_path):
    """The JSON says what the ratios were measured with: every setting, the threads and
    versions beside the GPU's name, and the command that reruns it."""
    module = load_benchmark("lra_gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stub")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(module, "measure", lambda *args: (0.5, 2.0**30))
    out = tmp_path / "lra.json"
    argv = ["--tasks", "listops", "--methods", "softmax", "--steps", "3", "--out", str(out)]
    assert module.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["config"] | {"out": None} == {"tasks": ["listops"], "methods": ["softmax"],
                                               "precision": "bf16", "steps": 3, "out": None}
    assert saved["environment"]["device_name"] == "stub"
    assert saved["environment"]["torch_threads"] == torch.get_num_threads()
    assert saved["command"] == "python benchmarks/lra_gpu.py " + " ".join(argv)
    assert saved["rows"][0]["time_ratio"] == 1.0


def test_a_tile_sweep_whose_candidates_all_differ_names_them_and_by_how_much():
    """Every candidate of a kernel off the default's results: a sentence naming each and
    its difference, before anything is timed (it was min()'s 'empty sequence')."""
    def call(kernel, tiles):
        return lambda: [torch.full((4,), float(tiles[0]))]

    with pytest.raises(ValueError, match=r"every launch option of the rows kernel differs .*"
                                         r": \(2,\) by 1\.00e\+00, \(3,\) by 2\.00e\+00\."):
        load_benchmark("tile_sweep").sweep(call, [torch.ones(4)], {"rows": [(2,), (3,)]},
                                  {"rows": (2,)}, str, shape="1,1,16,float32", n=8,
                                  device="cpu", repeats=1)


def test_a_tile_sweep_leaves_out_a_candidate_with_non_finite_results(capsys):
    """A launch option that leaves NaN in the output (an unwritten tile) is broken: its
    difference is NaN, which compared as no difference, so it was timed and could win."""
    def call(kernel, tiles):
        return lambda: [torch.ones(4) if tiles == (2,) else torch.full((4,), float("nan"))]

    rows, best = load_benchmark("tile_sweep").sweep(call, [torch.ones(4)], {"rows": [(2,), (3,)]},
                                           {"rows": (2,)}, str, shape="1,1,16,float32", n=8,
                                           device="cpu", repeats=1)
    assert [row["tiles"] for row in rows] == ["(2,)"] and best == {"rows": [2]}
    assert "(3,): differs from the default by nan" in capsys.readouterr().out


def test_the_lemma3_sweep_leaves_out_options_with_non_finite_results(monkeypatch):
    """An option whose inverse or gradient holds NaN differs by NaN, which compared as no
    difference: it was timed. With every option so, the sweep names them (it ended in
    min()'s 'empty sequence' at best)."""
    tiles = load_benchmark("lemma3_tiles")
    monkeypatch.setattr(tiles, "relative", lambda a, b: float("nan"))
    with pytest.raises(ValueError, match=r"every launch option of the forward kernel differs "
                                         r"from the default call's results at m=16 .*"
                                         r"rows 16 kc 16 warps 4 stages 1 by nan"):
        tiles.main(["--device", "cpu", "--options", "16,16,4,2"])
