from __future__ import annotations

from skyformer.eval.memory import MemoryJob, peak_memory_bytes


def test_subprocess_peak_memory_grows_with_materialised_size():
    """The naive softmax scores [N, N] dominate: 4x the entries, about 4x the peak."""
    small = peak_memory_bytes(MemoryJob("softmax", (1, 1, 512, 16), options={}))
    assert small >= 0
    job = MemoryJob("skyformer", (1, 2, 2048, 16), options={"num_features": 64}, backward=True)
    sky = peak_memory_bytes(job)
    # the [2, 2048, 64] float32 kernel blocks alone are 1 MiB each
    assert sky > 2**20
