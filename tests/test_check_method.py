"""``skyformer.registry.check_method`` / ``skyformer check``: every library method keeps
the contract it checks, and a method breaking it is named check by check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyformer import list_methods
from skyformer.cli import main
from skyformer.registry import Capabilities, register
from skyformer.registry import methods as registry_methods
from skyformer.registry.contract import check_method, checked_variant


@pytest.mark.parametrize("method", list_methods())
def test_every_library_method_keeps_the_contract(method):
    results = check_method(method)
    assert [r for r in results if r.passed is False] == []
    assert results[0].passed  # the output check always applies


@pytest.mark.parametrize("method", [
    "softmax[causal=True]", "linear[causal=True]", "skyformer[landmark_stride=2]",
    "skyformer[num_features=64]", "nystrom_softmax[num_features=64]",
    "skyformer[causal=True]", "performer[eps=1e-4]", "nystromformer[conv_kernel=3]",
    "reformer[shared_qk=true]", "reformer[num_buckets=1]", "bigbird[num_random_blocks=0]",
    "softmax_multipole[tolerance=0.1]", "skyformer[pinv=exact,gamma=0]"])
def test_library_methods_keep_it_under_options_of_their_own(method):
    """Options the checks once failed on: causal ones (no cross-attention then), options
    of the causal form alone (refused outside it), as many landmarks as the rows (no
    draw mattered, so 'it ignores its generator'), and a convolution whose learned
    weights the layer's state holds (a bare call is refused); keys shared_qk ignores (no
    gradient reaches k), options that draw nothing (one bucket, no random blocks), every
    row a probe of tolerance (returned exact), and gamma=0, which no causal form takes."""
    assert [r for r in check_method(method) if r.passed is False] == []


def test_what_options_change_is_said_where_a_check_adapts_to_it(monkeypatch):
    said = {r.name: r for r in check_method("skyformer[pinv=exact,gamma=0]")}
    causal = said["causal: no output depends on a later position"]
    assert causal.passed is None and causal.detail.startswith(
        "these options have no causal form (skyformer: causal=True needs gamma > 0")
    said = {r.name: r.detail for r in check_method("bigbird[num_random_blocks=0]")}
    assert said["the same generator gives the same output"].endswith(
        "the same for two (these options draw nothing: num_random_blocks=0 leaves the "
        "window and global blocks alone)")
    # options without a causal form skip the check; a method none of whose options has
    # one, though it declares it, fails it
    monkeypatch.delitem(registry_methods._REGISTRY, "never_causal", raising=False)

    @dataclasses.dataclass(frozen=True)
    class NeverCausal:
        causal: bool = False

        def __post_init__(self):
            if self.causal:
                raise ValueError("never_causal: causal=True is not implemented yet")

    register("never_causal", NeverCausal, Capabilities(target="softmax", causal=True))(
        lambda q, k, v, config, *, key_padding_mask=None, generator=None:
        _softmax_core(q * q.shape[-1] ** -0.5, k, v, key_padding_mask))
    said = {r.name: r for r in check_method("never_causal")}
    causal = said["causal: no output depends on a later position"]
    assert causal.passed is False and "causal=True is not implemented yet" in causal.detail
    with pytest.raises(ValueError, match=r"linformer\[max_seq_len=16\]: the checks run "
                                         r"inputs of up to 40 tokens, more than "
                                         r"max_seq_len=16; check "
                                         r"'linformer\[max_seq_len=40\]'"):
        check_method("linformer[max_seq_len=16]")


def test_options_needing_the_state_run_every_check_with_one_and_skip_cross_attention():
    results = {r.name: r for r in check_method("nystromformer[conv_kernel=3]")}
    cross = results["cross-attention: other numbers of queries and keys"]
    assert cross.passed is None and "conv_kernel=3 adds the convolved value" in cross.detail
    assert results["output shape, dtype and values"].passed
    assert results["the gradient is the derivative of the output (central differences)"].passed


@dataclasses.dataclass(frozen=True)
class _Leaky:
    causal: bool = False
    num_features: int = 8


@pytest.fixture
def leaky(monkeypatch):
    """A method declaring what it does not do: causal (it ignores the option), key
    padding (it ignores the mask), randomised (it draws nothing) and independent queries
    (it mixes them)."""
    monkeypatch.delitem(registry_methods._REGISTRY, "leaky_check", raising=False)

    @register("leaky_check", _Leaky, Capabilities(target="softmax", causal=True,
                                                  randomized=True, independent_queries=True))
    def leaky_check(q, k, v, config, *, key_padding_mask=None, generator=None):
        mixed = q + q.mean(2, keepdim=True)
        return torch.softmax(mixed @ k.transpose(-1, -2), -1) @ v

    monkeypatch.setitem(registry_methods._REGISTRY, "leaky_check",
                        registry_methods._REGISTRY["leaky_check"])
    return "leaky_check"


def test_each_broken_promise_is_its_own_failed_check(leaky):
    failed = {r.name: r.detail for r in check_method(leaky) if r.passed is False}
    assert set(failed) == {
        "the same generator gives the same output",
        "a random key as generator (skyformer.random_key, which layers pass)",
        "padding gives the truncated input's outputs",
        "causal: no output depends on a later position",
        "independent queries: no output depends on another query"}
    assert failed["causal: no output depends on a later position"].startswith(
        "outputs before position 70 changed with the inputs after it")
    assert "leave independent_queries undeclared" in \
        failed["independent queries: no output depends on another query"]


def test_a_method_that_draws_without_declaring_it_fails_one_check(monkeypatch):
    """approx evaluates a method that is not randomized once for all its seeds: one that
    draws from its generator must say so."""
    monkeypatch.delitem(registry_methods._REGISTRY, "undeclared_draws", raising=False)

    @register("undeclared_draws", _Leaky, Capabilities(target="softmax", mask=True))
    def undeclared_draws(q, k, v, config, *, key_padding_mask=None, generator=None):
        noise = torch.rand((), generator=generator, dtype=q.dtype) * 1e-3
        scores = (q @ k.transpose(-1, -2)) * (1 + noise)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -torch.inf)
        return torch.softmax(scores, -1) @ v

    monkeypatch.setitem(registry_methods._REGISTRY, "undeclared_draws",
                        registry_methods._REGISTRY["undeclared_draws"])
    failed = {r.name: r.detail for r in check_method("undeclared_draws") if r.passed is False}
    assert failed.pop("the same generator gives the same output") == (
        "two seeds gave different outputs, but randomized is not declared: declare "
        "Capabilities(randomized=True)")
    # torch.rand(generator=...) takes no random key, which layers pass
    (name, detail), = failed.items()
    assert name == "a random key as generator (skyformer.random_key, which layers pass)"
    assert detail.startswith("raised TypeError for a random key as generator")
    assert "resolve_key(name, generator, q.device)" in detail


@pytest.mark.parametrize(("kind", "sentence"), [
    ("draws_by_values", "more value columns changed the output's first columns"),
    ("not_linear", "the columns of the appended identity, applied to the values, do not "
                   "give the output")])
def test_weights_declared_by_a_method_not_linear_in_its_values_fail(monkeypatch, kind,
                                                                    sentence):
    """``weights`` promises the output is one matrix of the queries and keys applied to
    the values: a method whose scores follow the values' norms (as KDEformer's draws do),
    or whose output is not linear in them (tanh of the values), fails that check alone."""
    name = f"weights_{kind}"
    monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)

    @register(name, _Leaky, Capabilities(target="softmax", weights=True))
    def method(q, k, v, config, *, key_padding_mask=None, generator=None):
        scores = q @ k.transpose(-1, -2)
        if kind == "draws_by_values":  # the real keys' value norms
            norms = v.norm(dim=-1) * (1 if key_padding_mask is None
                                      else key_padding_mask[:, None, :])
            scores = scores * (1 + 0.01 * norms.sum(-1, keepdim=True)[..., None])
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -torch.inf)
        return torch.softmax(scores, -1) @ (v.tanh() if kind == "not_linear" else v)

    monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])
    failed = {r.name: r.detail for r in check_method(name) if r.passed is False}
    assert list(failed) == ["weights: the output is one matrix applied to the values"]
    detail = failed["weights: the output is one matrix applied to the values"]
    assert detail.startswith(sentence) and "leave weights undeclared" in detail


@pytest.mark.parametrize("declared", [False, True])
def test_a_backward_missing_a_term_fails_the_derivative_check(monkeypatch, declared):
    """A stabilising shift held constant where it does not cancel: the output depends on
    it, the backward does not (as Performer's features with eps > 0, or sampling
    probabilities held constant on purpose, which a method may declare)."""
    monkeypatch.delitem(registry_methods._REGISTRY, "detached_shift", raising=False)
    reason = "its shift is held constant"

    @dataclasses.dataclass(frozen=True)
    class Declaring(_Leaky):
        @property
        def inexact_gradient_because(self) -> str:
            return reason

    @register("detached_shift", Declaring if declared else _Leaky,
              Capabilities(target="softmax"))
    def detached_shift(q, k, v, config, *, key_padding_mask=None, generator=None):
        scores = q @ k.transpose(-1, -2)
        shift = scores.amax(-1, keepdim=True).detach()
        weights = (scores - shift).exp() + 0.1  # the 0.1 does not cancel the shift
        if key_padding_mask is not None:
            weights = weights * key_padding_mask[:, None, None, :]
        return (weights @ v) / weights.sum(-1, keepdim=True)

    monkeypatch.setitem(registry_methods._REGISTRY, "detached_shift",
                        registry_methods._REGISTRY["detached_shift"])
    results = {r.name: r for r in check_method("detached_shift")}
    derivative = results["the gradient is the derivative of the output (central differences)"]
    others = [r for r in results.values() if r is not derivative and r.passed is False]
    assert others == []
    if declared:
        assert derivative.passed is None and reason in derivative.detail
    else:
        assert derivative.passed is False
        assert "a property inexact_gradient_because of the method's config" in \
            derivative.detail


def test_independent_queries_without_cross_attention_is_checked_in_self_attention(
        monkeypatch):
    """The check ran 40 queries over 30 keys, so such a method was reported 'not
    declared' (and the contract test failed on the capability's refusal)."""
    monkeypatch.delitem(registry_methods._REGISTRY, "square_only", raising=False)

    @register("square_only", _Leaky, Capabilities(target="softmax", cross_attention=False,
                                                  independent_queries=True))
    def square_only(q, k, v, config, *, key_padding_mask=None, generator=None):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    monkeypatch.setitem(registry_methods._REGISTRY, "square_only",
                        registry_methods._REGISTRY["square_only"])
    results = {r.name: r for r in check_method("square_only")}
    independent = results["independent queries: no output depends on another query"]
    assert independent.passed is True and "(40 keys)" in independent.detail
    assert results["cross-attention: other numbers of queries and keys"].passed is None


def test_a_window_by_position_rather_than_among_real_tokens_fails_the_padding_check(
        monkeypatch):
    """Right padding alone was checked: a local window over positions (real tokens
    behind a hole then see fewer neighbours) passed, and broke padding == truncation
    for left-padded batches."""
    monkeypatch.delitem(registry_methods._REGISTRY, "window_by_position", raising=False)

    @register("window_by_position", _Leaky, Capabilities(target="softmax", cross_attention=False))
    def window_by_position(q, k, v, config, *, key_padding_mask=None, generator=None):
        i = torch.arange(q.shape[2])
        allowed = (i[:, None] - i[None, :]).abs() <= 2
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, -torch.inf)
        return torch.softmax(scores, -1).nan_to_num() @ v

    monkeypatch.setitem(registry_methods._REGISTRY, "window_by_position",
                        registry_methods._REGISTRY["window_by_position"])
    failed = {r.name: r.detail for r in check_method("window_by_position") if r.passed is False}
    assert list(failed) == ["padding gives the truncated input's outputs"]
    assert failed["padding gives the truncated input's outputs"].startswith(
        "with left padding and a hole, the real rows differ from those of the real tokens "
        "alone (windows, blocks, positions and draws must follow the real tokens, not the "
        "padded length: ops/shared/real_first.py)")


class _LeakyState(torch.nn.Module):
    """A per-layer state handing its core a scale of the scores: learned (detached for
    ``unused_parameter``) or, for ``mixes_batch``, grown by the mean key of the batch."""

    def __init__(self, config, num_heads, head_dim, *, kind):
        super().__init__()
        self.kind = kind
        self.scale = torch.nn.Parameter(torch.ones(num_heads, 1, 1))

    def forward(self, q, k):
        if self.kind == "mixes_batch":
            return {"scale": self.scale + k.mean(dim=(0, 2, 3))[:, None, None]}
        return {"scale": self.scale.detach()}  # unused_parameter: no gradient reaches it


@pytest.mark.parametrize(("kind", "sentence"), [
    ("mixes_batch", "with its per-layer state, element 0's output changed with element "
                    "1's inputs: what the state hands the core mixes the batch elements"),
    ("unused_parameter", "no finite, non-zero gradient reaches the state's parameters "
                         "['scale']")])
def test_a_per_layer_state_is_checked_as_a_layer_calls_it(monkeypatch, kind, sentence):
    """Every other check calls a method without its state (as a bare function call
    does): a state that mixes the batch, or whose learned parameters reach nothing,
    passed them all and broke the layers that hand it to the core."""
    name = f"state_{kind}"
    monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)

    def state(config, num_heads, head_dim):
        return _LeakyState(config, num_heads, head_dim, kind=kind)

    @register(name, _Leaky, Capabilities(target="softmax"), state=state)
    def method(q, k, v, config, *, key_padding_mask=None, generator=None, scale=1.0):
        scores = (q @ k.transpose(-1, -2)) * scale
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -torch.inf)
        return torch.softmax(scores, -1) @ v

    monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])
    failed = {r.name: r.detail for r in check_method(name) if r.passed is False}
    check = "a per-layer state (new_state): batch elements independent, gradients reach it"
    assert list(failed) == [check] and failed[check].startswith(sentence)


def test_a_method_that_raises_fails_the_checks_with_its_words(monkeypatch):
    monkeypatch.delitem(registry_methods._REGISTRY, "raising_check", raising=False)

    @register("raising_check", _Leaky, Capabilities(target="softmax"))
    def raising_check(q, k, v, config, *, key_padding_mask=None, generator=None):
        raise RuntimeError("not written yet")

    monkeypatch.setitem(registry_methods._REGISTRY, "raising_check",
                        registry_methods._REGISTRY["raising_check"])
    results = check_method("raising_check")
    assert results[0] == type(results[0])("output shape, dtype and values", False,
                                          "raised RuntimeError: not written yet")
    assert {r.passed for r in results} == {False, None}
    # with a generator too: its error, not advice on drawing through random keys
    keyed, = (r for r in results if r.name.startswith("a random key as generator"))
    assert (keyed.passed, keyed.detail) == (False, "raised RuntimeError: not written yet")


def test_the_command_prints_each_check_and_fails_where_one_fails(leaky, capsys):
    assert main(["check", "linear", "bigbird[num_features=16]"]) == 0
    out = capsys.readouterr().out
    assert "linear (checked as linear[num_features=8])\n  ok      output shape, dtype and " \
           "values" in out
    assert "  skipped cross-attention: other numbers of queries and keys: not declared" in out
    assert main(["check", leaky]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{leaky} (checked as {leaky}[num_features=8])\n")
    assert "  FAILED  causal: no output depends on a later position: outputs before" in out
    assert out.rstrip().endswith(f"5 check(s) failed: {leaky} (5)")
    assert main(["check", "linear[no_such_option=1]"]) == 2
    said = capsys.readouterr()
    assert "has no option 'no_such_option'" in said.err and said.out == ""
    # every name before any check: a typo after a good name ran that method's checks first
    assert main(["check", "linear", "skyfromer"]) == 2
    said = capsys.readouterr()
    assert "(did you mean 'skyformer'?)" in said.err and said.out == ""
    assert main(["check", "linear", "linear"]) == 2
    assert "METHOD lists linear more than once" in capsys.readouterr().err
    # a setting refused by the checks themselves: before any check, as a typo is
    assert main(["check", "linear", "linformer[max_seq_len=16]"]) == 2
    said = capsys.readouterr()
    assert "more than max_seq_len=16" in said.err and said.out == ""
    assert checked_variant("skyformer", landmark_stride=2) == \
        "skyformer[num_features=8,landmark_stride=2,causal=true]"


@dataclasses.dataclass(frozen=True)
class _Naive:
    num_features: int = 8


def test_softmax_written_naively_fails_the_dtype_and_the_large_norm_checks(monkeypatch):
    """Softmax attention as a first plugin often is: exp without taking out the largest
    logit (inf / inf at large norms), computed in float32 and never cast back (a float32
    output for bfloat16 inputs). Each is its own failed check, and nothing else fails."""
    monkeypatch.delitem(registry_methods._REGISTRY, "naive_exp", raising=False)

    @register("naive_exp", _Naive, Capabilities(target="softmax", independent_queries=True))
    def naive_exp(q, k, v, config, *, key_padding_mask=None, generator=None):
        work = torch.promote_types(q.dtype, torch.float32)
        weights = (q.to(work) @ k.to(work).transpose(-1, -2) * q.shape[-1] ** -0.5).exp()
        if key_padding_mask is not None:
            weights = weights * key_padding_mask[:, None, None, :]
        return weights / weights.sum(-1, keepdim=True) @ v.to(work)

    monkeypatch.setitem(registry_methods._REGISTRY, "naive_exp",
                        registry_methods._REGISTRY["naive_exp"])
    failed = {r.name: r.detail for r in check_method("naive_exp") if r.passed is False}
    half = "half precision: bfloat16 and float16 inputs give their dtype, close to float32's"
    assert list(failed) == [half, "large norms: outputs stay finite and bounded"]
    assert "returned a float32 tensor" in failed[half]
    assert "take the largest exponent out" in failed[
        "large norms: outputs stay finite and bounded"]
    with pytest.raises(ValueError, match="naive_exp: num_features must be a positive "
                                         "integer, got 0"):
        check_method("naive_exp", num_features=0)


def test_float16_overflow_fails_the_half_precision_check(monkeypatch):
    """Half precision was checked in bfloat16 alone, whose range is float32's: a method
    overflowing float16's 65504 passed the check that declares float16 inputs fine."""
    monkeypatch.delitem(registry_methods._REGISTRY, "scaled_up", raising=False)

    @register("scaled_up", _NoOptions, Capabilities(target="softmax", half_precision=True))
    def scaled_up(q, k, v, config, *, key_padding_mask=None, generator=None):
        return _softmax_core(q * q.shape[-1] ** -0.5, k, v * 1e5, key_padding_mask) / 1e5

    failed = {r.name: r.detail for r in check_method("scaled_up") if r.passed is False}
    assert failed == {"half precision: bfloat16 and float16 inputs give their dtype, close "
                      "to float32's": "gave non-finite values for float16 inputs"}


def test_a_non_finite_output_is_named_where_outputs_are_compared(monkeypatch):
    """Two NaN outputs differ under allclose: the determinism check blamed the global
    generator ("largest difference nan") for a method that draws nothing."""
    monkeypatch.delitem(registry_methods._REGISTRY, "nan_out", raising=False)

    @register("nan_out", _NoOptions, Capabilities(target="softmax"))
    def nan_out(q, k, v, config, *, key_padding_mask=None, generator=None):
        return _softmax_core(q, k, v, key_padding_mask) * float("nan")

    said = {r.name: r.detail for r in check_method("nan_out")}
    assert said["the same generator gives the same output"] == (
        "gave non-finite values (NaN or inf) where this check compares two outputs")


def _softmax_core(q, k, v, key_padding_mask=None, attn_mask=None):
    scores = q @ k.transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -torch.inf)
    return torch.softmax(scores, -1) @ v


@dataclasses.dataclass(frozen=True)
class _NoOptions:
    pass


def test_a_method_attending_to_as_many_keys_as_queries_fails_cross_attention(monkeypatch):
    """Keeping the first (or last) Nq keys passed the cross-attention check (shapes,
    finite): the values of every block of keys must reach the output."""
    monkeypatch.delitem(registry_methods._REGISTRY, "first_keys", raising=False)
    monkeypatch.delitem(registry_methods._REGISTRY, "last_keys", raising=False)

    @register("first_keys", _NoOptions, Capabilities(target="softmax"))
    def first_keys(q, k, v, config, *, key_padding_mask=None, generator=None):
        n = q.shape[2]
        return _softmax_core(q, k[:, :, :n], v[:, :, :n],
                             None if key_padding_mask is None else key_padding_mask[:, :n])

    failed = {r.name: r.detail for r in check_method("first_keys") if r.passed is False}
    assert failed == {"cross-attention: other numbers of queries and keys": (
        "with 12 queries over 20 keys, the values of keys 15 to 19 change no output: it "
        "attends to some keys alone (as many as there are queries?)")}

    @register("last_keys", _NoOptions, Capabilities(target="softmax"))
    def last_keys(q, k, v, config, *, key_padding_mask=None, generator=None):
        n = q.shape[2]
        return _softmax_core(q, k[:, :, -n:], v[:, :, -n:],
                             None if key_padding_mask is None else key_padding_mask[:, -n:])

    assert [r.detail for r in check_method("last_keys") if r.passed is False] == [
        "with 12 queries over 20 keys, the values of keys 0 to 4 change no output: it "
        "attends to some keys alone (as many as there are queries?)"]


def test_a_method_declaring_attn_mask_that_ignores_it_fails_its_check(monkeypatch):
    monkeypatch.delitem(registry_methods._REGISTRY, "mask_ignored", raising=False)

    @register("mask_ignored", _NoOptions, Capabilities(target="softmax", attn_mask=True))
    def mask_ignored(q, k, v, config, *, key_padding_mask=None, generator=None,
                     attn_mask=None):
        return _softmax_core(q, k, v, key_padding_mask)

    failed = {r.name: r.detail for r in check_method("mask_ignored") if r.passed is False}
    (name, detail), = failed.items()
    assert name == "attn_mask: a key hidden from a query reaches none of its output"
    assert detail.startswith("the outputs of queries 0 to 9 changed with keys 10 to 19, "
                             "which the attn_mask hides")


def test_an_option_the_check_put_in_and_the_method_refuses_says_how_to_give_one(monkeypatch):
    """check runs num_features=8 where none is given; a method taking multiples of 16
    failed with its own sentence about an 8 the user never gave."""
    @dataclasses.dataclass(frozen=True)
    class Blocks:
        num_features: int = 64

        def __post_init__(self):
            if self.num_features % 16:
                raise ValueError(f"blocks: num_features must be a multiple of 16, got "
                                 f"{self.num_features}")

    monkeypatch.delitem(registry_methods._REGISTRY, "blocks", raising=False)
    register("blocks", Blocks, Capabilities(target="softmax"))(
        lambda q, k, v, config, *, key_padding_mask=None, generator=None: v)
    with pytest.raises(ValueError, match=r"multiple of 16, got 8 \(the check runs "
                                         r"num_features=8 where none is given: name a variant "
                                         r"with one the method takes, "
                                         r"'blocks\[num_features=\.\.\.\]'\)"):
        check_method("blocks")
    assert check_method("blocks[num_features=16]")[0].passed
