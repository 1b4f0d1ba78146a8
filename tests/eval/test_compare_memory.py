"""The peak-memory job of ``skyformer compare`` runs for every registered method."""

from __future__ import annotations

import pytest
import torch

from skyformer.eval.compare.run import memory_job
from skyformer.eval.measure.memory import measure_in_this_process
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
