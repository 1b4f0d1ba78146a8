"""Per-sequence random streams and length-independent Gaussian columns."""

from __future__ import annotations

import torch

from skyformer.sketch.streams import gaussian_columns, sequence_generators
from tests.conftest import gen

CPU = torch.device("cpu")


def test_sequence_draws_depend_only_on_the_caller_generator_and_index():
    a = [torch.rand(5, generator=g) for g in sequence_generators(3, gen(0), CPU)]
    b = [
        torch.rand(n, generator=g)
        for n, g in zip((9, 2, 5), sequence_generators(3, gen(0), CPU), strict=True)
    ]
    assert torch.equal(a[0], b[0][:5]) and torch.equal(a[2], b[2])
    c = [torch.rand(5, generator=g) for g in sequence_generators(3, gen(1), CPU)]
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])


def test_gaussian_columns_share_a_prefix_across_lengths():
    short = gaussian_columns((2, 3), 17, gen(0), CPU)
    long = gaussian_columns((2, 3), 600, gen(0), CPU)  # several chunks
    assert short.shape == (2, 3, 17) and long.shape == (2, 3, 600)
    assert torch.equal(long[..., :17], short)
    assert not torch.equal(gaussian_columns((2, 3), 17, gen(1), CPU), short)
