"""Launch options made for CUDA graphs, on request: ``cuda_graph_launches()``.

Replayed from a CUDA graph, a kernel launch costs the host nothing, so a chain of short
dependent steps runs faster as one launch per step with many programs each than as one
long program per matrix, the other way round from eager calls. The Lemma 3 core is such
a chain (about 25 passes forward, 28 backward): on an H100 (m = 128, B x H = 64,
``benchmarks/results/gpu_h100/lemma3_tiles_h100.txt``) a launch per pass with the step
products kept for the backward pass took 1.16 ms forward + backward in a CUDA graph
against 1.77 for the eager defaults, and 3.39 ms against 2.24 called eagerly.

The choice cannot follow the capture by itself: a kernel launched for the first time
while a graph is captured is compiled and loaded there, which CUDA refuses, so the
kernels a capture will launch must have run in its warm-up, eagerly, with the same
options. Only the caller knows that a capture follows. Inside ``cuda_graph_launches()``
every call launches what a graph should hold, the warm-up and the capture alike::

    with skyformer.cuda_graph_launches():
        graphed = torch.cuda.make_graphed_callables(model, (x,))
        # or the first calls of torch.compile(model, mode="reduce-overhead") with
        # kernel="triton" (compiled, "auto" takes the PyTorch core, fused by Inductor)

Outputs and gradients are those of the default launches (the same products, tiles in
another order: to rounding). The state is process-wide, not per thread, because
autograd runs a CUDA backward pass on a thread of its own. Without Triton or CUDA it
changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0  # open cuda_graph_launches() contexts; a plain int, which torch.compile guards on


@contextlib.contextmanager
def cuda_graph_launches() -> Iterator[None]:
    """Inside: the fused kernels take the launch options made for CUDA graphs (module
    docstring); may be nested."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def graph_launches_on() -> bool:
    """Whether a ``cuda_graph_launches()`` context is open."""
    return _depth > 0
