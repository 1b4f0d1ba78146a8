"""``KernelFallback``, the ``"auto"`` safety net of a Triton kernel family, by itself:
a failure is kept for the device and dtype of the tensor the kernel ran on, warned
about once for each, and attributed to the caller's line. The families' own tests
make their kernels fail (``test_product_fallback.py``, ``tests/pt2``)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from skyformer.linalg.kernel_backend import KernelFallback


def _broken():
    raise RuntimeError("no bfloat16 MMA")


def _auto(fallback, on, calls, fails):
    """``fallback.run`` under ``"auto"`` of a launch that appends to ``calls`` and
    fails where ``fails``: (its result, the messages of the warnings raised)."""
    def launch():
        calls.append(1)
        return _broken() if fails else "kernel"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fallback.run(True, launch, lambda: "pytorch", on=on)
    return out, [str(w.message) for w in caught]


def test_a_failure_is_kept_for_its_device_and_dtype_alone():
    fallback = KernelFallback("test kernel", "computing it otherwise")
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    calls = []
    out, warned = _auto(fallback, bf16, calls, fails=True)
    assert out == "pytorch" and len(warned) == 1 and "bfloat16 tensors on cpu" in warned[0]
    assert fallback.failures == {(torch.device("cpu"), torch.bfloat16)} and fallback.failed
    for other in (torch.empty(0), torch.empty(0, dtype=torch.bfloat16, device="meta")):
        assert not fallback.failed_on(other)
        assert _auto(fallback, other, calls, fails=False) == ("kernel", [])
    assert _auto(fallback, bf16, calls, fails=False) == ("pytorch", [])  # not tried again
    assert len(calls) == 3
    out, warned = _auto(fallback, torch.empty(0, device="meta"), calls, fails=True)
    assert out == "pytorch" and len(warned) == 1 and "float32 tensors on meta" in warned[0]
    float64 = torch.empty(0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="MMA"):  # "triton" insists, and keeps nothing
        fallback.run(False, _broken, lambda: "pytorch", on=float64)
    assert not fallback.failed_on(float64)


def test_the_warning_names_the_callers_line():
    fallback = KernelFallback("test kernel", "computing it otherwise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fallback.run(True, _broken, lambda: None, on=torch.empty(0))
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_a_failure_inside_a_cuda_graph_capture_propagates(monkeypatch):
    # a launch that fails because a capture is under way (a kernel first loaded there)
    # is the capture's failure: the fallback would run inside a broken capture
    from skyformer.linalg import kernel_backend

    fallback = KernelFallback("test kernel", "computing it otherwise")
    monkeypatch.setattr(kernel_backend, "_capturing", lambda on: True)
    with pytest.raises(RuntimeError, match="MMA"):
        fallback.run(True, _broken, lambda: "pytorch", on=torch.empty(0))
    assert not fallback.failed
    monkeypatch.setattr(kernel_backend, "_capturing", lambda on: False)
    assert _auto(fallback, torch.empty(0), [], fails=True)[0] == "pytorch"


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "y", "0", "", "off",
                                   "false", "no", "2", "t", " 1"])
def test_the_interpreter_switch_is_read_as_triton_reads_it(monkeypatch, value):
    """TRITON_INTERPRET=off (or false, 2) leaves Triton's interpreter off: the library
    took it for on, skipped its CPU sentence and its GPU guards."""
    knobs = pytest.importorskip("triton.knobs")
    from skyformer.linalg.kernel_backend import interpreter_on

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_on() == knobs.runtime.interpret


def test_kernels_launch_on_the_device_of_their_tensors(monkeypatch):
    """Triton launches on the current CUDA device: a kernel for tensors on another GPU of
    the process runs with that GPU made current (and the current one left alone
    otherwise); simulated here, where no GPU is."""
    import contextlib
    from types import SimpleNamespace

    current = {"device": 0}

    @contextlib.contextmanager
    def device(where):
        before, current["device"] = current["device"], torch.device(where).index
        try:
            yield
        finally:
            current["device"] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "device", device)
    fallback = KernelFallback("test kernel", "test")
    for index in (1, 0):
        tensor = SimpleNamespace(is_cuda=True, device=torch.device("cuda", index),
                                 dtype=torch.float32)
        for auto in (False, True):
            launched_on = fallback.run(auto, lambda: current["device"], lambda: None,
                                       on=tensor)
            assert launched_on == index and current["device"] == 0
