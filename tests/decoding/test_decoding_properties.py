"""Property: decoding in steps of any sizes, after a prompt of any length, with left
padding, holes or random padding and a beam reordering at any step, equals the full
causal forward with the same random key (float64), for every decoding state; and
whatever padded positions hold changes nothing."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyformer.decoding import new_decoding_state
from skyformer.ops.shared.causal_nystrom import landmark_stride
from skyformer.registry import get_method
from skyformer.sketch.rng import random_key

NYSTROM = ("skyformer", "nystrom_softmax")


@st.composite
def _cases(draw):
    method = draw(st.sampled_from(["linear", "performer", *NYSTROM, "softmax", "kernelized"]))
    options = {}
    if method != "linear" and method not in ("softmax", "kernelized"):
        options["num_features"] = draw(st.integers(1, 9))
    if method in NYSTROM:
        options["landmark_stride"] = draw(st.sampled_from([None, 1, 3, 7]))
        options["causal_local"] = draw(st.booleans())
    n = draw(st.integers(1, 140))
    prompt = draw(st.integers(1, n))
    steps, t = [], prompt
    while t < n:
        steps.append(draw(st.integers(1, min(70, n - t))))
        t += steps[-1]
    b = draw(st.integers(1, 3))
    return {"method": method, "options": options, "b": b, "n": n, "prompt": prompt,
            "steps": steps, "padding": draw(st.sampled_from(["none", "left", "random"])),
            "reorder_at": draw(st.integers(0, len(steps))),
            "index": draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=3)),
            "seed": draw(st.integers(0, 2**20))}


def _padding(kind: str, b: int, n: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "left":
        starts = torch.randint(0, n, (b, 1), generator=g)
        return torch.arange(n)[None] >= starts
    return torch.rand(b, n, generator=g) > 0.3


def _full(bound, q, k, v, valid, key, prompt):
    """The full causal forward; without a landmark_stride each element's prompt stride."""
    if bound.method.name not in NYSTROM or bound.config.landmark_stride is not None:
        return bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    m = bound.config.num_features
    stride = landmark_stride(None, prompt, m, None if valid is None else valid[:, :prompt])
    rows = []
    for i in range(q.shape[0]):
        r = stride if isinstance(stride, int) else int(stride[i])
        full = bound.replace(causal=True, landmark_stride=r)
        rows.append(full(q, k, v, key_padding_mask=valid, generator=key)[i])
    return torch.stack(rows)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_steps_of_any_sizes_equal_the_full_causal_forward(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, n = case["b"], case["n"]
    q, k = (torch.randn(b, 2, n, 3, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, 2, n, 2, generator=g, dtype=torch.float64)
    valid = _padding(case["padding"], b, n, g)
    bound = get_method(case["method"]).bind(**case["options"])
    key = random_key(case["seed"] % 1000)
    index = torch.tensor(case["index"])
    want = _full(bound, q, k, v, valid, key, case["prompt"])[index]
    if valid is not None:  # padding holds garbage: it must not matter
        q, k, v = (torch.where(~valid[:, None, :, None], math.nan, t) for t in (q, k, v))
    state = new_decoding_state(bound, generator=key)
    bounds = [0, case["prompt"]]
    for size in case["steps"]:
        bounds.append(bounds[-1] + size)
    outs = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if i == case["reorder_at"] + 1:
            state.reorder(index)
            q, k, v = q[index], k[index], v[index]
            valid = None if valid is None else valid[index]
        out = state.step(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                         None if valid is None else valid[:, start:end])
        outs.append(out if i > case["reorder_at"] else out[index])
    torch.testing.assert_close(torch.cat(outs, 2), want, rtol=1e-8, atol=1e-9)
