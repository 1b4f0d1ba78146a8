"""Every method's gradient is the derivative of the output it computes.

With the random draws fixed (one key for every call), each method is a function of q, k
and v; ``torch.autograd.gradcheck`` compares its backward with central differences in
float64 (fast mode: along random directions). A detached term that the output depends on
(a shift that does not cancel, a selection written as a constant) fails here, where a
comparison with a naive reference written the same way would pass. Plain, with key
padding (a short and a left-padded sequence) and, where the method can, causal over 80
positions (the causal Nystrom forms are exact within their first 64-token chunk). A
method whose config declares ``inexact_gradient_because`` must still fail it.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import skyformer
from skyformer.registry.contract import inexact_gradient_reason
from tests.conftest import lacks, make_qkv

METHODS = skyformer.list_methods()


def _padding(n: int) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, n - 3:] = False
    mask[1, :4] = False
    return mask


def _forms(name: str) -> list[str]:
    forms = ["plain", "key_padding"]
    if skyformer.get_method(name).capabilities.has("causal"):
        forms.append("causal")
    return forms


@pytest.mark.parametrize(("name", "form"),
                         [(name, form) for name in METHODS for form in _forms(name)])
def test_the_backward_is_the_derivative_of_the_output(name, form):
    n = 80 if form == "causal" else 12
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 1, n, 4, seed=5))
    options = {"generator": skyformer.random_key(3)}
    if name not in ("softmax", "kernelized"):
        options["num_features"] = 4
    if form != "plain":
        options["key_padding_mask"] = _padding(n)
        if lacks(name, "mask", lambda: skyformer.attention(q, k, v, name, **options)):
            return
    if form == "causal":
        options["causal"] = True

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return skyformer.attention(q, k, v, name, **options)

    checked = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-4, "fast_mode": True}
    spec = skyformer.get_method(name)
    declared = inexact_gradient_reason(spec.make_config(**{
        key: value for key, value in options.items() if key in spec.option_names()}))
    if declared is not None:  # finite, and still not exact (else the declaration is stale)
        grads = torch.autograd.grad(call(q, k, v).square().sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert not gradcheck(call, (q, k, v), raise_exception=False, **checked), \
            f"{name}'s gradient is exact now: drop its inexact_gradient_because ({declared})"
        return
    assert gradcheck(call, (q, k, v), **checked)
