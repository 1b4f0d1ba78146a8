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


def test_peak_counts_live_memory_not_heap_left_by_the_warm_up():
    """Naive softmax attention on [1, 4, 1024, 32] holds at most three [4, 1024, 1024]
    float32 matrices (16 MiB each) at once: logits, masked logits, probabilities. With
    glibc's dynamic mmap threshold the warm-up's frees left a fragmented heap and the
    measured call read 80 MiB; the fixed threshold makes the reading track live memory."""
    job = MemoryJob("skyformer.ops.softmax:reference_softmax_attention", (1, 4, 1024, 32))
    peak = peak_memory_bytes(job) / 2**20
    assert 32 <= peak <= 56, peak
