"""Shared test helpers: random Q/K/V in the [B, H, N, D] layout; the ``matrix`` fixture,
with which a test names its cell (column, row) so that the counts per column are printed
after the run (passed / cells): the support matrices are read off CI's log."""

from __future__ import annotations

import os
import re
import warnings
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from tests.devices import CUDA_TESTS
from tests.interpreter_patching import patch_the_language_once_per_launch
from tests.interpreter_thread import run_interpreted_launches_in_a_worker_thread

# Without a GPU the Triton kernels run under Triton's interpreter (read when Triton is
# first imported, hence here, before any test imports it).
if not CUDA_TESTS:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    run_interpreted_launches_in_a_worker_thread()  # the same speed at any test depth
    patch_the_language_once_per_launch()  # not again at every helper's call

# One thread a process where pytest-xdist runs the tests in several (as the README's
# test command does: one a core); two otherwise.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER")
                      else max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _registry_as_found():
    """Each test leaves the method registry as it found it: a method a test registers for
    itself (one left behind after ``monkeypatch.setitem`` of a name it had just added,
    say) would otherwise reach the tests that a worker runs after it (``skyformer
    approx`` notes every registered method)."""
    from skyformer.registry import methods

    before = dict(methods._REGISTRY)
    yield
    if before != methods._REGISTRY:
        methods._REGISTRY.clear()
        methods._REGISTRY.update(before)


@pytest.fixture
def triton_interpreter():
    """Skips a test that runs Triton kernels on CPU tensors where the interpreter is off
    (``tests.devices.needs_interpreter``)."""
    from skyformer.linalg.kernel_backend import interpreter_on

    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernels run on CUDA")


def make_qkv(b=2, h=2, n=24, d=16, *, nk=None, dv=None, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    dv = d if dv is None else dv
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, nk, dv, generator=g, dtype=dtype)
    return q, k, v


def edge_padding(b: int, n: int, device="cpu") -> torch.Tensor:
    """``[b, n]`` bool: element 0's last quarter padded (its only key kept when n = 1),
    element 1's first fifth; the rest real."""
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, n - max(1, n // 4):] = n <= 1  # keep the only key of a one-key case
    if b > 1:
        mask[1, : n // 5] = False
    return mask.to(device)


def holes_mask(b: int, n: int) -> torch.Tensor:
    """Holes in the middle of element 0; left padding and a hole in element 1."""
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, [5, 6, 7, n - 6]] = False
    mask[1, :3] = False
    mask[1, 9] = False
    return mask


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grads_and_warnings(fn, inputs, before_backward=lambda: None, seed=5):
    """([fn's output, the gradients of its inputs for random weights drawn from
    ``seed``], the messages of the RuntimeWarnings raised); ``before_backward`` runs
    between the two passes (to break a kernel there, say)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*leaves)
        before_backward()
        weights = torch.randn(out.shape, generator=gen(seed), dtype=out.dtype)
        grads = torch.autograd.grad((out * weights).sum(), leaves)
    return [out, *grads], [str(w.message) for w in caught if w.category is RuntimeWarning]


# A method registered with Capabilities(mask=False) (or without another capability) is
# taken by the registry-wide tests as CONTRIBUTING.md promises: a test of what a mask
# does checks that the mask is refused with the capability's sentence (``lacks``), a
# test in which the padding is incidental runs the method unpadded (``mask_for``), a
# property drawn over padding patterns is skipped with the reason (``mask_params``).


def lacks(method: str, capability: str, call: Callable[[], object]) -> bool:
    """Whether ``method`` lacks ``capability`` (a key of ``CAPABILITY_TEXT``); when it
    does, ``call``, which asks for it, must be refused with the capability's sentence
    (``"<method> cannot <do it>..."``). A test of what the capability does returns when
    this is True."""
    from skyformer.registry import CapabilityError, get_method
    from skyformer.registry.capabilities import CAPABILITY_TEXT

    if get_method(method).capabilities.has(capability):
        return False
    sentence = f"{method} cannot {CAPABILITY_TEXT[capability]}"
    with pytest.raises(CapabilityError, match=f"^{re.escape(sentence)}"):
        call()
    return True


def mask_for(method: str, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The key padding mask ``[B, Nk]`` a test in which the padding is incidental passes
    ``method``: ``mask``, or None for a method registered with ``mask=False``."""
    from skyformer.registry import get_method

    return mask if get_method(method).capabilities.mask else None


def mask_params(methods: list[str]) -> list:
    """``methods`` as pytest parameters, those registered with ``mask=False`` skipped
    with the reason: for properties drawn over padding patterns (the refusal of a mask
    is checked once, by ``tests/test_contract.py``)."""
    from skyformer.registry import get_method

    return [pytest.param(m, marks=() if get_method(m).capabilities.mask else pytest.mark.skip(
        reason=f"{m} cannot honour a key_padding_mask (Capabilities(mask=False)): this "
               f"property is drawn over padding patterns")) for m in methods]


_CELLS: dict[str, dict[str, str]] = defaultdict(dict)


@pytest.fixture
def matrix(request):
    def record(column: str, row: str) -> None:
        request.node.matrix_cell = (column, row)

    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's cell goes with its reports (which pytest-xdist sends from the process
    that ran the test to the one that prints the summary)."""
    outcome = yield
    cell = getattr(item, "matrix_cell", None)
    if cell is not None:
        outcome.get_result().user_properties.append(("matrix_cell", tuple(cell)))


def pytest_runtest_logreport(report):
    cell = dict(report.user_properties).get("matrix_cell")
    if cell is None or report.when not in ("setup", "call"):
        return
    if report.when == "call" or not report.passed:
        _CELLS[cell[0]][cell[1]] = report.outcome


def pytest_terminal_summary(terminalreporter):
    if not _CELLS:
        return
    terminalreporter.section("support matrices (passed / cells)")
    for column, rows in _CELLS.items():
        passed = sum(outcome == "passed" for outcome in rows.values())
        failed = sorted(row for row, outcome in rows.items() if outcome != "passed")
        line = f"{column:22s} {passed:3d} / {len(rows)}"
        terminalreporter.write_line(line + (f"   not passing: {', '.join(failed)}" if failed
                                            else ""))
