from __future__ import annotations

import json

from skyformer.eval.measure.memory import CallJob, MemoryJob, peak_memory_bytes


def test_subprocess_peak_memory_grows_with_materialised_size():
    """The naive softmax scores [N, N] dominate: 4x the entries, about 4x the peak."""
    small = peak_memory_bytes(MemoryJob("softmax", (1, 1, 512, 16), options={}))
    assert small >= 0
    job = MemoryJob("skyformer", (1, 2, 2048, 16), options={"num_features": 64}, backward=True)
    sky = peak_memory_bytes(job)
    # the [2, 2048, 64] float32 kernel blocks alone are 1 MiB each
    assert sky > 2**20


def test_peak_is_the_true_peak_whatever_the_allocator_kept():
    """glibc's adaptive mmap threshold serves blocks from a heap it keeps resident, so
    resident-size deltas depend on what earlier calls freed (this job read 50 MiB, and
    Performer at N=4096 3.9 or 18.9 MiB from run to run). The true peak here is 40 MiB."""
    job = MemoryJob("tests.eval.memory_helpers:free_one_then_hold_two", (1, 1, 8, 4))
    assert 38 * 2**20 <= peak_memory_bytes(job) <= 42 * 2**20


def test_repeated_measurements_agree():
    """Resident size must follow live tensors, not what the allocator kept from the
    warm-up (without a fixed mmap threshold this job measured 32 then 35 MiB, at N = 8192
    30 then 57 MiB)."""
    job = MemoryJob("informer", (1, 2, 4096, 32), backward=True)
    a, b = peak_memory_bytes(job), peak_memory_bytes(job)
    assert abs(a - b) <= 0.05 * max(a, b), (a, b)


TOY_MODULE = '''
import dataclasses

from skyformer.ops import softmax_attention
from skyformer.registry import Capabilities, register


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    scale: float | None = None


@register("toy_memory_method", ToyConfig, Capabilities(target="softmax"))
def toy(q, k, v, *, key_padding_mask=None, generator=None, scale=None):
    return softmax_attention(q, k, v, key_padding_mask=key_padding_mask, scale=scale)
'''


def test_a_method_registered_outside_the_library_is_measured(tmp_path, monkeypatch):
    """The fresh process that measures CPU memory imports the module that registered
    the method (also for a CallJob, which hf-eval's plugin rows lacked); a method
    registered in __main__ gets a sentence saying why it cannot."""
    import dataclasses
    import sys

    import pytest

    from skyformer.registry import _REGISTRY

    (tmp_path / "toy_memory_module.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    try:
        import toy_memory_module  # noqa: F401

        assert peak_memory_bytes(MemoryJob("toy_memory_method", (1, 2, 256, 16))) >= 0
        # a call of any kind (hf-eval's model forward) names the methods it runs
        call = CallJob("tests.eval.memory_helpers:method_call",
                       {"method": "toy_memory_method"}, methods=("toy_memory_method",))
        assert peak_memory_bytes(call) >= 0
        with pytest.raises(RuntimeError, match="unknown attention method"):
            peak_memory_bytes(dataclasses.replace(call, methods=()))
        _REGISTRY["toy_memory_method"].function.__module__ = "__main__"
        with pytest.raises(RuntimeError, match="registered in __main__"):
            peak_memory_bytes(MemoryJob("toy_memory_method", (1, 2, 256, 16)))
    finally:
        _REGISTRY.pop("toy_memory_method", None)
        sys.modules.pop("toy_memory_module", None)


def test_the_fresh_process_imports_only_what_registers_an_outside_method():
    """Which module the measuring process must import, for each form of a method name:
    none for the library's methods and for ``module:function`` (with or without a target),
    since resolving those imports them; a name that cannot be resolved fails here."""
    import pytest

    from skyformer.eval.measure.memory import _registering_module

    helper = "tests.eval.memory_helpers:free_one_then_hold_two"
    for spec in ("softmax", "skyformer", "linformer", helper, helper + "@softmax"):
        assert _registering_module(spec) == [], spec
    with pytest.raises(ValueError, match="unknown attention method 'not_a_method'"):
        _registering_module("not_a_method")


def test_a_measurement_out_of_time_is_a_sentence_and_reports_keep_their_rows(monkeypatch):
    """A memory subprocess past its timeout raised subprocess.TimeoutExpired, which no
    report caught: one slow call stopped the whole bench (compare, hf-eval too). It is a
    RuntimeError naming the method and the limit, and the rows keep their other numbers."""
    import functools

    import pytest

    import skyformer.eval.bench.run as bench_run
    import skyformer.eval.measure.memory as memory

    job = MemoryJob("softmax", (1, 1, 64, 8), options={})
    with pytest.raises(RuntimeError, match=r"memory measurement of softmax took more than "
                                           r"0.01 s and was stopped"):
        peak_memory_bytes(job, timeout=0.01)
    slow = functools.partial(memory.peak_memory_bytes, timeout=0.01)
    monkeypatch.setattr(memory, "peak_memory_bytes", slow)
    rows = bench_run.run_bench(bench_run.BenchConfig(
        methods=("softmax",), seq_lens=(64,), shapes=((1, 1, 8),), repeats=1, warmup=0,
        clock="cpu")).rows
    assert rows and all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 and r["peak_mib"] is None
                        and r["reason"].startswith("peak memory not measured: memory "
                                                   "measurement of softmax took more")
                        for r in rows)



def test_a_module_on_this_process_path_only_is_found_by_the_measuring_process(
        tmp_path, monkeypatch):
    """A notebook or a script that puts a folder on ``sys.path`` (not ``PYTHONPATH``)
    and names a function or registers a method from it: the fresh process that measures
    CPU memory could not import it, and the peak was reported missing. (The fresh
    process here only finds what the job names, to stay quick.)"""
    import subprocess
    import sys

    import skyformer.eval.measure.memory as memory
    from skyformer.registry import _REGISTRY

    package = tmp_path / "toy_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "registers.py").write_text(TOY_MODULE.replace("toy_memory_method",
                                                             "toy_path_method"))
    (tmp_path / "toy_function.py").write_text(
        "from skyformer.ops import softmax_attention as attention\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    imports, subprocess_run = [], subprocess.run

    def run(command, **kwargs):
        if "skyformer.eval.measure.memory" not in command:
            return subprocess_run(command, **kwargs)
        job = json.loads(command[-1])
        module = job["method"].partition(":")[0] if ":" in job["method"] else job["imports"][0]
        imports.append(module)
        check = (f"import importlib.util; assert importlib.util.find_spec({module!r}); "
                 f"print('{{\"peak_bytes\": 0}}')")
        return subprocess_run([sys.executable, "-c", check], **kwargs)

    monkeypatch.setattr(memory.subprocess, "run", run)
    try:
        import toy_pkg.registers  # noqa: F401

        for method in ("toy_function:attention@softmax", "toy_path_method"):
            assert memory.peak_memory_or_reason(MemoryJob(method, (1, 1, 16, 4))) == (0, None)
        assert imports == ["toy_function", "toy_pkg.registers"]
    finally:
        _REGISTRY.pop("toy_path_method", None)
        for name in ("toy_pkg", "toy_pkg.registers", "toy_function"):
            sys.modules.pop(name, None)


def test_a_setup_module_not_imported_yet_is_found_by_the_measuring_process(
        tmp_path, monkeypatch):
    """A script's ``CallJob`` naming a module beside it that the script has not imported
    (``sys.path`` has its folder): the fresh process got no folder for it, as the roots
    were read from ``sys.modules`` only, and failed with ModuleNotFoundError."""
    import sys

    (tmp_path / "toy_unimported_setup.py").write_text(
        "def make():\n    return lambda: None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert "toy_unimported_setup" not in sys.modules
    assert peak_memory_bytes(CallJob("toy_unimported_setup:make")) >= 0


def test_a_function_of_main_gets_the_sentence_a_method_registered_there_gets(monkeypatch):
    """``__main__:function`` (a notebook's or a script's function): the measuring process
    has a ``__main__`` of its own, so the function cannot be found there; this was said
    as "cannot load ... expected 'package.module:function'", after a process was started
    for nothing."""
    import sys

    import pytest

    import skyformer.eval.measure.memory as memory
    from skyformer.ops import softmax_attention

    monkeypatch.setattr(sys.modules["__main__"], "notebook_attention", softmax_attention,
                        raising=False)
    monkeypatch.setattr(memory.subprocess, "run", None)  # no process may be started
    with pytest.raises(RuntimeError, match=r"__main__:notebook_attention is defined in "
                                           r"__main__ \(a script or a notebook\).*importable"):
        memory.peak_memory_bytes(MemoryJob("__main__:notebook_attention@softmax", (1, 1, 8, 4)))


def test_a_backward_peak_is_above_the_inputs_and_the_output_gradient():
    """``2 v`` holds its output (8 MiB here) and v's gradient (8 MiB): 16 MiB above the
    inputs and the output gradient, which bench allocates before it times a call. The
    gradient was allocated inside the measured call, and the peak read 24 MiB."""
    job = MemoryJob("tests.eval.memory_helpers:scaled_values", (1, 1, 65536, 32),
                    backward=True)
    assert 15 * 2**20 <= peak_memory_bytes(job) <= 17.5 * 2**20
