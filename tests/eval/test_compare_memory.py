"""The peak-memory job of ``skyformer compare`` runs for every registered method."""

from __future__ import annotations

import pytest
import torch

from skyformer.eval.compare.run import memory_job
from skyformer.eval.measure.memory import measure_in_this_process, peak_memory_bytes
from skyformer.eval.methods import resolve
from skyformer.registry import list_methods


@pytest.mark.parametrize("method", list_methods())
def test_memory_job_of_every_method_runs(tmp_path, method):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    inputs = tmp_path / "qkv.pt"
    torch.save({"q": q, "k": k, "v": v}, inputs)
    job = memory_job(method, tuple(q.shape), resolve(method).options(16), seed=0,
                     inputs=str(inputs))
    assert not job.as_layer  # the bare function call, as compare times it, not a layer call
    assert measure_in_this_process(job, "cpu") >= 0


def test_the_memory_job_of_a_masked_compare_measures_the_masked_call(tmp_path, monkeypatch):
    """``compare --qkv`` with a key padding mask timed and scored the masked call but
    measured the peak of one without the mask (the job's file held q, k, v only): the
    file carries the mask, and the measuring process passes it to the call."""
    import skyformer.eval.compare.run as compare_run
    from skyformer.eval.compare.run import CompareConfig, compare_on
    from skyformer.eval.measure.memory import MemoryJob

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g) for _ in range(3))
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[:, -5:] = False
    saved = []

    def measured(job, device):
        saved.append(torch.load(job.inputs, weights_only=True))
        return 0, None

    monkeypatch.setattr(compare_run, "peak_memory_or_reason", measured)
    compare_on((q, k, v), CompareConfig(methods=("softmax",), repeats=1, memory=True),
               key_padding_mask=mask)
    assert saved[0]["key_padding_mask"].equal(mask)

    spec = "tests.eval.memory_helpers:holds_twenty_mib_if_masked@softmax"
    peaks = []
    for extra in ({}, {"key_padding_mask": mask}):
        inputs = tmp_path / f"qkv{len(extra)}.pt"
        torch.save({"q": q, "k": k, "v": v, **extra}, inputs)
        peaks.append(peak_memory_bytes(MemoryJob(spec, tuple(q.shape), inputs=str(inputs))))
    assert peaks[0] < 10 * 2**20 <= 19 * 2**20 <= peaks[1]
