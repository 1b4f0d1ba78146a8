"""The Lemma 3 kernels' launch options per GPU family (``triton_lemma3.FAMILY_KC``): the
choice, the same results under the interpreter, and no spill compiled for sm_80."""

from __future__ import annotations

import pytest
import torch

from skyformer.linalg import half_sq_norm, landmark_inverse, triton_kernels, triton_lemma3
from tests.compiled import compiled_rows, needs_compiler
from tests.devices import relative_error


def test_inner_chunks_of_16_where_the_family_spilled():
    """mma_sync (Ampere, Ada, consumer Blackwell): both kernels from m = 64; fma (before
    8.0): the backward from m = 128 (padded); sm_90 and sm_100 as before; never below
    m = 64 or for a CUDA graph."""
    options = triton_lemma3.launch_options
    for m in (64, 100, 128):
        for backward in (False, True):
            assert options(m, backward)["KC"] == 32
            assert options(m, backward, family="mma_sync")["KC"] == 16
            assert options(m, backward, family="fma")["KC"] == (
                16 if backward and m > 64 else 32)
            assert options(m, backward, family="mma_sync") == {
                **options(m, backward), "KC": 16}
            for family in ("mma_sync", "fma"):
                assert options(m, backward, graphed=True, family=family) == \
                    options(m, backward, graphed=True)
    for family in ("mma_sync", "fma"):
        assert options(32, True, family=family) == options(32, True)


@pytest.mark.parametrize("gradient", ["unrolled", "implicit"])
def test_an_sm80_gpus_options_give_the_same_inverse_and_gradient(monkeypatch,
                                                                 triton_interpreter,
                                                                 gradient):
    """Under the interpreter, with the options an sm_80 GPU takes (recorded from the
    launches), against the same call with sm_90's: W and the rows' gradient, float64."""
    gen = torch.Generator().manual_seed(3)
    x = 0.15 * torch.randn(1, 2, 37, 64, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, 2, 37, 37, generator=gen, dtype=torch.float64)

    def run():
        leaf = x.clone().requires_grad_(True)
        w = landmark_inverse(leaf, half_sq_norm(leaf), gamma=0.1, kernel="triton",
                             gradient=gradient)
        (grad,) = torch.autograd.grad((w * weights).sum(), leaf)
        return w, grad

    want = run()
    chunks = []
    original = triton_lemma3.launch

    def recording(program_kernel, pass_kernel, passes, bh, m, args, options):
        chunks.append(options["KC"])
        return original(program_kernel, pass_kernel, passes, bh, m, args, options)

    monkeypatch.setattr(triton_kernels, "device_capability", lambda device: (8, 0))
    monkeypatch.setattr(triton_lemma3, "launch", recording)
    monkeypatch.setattr("skyformer.linalg.triton_lemma3_backward.launch", recording)
    got = run()
    assert chunks == [16, 16]  # forward, backward
    for a, e in zip(got, want, strict=True):
        assert relative_error(a, e) < 1e-12


@pytest.mark.slow
@needs_compiler
def test_the_lemma3_kernels_compile_for_sm80_without_spills(tmp_path):
    """Compiled for sm_80 (Triton's ptxas, no GPU) at m = 64: the forward kernel spilled
    72 bytes a thread with sm_90's options; with the family's, neither kernel spills."""
    rows = compiled_rows(tmp_path / "sm80", "--arch", "80", "--configs", "64:bfloat16",
                         "--features", "64", "--only", "_forward_kernel", "_backward_kernel")
    assert sorted(row["kernel"].split(" ")[0] for row in rows) == ["_backward_kernel",
                                                                   "_forward_kernel"]
    for row in rows:
        assert (row["stack"], row["spill_stores"]) == (0, 0), row["kernel"]
