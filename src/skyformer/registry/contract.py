"""The contract a method keeps, checked on tiny inputs: ``check_method(name)`` and
``skyformer check METHOD``, for the author of a method of their own.

Each check runs the method through its registered binding, as every caller does, in
float64 on the CPU unless it checks a dtype, with a seeded generator; a capability the
method declares is checked for what it promises (``causal``: no output depends on a
later position; ``mask``: padding gives the truncated input's outputs and zero rows;
``independent_queries``: an output depends on its own query alone; ``weights``: the
output is one matrix applied to the values; ``half_precision``: bfloat16 and float16
in, the same out, close to float32's; ``cross_attention``: every key's value reaches the
output; ``attn_mask``: a key hidden from a query reaches none of its output), and one it
lacks is skipped. A random key (``skyformer.random_key``) is tried as the generator too,
and a method with a per-layer state (``register(state=...)``) is called with one, as a
layer calls it: in every check where its config names why its options need it (a property
``state_needed_because``, as Nystromformer's learned ``conv_kernel`` convolution does),
and a property ``not_cross_attention_because`` skips the cross-attention check. Other
config properties say what options change: ``draws_nothing_because`` (a randomized
method's options that draw nothing, BigBird's ``num_random_blocks=0``),
``ignored_inputs_because`` (``{"k": why}`` for Reformer's ``shared_qk``, whose gradient
check then leaves k out) and ``exact_query_rows`` (rows returned exact whatever is drawn,
added to the rows on which the draws must show). Options without a causal form skip the
causal check (where the method's defaults have one), with the sentence that binding them
with ``causal=True`` gives.
What the call guarantees for every method is not checked: a fully padded sequence gives zero
rows and zero gradients whatever the method computes (``guard.py`` replaces padded
inputs and outputs with ``torch.where``), and ``num_features`` below 1 is refused
(``methods._check_common_knob``). The library's own methods pass every check
(``tests/test_check_method.py``); ``tests/test_contract.py`` holds them to more, on
every device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import gradcheck

from ..logs import first_line
from ..ops.shared.causal_nystrom import CAUSAL_FORM_DEFAULTS
from ..sketch.rng import random_key
from .methods import get_method, with_note
from .variants import variant_name

# Tolerances of outputs that should be equal in float64 (other summation orders).
_CLOSE = {"rtol": 1e-7, "atol": 1e-9}


@dataclass(frozen=True)
class CheckResult:
    """One check: ``passed`` (None: skipped, the method lacks the capability it needs)
    and what was found, in words."""

    name: str
    passed: bool | None
    detail: str


def check_method(name: str, **options: Any) -> list[CheckResult]:
    """Run every check on method ``name`` (a variant's name too) with ``options``;
    methods with ``num_features`` get 8 unless it is given (fewer features than rows,
    where the approximation and its draws matter). Never raises for what the method does:
    a failure is a ``CheckResult``."""
    setting = _setting(name, options)
    spec, options, config, rows = setting.spec, setting.options, setting.config, setting.rows
    causal, causal_skipped, caps = setting.causal, setting.causal_skipped, spec.capabilities
    inexact = inexact_gradient_reason(config)
    # options of a randomized method that draw nothing (BigBird without random blocks)
    draws_nothing = getattr(config, "draws_nothing_because", None)
    randomized = caps.randomized and draws_nothing is None
    ignored = dict(getattr(config, "ignored_inputs_because", None) or {})
    # options whose calls need the layer's state (Nystromformer's learned convolution)
    # are checked as a layer calls them, with one; a bare call is refused in a sentence
    with_state = getattr(config, "state_needed_because", None) is not None

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, seed: int = 0,
            key: bool = False, attn_mask: Tensor | None = None, **more: Any) -> Tensor:
        """The method on ``q, k, v``; its generator seeded with ``seed``, or (``key``) a
        random key of it (``skyformer.random_key``, which layers pass)."""
        bound = spec.bind(q.shape[1], q.shape[-1], seq_len=256, **{**options, **more})
        generator = random_key(seed) if key else torch.Generator().manual_seed(seed)
        masks = {} if attn_mask is None else {"attn_mask": attn_mask}
        if with_state:
            masks["state"] = bound.new_state(seed=0).to(q.dtype)
        return bound(q, k, v, key_padding_mask=mask, generator=generator, **masks)

    def run_in_layer(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
                     ) -> tuple[Tensor, nn.Module]:
        """The method as a layer calls it: with a per-layer state (``new_state``) of
        its own, built afresh from one seed, and the state."""
        bound = spec.bind(q.shape[1], q.shape[-1], seq_len=256, **options)
        state = bound.new_state(seed=0).to(q.dtype)
        generator = torch.Generator().manual_seed(0)
        return bound(q, k, v, key_padding_mask=mask, generator=generator, state=state), state

    undeclared, square = "not declared", "not with causal=True (as many queries as keys)"
    cross = getattr(config, "not_cross_attention_because", None)
    cross = (None if caps.cross_attention else undeclared) if cross is None else cross
    # (check, why it is skipped or None, what it runs)
    checks: list[tuple[str, str | None, Callable[[], str]]] = [
        ("output shape, dtype and values", None, lambda: _output(run)),
        ("half precision: bfloat16 and float16 inputs give their dtype, close to float32's",
         None if caps.half_precision else undeclared, lambda: _half_precision(run)),
        ("large norms: outputs stay finite and bounded", None, lambda: _large_norms(run)),
        ("the same generator gives the same output", None,
         lambda: _deterministic(run, randomized, rows, draws_nothing)),
        ("a random key as generator (skyformer.random_key, which layers pass)", None,
         lambda: _keyed(run, randomized, rows)),
        ("batch elements are independent", None, lambda: _batch(run, caps.mask)),
        ("gradients reach q, k and v", None, lambda: _gradients(run, ignored)),
        ("the gradient is the derivative of the output (central differences)",
         None if inexact is None else f"declared inexact: {inexact}",
         lambda: _derivative(run, causal)),
        ("padding gives the truncated input's outputs", None if caps.mask else undeclared,
         lambda: _padding(run, caps.fixed_length)),
        ("what padded positions hold reaches no output", None if caps.mask else undeclared,
         lambda: _padded_keys(run)),
        ("attn_mask: a key hidden from a query reaches none of its output",
         None if caps.attn_mask else undeclared, lambda: _attn_mask(run)),
        ("causal: no output depends on a later position",
         causal_skipped, lambda: _causal(run)),
        ("cross-attention: other numbers of queries and keys",
         square if causal else cross, lambda: _cross(run)),
        ("independent queries: no output depends on another query",
         square if causal else (None if caps.independent_queries else undeclared),
         lambda: _independent(run, 30 if caps.cross_attention else 40)),
        ("weights: the output is one matrix applied to the values",
         None if caps.weights else undeclared, lambda: _weights(run, rows)),
        ("a per-layer state (new_state): batch elements independent, gradients reach it",
         None if spec.state is not None else "no per-layer state (register(state=...))",
         lambda: _layer_state(run_in_layer, caps.mask)),
    ]
    results = []
    for check, skipped, body in checks:
        if skipped is not None:
            results.append(CheckResult(check, None, skipped))
            continue
        try:
            results.append(CheckResult(check, True, body()))
        except _Broken as err:
            results.append(CheckResult(check, False, str(err)))
        except Exception as err:  # the method failed: that is what the check found
            results.append(CheckResult(check, False,
                                       f"raised {type(err).__name__}: {first_line(err)}"))
    return results


def checked_variant(name: str, **options: Any) -> str:
    """The variant ``check_method(name, **options)`` checks: ``name`` with ``options`` and
    those it adds, ``"bigbird[num_features=8]"`` for ``"bigbird"``; ``name`` where there
    are none. Raises, as ``check_method`` does, for a setting refused before any check."""
    return variant_name(name, _setting(name, options).options)


@dataclass(frozen=True)
class _Setting:
    """What the checks run: the method, its options (with those the checks add), its
    config, the rows on which its draws must show, and why the causal check is skipped."""

    spec: Any
    options: dict[str, Any]
    config: Any
    rows: int
    causal: bool
    causal_skipped: str | None


def _setting(name: str, options: dict[str, Any]) -> _Setting:
    """The ``_Setting`` of ``name`` with ``options``; a name, option or length the checks
    cannot run is refused here, before any check."""
    spec = get_method(name)
    options = _checked_options(spec, options)
    given = {**dict(spec.preset), **options}
    causal = given.get("causal") is True
    config = spec.bind(seq_len=256, **options).config
    # rows returned exact whatever is drawn (multipole's probes) do not show the draws
    rows = _rows_for_draws(given.get("num_features"), causal) + getattr(
        config, "exact_query_rows", 0)
    causal_skipped = _causal_skipped(spec, options, causal)
    _refuse_short_fixed_length(spec, config, max(
        rows, _LONGEST_OTHER_INPUT if causal_skipped else _CAUSAL_N))
    return _Setting(spec, options, config, rows, causal, causal_skipped)


def _checked_options(spec: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as the checks run them: ``num_features=8`` where none is given (fewer
    features than rows, where the draws matter), ``causal=True`` where options of the
    causal form alone need it; an unknown or bad option fails at once."""
    substituted = "num_features" in spec.option_names() and "num_features" not in {
        **dict(spec.preset), **options}
    if substituted:
        options = {"num_features": 8, **options}
    try:
        return _causal_where_needed(spec, options)
    except (TypeError, ValueError) as error:
        if not substituted or "num_features" not in str(error):
            raise
        raise with_note(error, f"the check runs num_features=8 where none is given: name a "
                               f"variant with one the method takes, "
                               f"'{spec.base_name}[num_features=...]'") from None


def _causal_skipped(spec: Any, options: dict[str, Any], causal: bool) -> str | None:
    """Why the causal check is skipped: the capability is not declared, or these options
    have no causal form (``skyformer[pinv=exact,gamma=0]``: its causal form needs gamma >
    0), which binding them with ``causal=True`` says in a sentence while the method's
    defaults bind with it; None: it runs (and fails where no causal form binds)."""
    if not spec.capabilities.causal:
        return "not declared"
    if not causal:
        try:
            spec.bind(seq_len=256, **{**options, "causal": True})
        except (TypeError, ValueError) as error:
            try:
                get_method(spec.base_name).bind(seq_len=256, causal=True)
            except (TypeError, ValueError):
                return None  # the declared causal form binds at no options: a finding
            return f"these options have no causal form ({first_line(error)})"
    return None


def _refuse_short_fixed_length(spec: Any, config: Any, longest: int) -> None:
    """Refuse, before any check, a ``fixed_length`` method whose ``max_seq_len`` is
    shorter than the checks' longest input (every check would fail on its length)."""
    limit = getattr(config, "max_seq_len", None)
    if spec.capabilities.fixed_length and isinstance(limit, int) and limit < longest:
        raise ValueError(f"{spec.name}: the checks run inputs of up to {longest} tokens, "
                         f"more than max_seq_len={limit}; check "
                         f"'{spec.base_name}[max_seq_len={longest}]' (what it promises "
                         f"does not depend on the length), or leave max_seq_len unset.")


def _causal_where_needed(spec: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked (an unknown or bad one fails at once), with ``causal=True``
    where they set options of the causal form alone (``skyformer[landmark_stride=2]``),
    which a call of the other form refuses."""
    given = {**dict(spec.preset), **options}
    config = spec.make_config(**spec.resolve_options(options, 256))
    causal_only = [name for name, default in CAUSAL_FORM_DEFAULTS.items()
                   if name in given and getattr(config, name, default) != default]
    if causal_only and "causal" in spec.option_names() and "causal" not in given:
        return {**options, "causal": True}
    return options


def _rows_for_draws(num_features: Any, causal: bool) -> int:
    """Rows enough that a method's draws matter: more than twice its features (with as
    many landmarks as rows a Nystrom method uses every row, and draws nothing), and past
    the first 64-token chunk of a causal form (exact inside it)."""
    rows = 30 if not isinstance(num_features, int) else min(512, max(30, 4 * num_features))
    return max(rows, 150) if causal else rows


class _Broken(Exception):
    """A check's finding that the method breaks its contract."""


def _qkv(b: int, n: int, *, nk: int | None = None, dv: int = 8, seed: int = 0,
         dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    return (torch.randn(b, 2, n, 8, generator=g, dtype=dtype),
            torch.randn(b, 2, nk, 8, generator=g, dtype=dtype),
            torch.randn(b, 2, nk, dv, generator=g, dtype=dtype))


def _largest(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item()


def _equal(got: Tensor, want: Tensor, what: str) -> None:
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        raise _Broken("gave non-finite values (NaN or inf) where this check compares two "
                      "outputs")
    if not torch.allclose(got, want, **_CLOSE):
        raise _Broken(f"{what} (largest difference {_largest(got, want):.3g})")


def _output(run: Callable[..., Tensor]) -> str:
    for dtype in (torch.float32, torch.float64):
        q, k, v = _qkv(2, 20, dv=5, dtype=dtype)
        out = run(q, k, v)
        if tuple(out.shape) != (2, 2, 20, 5) or out.dtype != dtype:
            raise _Broken(f"gave {out.dtype} {list(out.shape)} for {dtype} inputs; expected "
                          f"[B, H, Nq, Dv] = [2, 2, 20, 5] in the inputs' dtype")
        if not torch.isfinite(out).all():
            raise _Broken(f"gave non-finite values for {dtype} inputs")
    return "[B, H, Nq, Dv] in the inputs' dtype (float32, float64), finite"


def _half_precision(run: Callable[..., Tensor]) -> str:
    """Within 5 % of the largest float32 output on the same (half precision) inputs, for
    bfloat16 (8 mantissa bits) and float16 (11 bits, a largest value of 65504)."""
    errors = []
    # (dtype, what its rounding gives here): 8 mantissa bits, 11
    for dtype, rounding in ((torch.bfloat16, "0.01"), (torch.float16, "0.001")):
        name = str(dtype).removeprefix("torch.")
        q, k, v = (t.to(dtype) for t in _qkv(1, 32, dtype=torch.float32))
        out = run(q, k, v)
        if out.dtype != dtype:
            raise _Broken(f"gave {out.dtype} for {name} inputs; expected {name}")
        if not torch.isfinite(out.float()).all():
            raise _Broken(f"gave non-finite values for {name} inputs")
        want = run(*(t.float() for t in (q, k, v)))
        error = _largest(out.float(), want) / want.abs().max().clamp_min(1e-6).item()
        if error >= 0.05:
            raise _Broken(f"differs from the float32 output on the same {name} inputs by "
                          f"{error:.3g} of its largest value ({name} rounding gives about "
                          f"{rounding})")
        errors.append(f"{name} within {error:.2g}")
    return f"{', '.join(errors)} of the float32 output's largest value"


def _large_norms(run: Callable[..., Tensor]) -> str:
    """Queries and keys of norm 30 (logits up to 900, kernel distances up to 60): a
    method that exponentiates without taking out the largest exponent overflows."""
    q, k, v = _qkv(2, 40, dtype=torch.float32, seed=6)
    q, k = (t / t.norm(dim=-1, keepdim=True) * 30 for t in (q, k))
    out = run(q, k, v)
    if not torch.isfinite(out).all():
        raise _Broken("gave non-finite values for queries and keys of norm 30 (float32): "
                      "take the largest exponent out before exponentiating")
    if out.abs().max() >= 1e3 * v.abs().max():
        raise _Broken(f"gave outputs up to {out.abs().max().item():.3g} for values up to "
                      f"{v.abs().max().item():.3g} at queries and keys of norm 30")
    return "finite, within 1000 times the values' largest, for norms of 30 (float32)"


def _deterministic(run: Callable[..., Tensor], randomized: bool, rows: int,
                   draws_nothing: str | None = None) -> str:
    """One seed twice gives one output; two seeds give two where the method draws (and
    its options do: ``draws_nothing`` says why they draw nothing), else one."""
    q, k, v = _qkv(2, rows)
    first = run(q, k, v, seed=5)
    _equal(run(q, k, v, seed=5), first, "two calls with one seed differ: draw from the "
           "generator the call passes (resolve_key, the skyformer.sketch samplers), not "
           "from torch's global one")
    same = torch.allclose(first, run(q, k, v, seed=6))
    if randomized and same:
        raise _Broken("declares randomized, but two seeds gave the same output: it ignores "
                      "its generator (or draws nothing at these options)")
    if not randomized and not same:  # approx evaluates such a method once for all seeds
        if draws_nothing is not None:
            raise _Broken(f"two seeds gave different outputs, but its config says these "
                          f"options draw nothing ({draws_nothing})")
        raise _Broken("two seeds gave different outputs, but randomized is not declared: "
                      "declare Capabilities(randomized=True)")
    return "equal for one seed" + (", different for two" if randomized else
                                   ", the same for two") + (
        f" (these options draw nothing: {draws_nothing})" if draws_nothing else "")


def _keyed(run: Callable[..., Tensor], randomized: bool, rows: int) -> str:
    """A random key (an int64 tensor) in place of a ``torch.Generator``: layers, compiled
    code and Hugging Face's ``set_attention(seed=...)`` pass one."""
    q, k, v = _qkv(2, rows)
    try:
        first = run(q, k, v, seed=5, key=True)
    except Exception as err:
        try:  # a method that fails with a generator too: its error, not advice on keys
            run(q, k, v, seed=5)
        except Exception as plain:
            raise _Broken(f"raised {type(plain).__name__}: {first_line(plain)}") from None
        raise _Broken(f"raised {type(err).__name__} for a random key as generator "
                      f"({first_line(err)}); draw through "
                      f"skyformer.ops.shared.inputs.resolve_key(name, generator, q.device) "
                      f"and the skyformer.sketch samplers, which take a generator, a key "
                      f"or None") from None
    _equal(run(q, k, v, seed=5, key=True), first, "two calls with one random key differ")
    if randomized and torch.allclose(first, run(q, k, v, seed=6, key=True)):
        raise _Broken("two random keys gave the same output: it ignores a key as generator")
    return "equal for one key" + (", different for two" if randomized else "")


def _other_elements_redrawn(tensors: tuple[Tensor, ...], seed: int) -> list[Tensor]:
    """Copies of ``tensors`` whose batch elements after the first are drawn anew (three
    times the spread), element 0 kept."""
    copies = [t.clone() for t in tensors]
    for t in copies:
        t[1:] = torch.randn(t[1:].shape, generator=torch.Generator().manual_seed(seed),
                            dtype=t.dtype) * 3
    return copies


def _batch(run: Callable[..., Tensor], mask: bool) -> str:
    q, k, v = _qkv(3, 24, seed=3)
    padding = torch.ones(3, 24, dtype=torch.bool)
    padding[2, 20:] = False
    base = run(q, k, v, padding if mask else None)
    q2, k2, v2 = _other_elements_redrawn((q, k, v), seed=4)
    _equal(run(q2, k2, v2, padding if mask else None)[0], base[0],
           "element 0's output changed with element 1's inputs")
    return "element 0's output is unchanged by element 1's inputs"


def _layer_state(run_in_layer: Callable[..., tuple[Tensor, nn.Module]], mask: bool) -> str:
    """The calls every check above makes pass no state; a layer passes its own
    (``Method.bind(num_heads, head_dim).new_state()``): what the state hands the core
    must keep the batch elements apart, and its learned parameters must get gradients."""
    q, k, v = _qkv(2, 24, seed=7)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, 18:] = False
    out, state = run_in_layer(q, k, v, padding if mask else None)
    if tuple(out.shape) != tuple(v.shape) or not torch.isfinite(out).all():
        raise _Broken(f"gave {list(out.shape)}, finite: {bool(torch.isfinite(out).all())}, "
                      f"with its state; expected finite [B, H, Nq, Dv] = {list(v.shape)}")
    q2, k2, v2 = _other_elements_redrawn((q, k, v), seed=8)
    _equal(run_in_layer(q2, k2, v2, padding if mask else None)[0][0], out[0],
           "with its per-layer state, element 0's output changed with element 1's inputs: "
           "what the state hands the core mixes the batch elements")
    learned = [(name, p) for name, p in state.named_parameters() if p.requires_grad]
    if learned:
        if out.requires_grad:
            out.square().sum().backward()
        missing = [name for name, p in learned
                   if p.grad is None or not torch.isfinite(p.grad).all()
                   or p.grad.abs().sum() == 0]
        if missing:
            raise _Broken(f"no finite, non-zero gradient reaches the state's parameters "
                          f"{missing}: hand them to the core as tensors it computes with")
    reached = f", gradients reach its {len(learned)} parameters" if learned else ""
    return f"element 0's output is unchanged by element 1's inputs{reached}"


def _gradients(run: Callable[..., Tensor], ignored: dict[str, str]) -> str:
    """Finite, non-zero gradients for q, k and v, but for an input the options ignore
    (the config's ``ignored_inputs_because``: Reformer's ``shared_qk`` takes no keys)."""
    leaves = [t.requires_grad_(True) for t in _qkv(1, 16)]
    run(*leaves).square().sum().backward()
    for name, t in zip("qkv", leaves, strict=True):
        if name in ignored:
            continue
        if t.grad is None or not torch.isfinite(t.grad).all() or t.grad.abs().sum() == 0:
            raise _Broken(f"no finite, non-zero gradient reaches {name}")
    reached = [name for name in "qkv" if name not in ignored]
    said = " and ".join([", ".join(reached[:-1]), reached[-1]] if len(reached) > 1
                        else reached)
    return f"finite and non-zero for {said}" + "".join(
        f"; {name} is ignored: {why}" for name, why in ignored.items())


def inexact_gradient_reason(config: Any) -> str | None:
    """Why a method with ``config`` has, on purpose, a backward that is not the derivative
    of its output: the config's ``inexact_gradient_because`` (a property, as KDEformer's
    held-constant sampling probabilities or Performer's shifts with eps > 0 declare it),
    else None: the gradient is checked against central differences."""
    return getattr(config, "inexact_gradient_because", None)


def _derivative(run: Callable[..., Tensor], causal: bool) -> str:
    """``torch.autograd.gradcheck`` in float64, fast mode (along random directions): a
    term the output depends on but the backward leaves out (a detached shift that does
    not cancel, a selection held constant) fails here. Causal forms over 80 positions:
    the causal Nystrom forms are exact within their first 64-token chunk."""
    leaves = tuple(t.requires_grad_(True) for t in _qkv(1, 80 if causal else 12))
    if not gradcheck(run, leaves, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True,
                     raise_exception=False):
        raise _Broken("the backward differs from central differences of the output: it "
                      "leaves out a term the output depends on (a detached shift or "
                      "selection); if that is on purpose, say why in a property "
                      "inexact_gradient_because of the method's config")
    return "gradcheck passes for q, k and v (float64, fast mode)"


def _padding(run: Callable[..., Tensor], fixed_length: bool) -> str:
    """Right padding, then left padding with a hole: a method's windows, blocks and
    positions count the real tokens alone (``ops/shared/real_first.py``), so the real
    rows equal those of the real tokens packed together; a ``fixed_length`` method's
    parameters follow positions (Linformer's projections): right padding alone."""
    q, k, v = _qkv(1, 24, seed=1)
    cases = [(list(range(17)), "right padding")]
    if not fixed_length:
        cases.append(([i for i in range(3, 22) if i not in (9, 10, 11)],
                      "left padding and a hole"))
    for real, where in cases:
        mask = torch.zeros(1, 24, dtype=torch.bool)
        mask[:, real] = True
        padded = run(q, k, v, mask)
        truncated = run(q[:, :, real], k[:, :, real], v[:, :, real])
        _equal(padded[:, :, real], truncated,
               f"with {where}, the real rows differ from those of the real tokens alone "
               f"(windows, blocks, positions and draws must follow the real tokens, not the "
               f"padded length: ops/shared/real_first.py)")
        if not torch.all(padded[:, :, ~mask[0]] == 0):
            raise _Broken(f"with {where}, the rows of padded queries are not 0")
    return (f"real rows equal the truncated input's ({', '.join(w for _, w in cases)}), "
            f"padded rows are 0")


def _padded_keys(run: Callable[..., Tensor]) -> str:
    """Junk in the padded positions reaches no output. The registry's guard zeroes them
    before the core runs (``guard.zero_padding``), so this checks that path end to end;
    a core that weighs its padded keys anyway fails the padding check before it."""
    q, k, v = _qkv(2, 20, seed=2)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, 13:] = False
    base = run(q, k, v, mask)
    hidden = ~mask[:, None, :].expand(-1, 2, -1)
    junk = torch.randn(2, 2, 20, 8, generator=torch.Generator().manual_seed(9),
                       dtype=q.dtype) * 5
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[hidden] = junk[hidden]
    _equal(run(q2, k2, v2, mask), base, "what padded positions hold changed the output")
    return "junk in the padded q, k and v changes nothing (left and right padding)"


_CAUSAL_N = 150  # the causal check's length: past a 64-token chunk (causal forms run by chunks)
_LONGEST_OTHER_INPUT = 40  # the longest input of the other checks but the draws' rows


def _causal(run: Callable[..., Tensor]) -> str:
    n, cut = _CAUSAL_N, 70
    q, k, v = _qkv(1, n, seed=5)
    later = [t.clone() for t in (q, k, v)]
    for t in later:
        t[:, :, cut:] = torch.randn(t[:, :, cut:].shape, generator=torch.Generator()
                                    .manual_seed(6), dtype=t.dtype) * 3
    out, changed = run(q, k, v, causal=True), run(*later, causal=True)
    if not torch.equal(out[:, :, :cut], changed[:, :, :cut]):
        raise _Broken(f"outputs before position {cut} changed with the inputs after it "
                      f"(largest difference {_largest(out[:, :, :cut], changed[:, :, :cut]):.3g})")
    leaves = [t.requires_grad_(True) for t in _qkv(1, n, seed=7)]
    run(*leaves, causal=True)[:, :, :cut].sum().backward()
    for name, t in zip("qkv", leaves, strict=True):
        if t.grad is not None and t.grad[:, :, cut:].abs().max() != 0:
            raise _Broken(f"the outputs before position {cut} have a gradient with respect "
                          f"to {name} after it")
    return f"outputs and gradients before position {cut} of {n} ignore every later input"


def _attn_mask(run: Callable[..., Tensor]) -> str:
    """A bool ``attn_mask`` hiding keys 10 to 19 from queries 0 to 9: their outputs ignore
    those keys, the others' do not; the additive form (0 and -inf) gives the same."""
    q, k, v = _qkv(1, 20, seed=12)
    seen = torch.ones(20, 20, dtype=torch.bool)
    seen[:10, 10:] = False
    later = [t.clone() for t in (k, v)]
    for t in later:
        t[:, :, 10:] += 1.0
    out, moved = run(q, k, v, attn_mask=seen), run(q, *later, attn_mask=seen)
    _equal(moved[:, :, :10], out[:, :, :10], "the outputs of queries 0 to 9 changed with "
           "keys 10 to 19, which the attn_mask hides from them: it ignores attn_mask")
    if torch.allclose(out[:, :, 10:], moved[:, :, 10:], **_CLOSE):
        raise _Broken("the outputs of queries 10 to 19 ignore keys 10 to 19, which the "
                      "attn_mask lets them see")
    additive = torch.zeros(20, 20, dtype=q.dtype).masked_fill(~seen, float("-inf"))
    _equal(run(q, k, v, attn_mask=additive), out, "the additive attn_mask (0 and -inf) gives "
                                                  "other outputs than the bool one")
    return "keys hidden from a query change none of its outputs (bool and additive masks)"


def _cross(run: Callable[..., Tensor]) -> str:
    """Both shapes, finite; and with more keys than queries the keys past the queries'
    count reach the output (a method that kept the first Nq keys passed the shapes)."""
    for nq, nk in ((12, 20), (20, 12)):
        q, k, v = _qkv(1, nq, nk=nk, dv=5)
        out = run(q, k, v)
        if tuple(out.shape) != (1, 2, nq, 5) or not torch.isfinite(out).all():
            raise _Broken(f"gave {list(out.shape)}, finite: {bool(torch.isfinite(out).all())}, "
                          f"for {nq} queries and {nk} keys; expected [1, 2, {nq}, 5], finite")
    q, k, v = _qkv(1, 12, nk=20, dv=5)
    out = run(q, k, v)
    for first in range(0, 20, 5):  # a method keeping any 12 keys in a row misses a block
        moved = v.clone()
        moved[:, :, first:first + 5] += 1.0
        if torch.equal(run(q, k, moved), out):
            raise _Broken(f"with 12 queries over 20 keys, the values of keys {first} to "
                          f"{first + 4} change no output: it attends to some keys alone "
                          f"(as many as there are queries?)")
    return ("12 queries over 20 keys and 20 over 12: the right shape, finite, the values of "
            "each block of 5 keys reaching the output")


def _weights(run: Callable[..., Tensor], n: int) -> str:
    """The identity appended to the values (``skyformer.weights``) leaves the output
    and its draws as they were, and the columns it adds are a matrix that gives the
    output when applied to the values: with padding, ``n`` rows (enough for the draws)."""
    q, k, v = _qkv(2, n, dv=5, seed=11)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - n // 4:] = False
    out = run(q, k, v, mask)
    identity = torch.eye(n, dtype=v.dtype).expand(2, 2, n, n)
    both = run(q, k, torch.cat([v, identity], -1), mask)
    _equal(both[..., :5], out, "more value columns changed the output's first columns (the "
                               "draws or the result follow the values): leave weights "
                               "undeclared")
    _equal(both[..., 5:] @ v, out, "the columns of the appended identity, applied to the "
                                   "values, do not give the output (it is not linear in "
                                   "them): leave weights undeclared")
    return f"the output is the {n} x {n} weights applied to the values (with padding)"


def _independent(run: Callable[..., Tensor], nk: int) -> str:
    """``nk`` keys: 30, or the 40 of the queries for a method without cross-attention."""
    q, k, v = _qkv(2, 40, nk=nk, seed=8)
    later = q.clone()
    later[:, :, 20:] += torch.randn(2, 2, 20, 8, generator=torch.Generator().manual_seed(5),
                                    dtype=q.dtype)
    moved = _largest(run(later, k, v)[:, :, :20], run(q, k, v)[:, :, :20])
    if moved != 0:
        raise _Broken(f"the outputs of the first 20 queries changed with the other 20 "
                      f"(largest difference {moved:.3g}): it mixes the queries, so leave "
                      f"independent_queries undeclared")
    return f"the first 20 queries' outputs ignore the other 20 ({nk} keys)"
