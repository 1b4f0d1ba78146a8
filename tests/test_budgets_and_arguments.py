"""Budgets far above the sequence are capped by it (the same result as the cap) or
refused with a sentence; ``MultiHeadAttention`` names bad arguments."""

from __future__ import annotations

import pytest
import torch

from skyformer import MultiHeadAttention, get_method, list_methods, random_key
from skyformer.ops.shared.options import MAX_RANDOM_FEATURES

BUDGETED = [m for m in list_methods() if "num_features" in get_method(m).option_names()]
HUGE = 10**7


@pytest.mark.parametrize("method", BUDGETED)
def test_a_huge_budget_is_capped_or_refused(method):
    q, k, v = (torch.randn(1, 2, 37, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    spec = get_method(method)
    key = random_key(0)
    try:
        bound = spec.bind(seq_len=64, num_features=HUGE)
    except ValueError as err:
        assert f"num_features must be at most {MAX_RANDOM_FEATURES}" in str(err)
        return
    out = bound(q, k, v, generator=key)
    assert out.shape == (1, 2, 37, 8) and torch.isfinite(out).all()
    # the capped call is the call at the cap: the budget beyond the sequence is not used
    config = bound.config
    caps = config.budget_caps(37, 37) if hasattr(config, "budget_caps") else {}
    if caps:
        capped = spec.bind(seq_len=64, **{**bound.options(), **caps})
        torch.testing.assert_close(out, capped(q, k, v, generator=key))


@pytest.mark.parametrize(("method", "options"), [
    ("skyformer", {"causal": True, "num_features": HUGE}),
    ("nystrom_softmax", {"causal": True, "num_features": HUGE}),
    ("reformer", {"num_buckets": HUGE}),
    ("kdeformer", {"kde_rows": HUGE}),
    ("kdeformer", {"estimator": "uniform", "kde_samples": HUGE}),
], ids=["skyformer-causal", "nystrom_softmax-causal", "reformer", "kdeformer-rows",
        "kdeformer-samples"])
def test_a_budget_the_sequence_does_not_cap_is_refused(method, options):
    """Budgets that size draws whatever the sequence's length (the causal forms' landmark
    slots, Reformer's rotations, KDEformer's rows) asked torch for terabytes."""
    name = next(key for key in options if key != "causal" and key != "estimator")
    with pytest.raises(ValueError, match=rf"{method}: (with causal=True )?{name} must be "
                                         rf"at most {MAX_RANDOM_FEATURES}"):
        get_method(method).bind(**options)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, "1"])
def test_non_finite_scale_is_refused(value):
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        get_method("skyformer").bind(scale=value)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        get_method("skyformer").bind(gamma=float("inf"))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"num_heads": True}, "num_heads must be a positive integer"),
    ({"dim": 64.0}, "dim must be a positive integer"),
    ({"dropout": "0.1"}, "dropout must be a number in"),
    ({"dropout": 1.5}, "dropout must be a number in"),
    ({"bias": "yes"}, "bias must be True or False"),
])
def test_multihead_attention_constructor_names_bad_arguments(kwargs, words):
    arguments = {"dim": 64, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=words):
        MultiHeadAttention(arguments.pop("dim"), arguments.pop("num_heads"), "softmax",
                           **arguments)


def test_multihead_attention_forward_names_bad_inputs():
    layer = MultiHeadAttention(16, 2, method="softmax")
    with pytest.raises(TypeError, match="x must be a tensor"):
        layer([[0.0] * 16])
    with pytest.raises(TypeError, match=r"x is torch.float64 but the layer's weights are "
                                        r"torch.float32"):
        layer(torch.randn(1, 4, 16, dtype=torch.float64))
    # the conversion offered is of the tensor named, here the context, not x
    with pytest.raises(TypeError, match=r"context is torch.float64 .*\(context.to\("
                                        r"torch.float32\) or layer.to\(torch.float64\)\)"):
        layer(torch.randn(1, 4, 16), context=torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \[B, N, 16\]"):
        layer(torch.randn(1, 4, 8))
