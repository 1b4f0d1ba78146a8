from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
import torch

import skyformer
from skyformer.registry import (
    Capabilities,
    CapabilityError,
    check_capabilities,
    get_method,
    register,
)
from skyformer.registry import methods as registry_methods
from tests.conftest import make_qkv
from tests.threads import GlobalDraws, draws_alone


def test_foundation_methods_are_registered_with_targets():
    names = skyformer.list_methods()
    assert names[:4] == ["softmax", "kernelized", "skyformer", "nystrom_softmax"]
    assert get_method("skyformer").capabilities.target == "gaussian"
    assert get_method("nystrom_softmax").capabilities.target == "softmax"
    assert get_method("softmax").capabilities.exact


def test_configs_are_frozen_dataclasses_with_paper_defaults():
    cfg = get_method("skyformer").make_config()
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_features = 3  # type: ignore[misc]
    assert (cfg.num_features, cfg.gamma, cfg.pinv_iterations, cfg.pinv) == (
        128,
        0.1,
        6,
        "iterative",
    )


def test_public_functions_are_the_registered_ones():
    assert get_method("skyformer").function is skyformer.skyformer_attention
    assert get_method("softmax").function is skyformer.softmax_attention
    q, k, v = make_qkv(1, 2, 10, 4)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.testing.assert_close(
        skyformer.attention(q, k, v, "skyformer", generator=g1, num_features=6),
        skyformer.skyformer_attention(q, k, v, generator=g2, num_features=6),
    )


def test_duplicate_names_are_rejected():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        pass

    with pytest.raises(ValueError, match="already registered"):
        register("skyformer", Cfg, Capabilities(target="softmax"))(lambda q, k, v, **kw: q)


def test_malformed_registrations_are_refused_before_they_reach_the_registry():
    """A registration the registry cannot use is refused when it is made, not later in
    another method's error sentence (a dict of capabilities broke every refusal)."""
    from skyformer.registry import _REGISTRY, list_methods

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        scale: float | None = None

    def fn(q, k, v, **kw):
        return q

    before = list_methods()
    cases = [
        (("x", Cfg, {"target": "softmax"}), "must be a skyformer.registry.Capabilities"),
        ((("x",), Cfg, Capabilities(target="softmax")), "non-empty string"),
        (("x", Cfg(), Capabilities(target="softmax")), r"decorated with @dataclasses.dataclass"
                                                        r"\(frozen=True\) .* not an instance"),
        (("x", dict, Capabilities(target="softmax")), r"got <class 'dict'>"),
        (("x", Cfg, Capabilities(target="cosine")), "one of softmax, gaussian"),
        (("x", Cfg, Capabilities(target="softmax", causal=True)), "option 'causal'"),
        (("x", Cfg, Capabilities(target="softmax", fixed_length=True)), "'max_seq_len'"),
    ]
    for args, sentence in cases:
        with pytest.raises((TypeError, ValueError), match=sentence):
            register(*args)(fn)
    assert list_methods() == before and "x" not in _REGISTRY


def test_capability_errors_are_sentences():
    q, k, v = make_qkv(1, 1, 6, 4)
    with pytest.raises(
        CapabilityError,
        match="nystromformer cannot do causal masking; methods that can: softmax, kernelized",
    ):
        skyformer.attention(q, k, v, "nystromformer", causal=True)
    with pytest.raises(CapabilityError, match="segment"):  # says why
        check_capabilities("nystromformer", causal=True)
    assert check_capabilities("softmax", causal=True, mask=True).name == "softmax"


VARIANT = "skyformer[pinv_gradient=implicit, num_features=16]"


def test_a_variant_is_the_method_with_options_set():
    method = get_method(VARIANT)
    assert method.name == VARIANT and method.base_name == "skyformer"
    assert method.preset == (("pinv_gradient", "implicit"), ("num_features", 16))
    assert method.defaults()["num_features"] == 16
    assert method.make_config().pinv_gradient == "implicit"
    assert method.make_config(num_features=8).num_features == 8  # the call overrides
    assert get_method("skyformer").preset == ()  # the registered method is untouched
    q, k, v = make_qkv(1, 2, 40, 8)
    key = skyformer.random_key(0)
    torch.testing.assert_close(
        skyformer.attention(q, k, v, VARIANT, generator=key),
        skyformer.attention(q, k, v, "skyformer", pinv_gradient="implicit", num_features=16,
                            generator=key), rtol=0, atol=0)
    layer = skyformer.MultiHeadAttention(16, 2, method=VARIANT)
    assert layer.bound.config.pinv_gradient == "implicit"


def test_a_variants_max_seq_len_wins_over_the_sequence_length_bound_for():
    """``linformer[max_seq_len=64]`` keeps its 64 columns where the layer is bound for
    longer sequences (a model's max_position_embeddings); an option given wins again."""
    method = get_method("linformer[max_seq_len=64,num_features=8]")
    assert method.bind(2, 8, seq_len=512).config.max_seq_len == 64
    assert method.bind(2, 8, seq_len=512, max_seq_len=32).config.max_seq_len == 32
    assert get_method("linformer").bind(2, 8, seq_len=512).config.max_seq_len == 512
    layer = skyformer.MultiHeadAttention(16, 2, method="linformer[max_seq_len=64]",
                                         seq_len=128)
    assert layer.method_state.proj_k.shape[-1] == 64


@pytest.mark.parametrize("name, problem", [
    ("skyformer[pinv_gradient]", "expected key=value items"),
    ("skyformer[]", "expected key=value items"),
    ("skyformer[num_features=8", "name\\[key=value,...\\]"),
    ("skyformer num_features=8]", "name\\[key=value,...\\]"),
    ("skyformer[gamma=1,gamma=2]", "set twice"),
    ("skyformer[colour=red]", "has no option 'colour'"),
    ("skyformer[num_features=0]", "num_features must be a positive integer"),
    ("skyformer[num_features=\u00b2]", "num_features must be a positive integer"),
    ("nothing[num_features=8]", "unknown attention method 'nothing'"),
])
def test_a_malformed_or_invalid_variant_fails_in_a_sentence(name, problem):
    with pytest.raises(ValueError, match=problem):
        get_method(name)


@pytest.mark.parametrize("given", [None, 3, 0.5, ["skyformer"]])
def test_a_method_that_is_no_name_is_a_type_error(given):
    """``skyformer.attention(q, k, v, None)`` raised ValueError("unknown attention method
    None"), where MultiHeadAttention(..., None) raised TypeError: the wrong type of
    argument is a TypeError everywhere, naming the type given."""
    import skyformer

    says = (rf"the attention method must be a method's name \(one of "
            rf"skyformer\.list_methods\(\)\), got {type(given).__name__} ")
    with pytest.raises(TypeError, match=says):
        get_method(given)
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(TypeError, match=says):
        skyformer.attention(q, q, q, given)


@pytest.mark.parametrize("given, close", [
    ("skyformr", "skyformer"), ("Performer", "performer"), (" linear", "linear"),
    ("kernalized", "kernelized"), ("nope", None),
])
def test_a_misspelt_method_name_gets_the_close_one(given, close):
    hint = "" if close is None else f" \\(did you mean '{close}'\\?\\)"
    with pytest.raises(ValueError, match=f"unknown attention method '{given}'{hint}; available"):
        get_method(given)
    if close is not None:
        get_method(close)  # the name suggested is one that works


def test_a_mask_where_the_method_goes_says_where_masks_go():
    """attention(q, k, v, mask), in torch SDPA's order, printed the whole mask as an
    unknown method's name."""
    from skyformer import attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"must be a method's name, got a tensor of shape "
                                        r"\(1, 4\): a mask goes by keyword, key_padding_mask="):
        attention(q, q, q, torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("options, said", [
    ({"num_featurs": 8}, "no option 'num_featurs' \\(did you mean 'num_features'\\?\\); its"),
    ({"features": 8}, "no option 'features' \\(did you mean 'num_features'\\?\\); its"),
    ({"colour": 1}, "no option 'colour'; its"),
])
def test_a_misspelt_option_gets_the_close_one(options, said):
    with pytest.raises(ValueError, match=said):
        get_method("skyformer").bind(**options)


@pytest.mark.parametrize("call, said", [
    (lambda q, m: skyformer.scaled_dot_product_attention(q, q, q, methd="skyformer"),
     r"scaled_dot_product_attention has no argument 'methd' \(did you mean 'method'\?\); "
     r"softmax's options are: scale, causal\."),
    (lambda q, m: skyformer.scaled_dot_product_attention(q, q, q, method="skyformer",
                                                         is_casual=True),
     r"has no argument 'is_casual' \(did you mean 'is_causal'\?\); skyformer's options"),
    (lambda q, m: skyformer.scaled_dot_product_attention(q, q, q, method="linear",
                                                         dropout=0.1),
     r"has no argument 'dropout' \(did you mean 'dropout_p'\?\)"),
    (lambda q, m: skyformer.scaled_dot_product_attention(q, q, q, method="linear", mask=m),
     r"scaled_dot_product_attention takes no argument 'mask': pass key_padding_mask "
     r"\(\[B, Nk\] bool, True = real token\) or attn_mask"),
    (lambda q, m: skyformer.attention(q, q, q, "skyformer", mask=m),
     r"skyformer\.attention takes no argument 'mask': pass key_padding_mask \(\[B, Nk\] "
     r"bool, True = real token\)\.$"),
    (lambda q, m: skyformer.attention(q, q, q, "skyformer", key_padding=m),
     r"attention has no argument 'key_padding' \(did you mean 'key_padding_mask'\?\)"),
    # a method's own function (skyformer.ops) says so too: it listed the options alone
    (lambda q, m: skyformer.ops.skyformer_attention(q, q, q, mask=m),
     r"skyformer_attention takes no argument 'mask': pass key_padding_mask"),
    (lambda q, m: skyformer.ops.performer_attention(q, q, q, generatr=None),
     r"performer_attention has no argument 'generatr' \(did you mean 'generator'\?\)"),
    # closer to one of the method's options: the method's own sentence
    (lambda q, m: skyformer.scaled_dot_product_attention(q, q, q, method="skyformer",
                                                         casual=True),
     r"skyformer has no option 'casual' \(did you mean 'causal'\?\)"),
])
def test_a_misspelt_argument_of_an_entry_point_gets_the_close_one(call, said):
    """The method's sentence blamed the default method ('softmax has no option
    'methd'') or listed options that were not the point."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=said):
        call(q, torch.ones(1, 8, dtype=torch.bool))


def test_a_bound_call_names_an_argument_it_does_not_take():
    """``bind()(q, k, v, dropout_p=0.1)`` got Python's "skyformer_attention() got an
    unexpected keyword argument", naming a function the user never called."""
    q = torch.randn(1, 2, 8, 4)
    bound = skyformer.get_method("skyformer").bind(num_features=4)
    with pytest.raises(TypeError, match=r"skyformer: the bound call takes no argument "
                                        r"'dropout_p'; it takes q, k, v and key_padding_mask, "
                                        r"query_padding_mask, generator, state \(options are "
                                        r"given to bind\(\)"):
        bound(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match=r"'generatr' \(did you mean 'generator'\?\)"):
        bound(q, q, q, generatr=None)
    exact = skyformer.get_method("softmax").bind()
    torch.testing.assert_close(exact(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool)),
                               exact(q, q, q))  # its own arguments still go through
    # one parenthesis for SDPA arguments given as options (two named attn_mask): SDPA's
    # entry, and the method's own call where it takes one, and each kind of name once
    with pytest.raises(ValueError, match=r"its options are: scale, causal \(attn_mask, "
                                         r"enable_gqa: skyformer\.scaled_dot_product_attention "
                                         r"takes torch's SDPA arguments; generator: an argument "
                                         r"of each call, not an option: .*; attn_mask: an "
                                         r"argument of the call, not an option: pass it to "
                                         r"skyformer\.ops\.softmax_attention\(q, k, v, "
                                         r"attn_mask=\.\.\.\) or to skyformer\.get_method"
                                         r"\('softmax'\)\.bind\(\)\(q, k, v, attn_mask="
                                         r"\.\.\.\)\)\.$"):
        skyformer.get_method("softmax").bind(attn_mask=None, enable_gqa=True, generator=None)
    with pytest.raises(ValueError, match=r"get_method\('performer'\)\.bind\(\)"):
        skyformer.get_method("performer[eps=0.0]").bind(projection=None)
    with pytest.raises(ValueError, match=r"; its options are: causal, .* \(attn_mask, "
                                         r"dropout_p: skyformer\.scaled_dot_product_attention "
                                         r"takes torch's SDPA arguments\)\.$"):
        skyformer.attention(q, q, q, "skyformer", attn_mask=None, dropout_p=0.1)


def test_an_argument_of_a_methods_call_given_as_an_option_says_where_it_goes():
    """``attention(..., "performer", projection=W)``: the README says Performer's
    features may be passed as ``projection``, and the refusal listed options only."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"\(projection: an argument of the call, not an "
                                         r"option: pass it to skyformer\.ops\."
                                         r"performer_attention\(q, k, v, projection=\.\.\.\) "
                                         r"or to skyformer\.get_method\('performer'\)\.bind"
                                         r"\(\)\(q, k, v, projection=\.\.\.\)\)\.$"):
        skyformer.attention(q, q, q, "performer", projection=torch.randn(128, 4))
    with pytest.raises(ValueError, match=r"\(proj_k, proj_v: arguments of the call, not "
                                         r"options: pass them to"):
        skyformer.attention(q, q, q, "linformer", proj_k=1, proj_v=2)
    projection = torch.randn(128, 4)
    torch.testing.assert_close(  # the way the sentence gives
        skyformer.get_method("performer").bind()(q, q, q, projection=projection),
        skyformer.ops.performer_attention(q, q, q, projection=projection))
    # an argument of every call given to a layer or to bind(): the sentence said only
    # that the method had no such option
    with pytest.raises(ValueError, match=r"has no option 'generator'; .*\(generator: an "
                                         r"argument of each call, not an option: pass it "
                                         r"when calling, layer\(x, generator=\.\.\.\)"):
        skyformer.MultiHeadAttention(8, 2, "skyformer", generator=torch.Generator())
    with pytest.raises(ValueError, match=r"\(generator, key_padding_mask: arguments of each "
                                         r"call, not options: pass them when calling"):
        skyformer.get_method("skyformer").bind(key_padding_mask=None, generator=None)


@pytest.mark.parametrize("text, value", [
    ("64", 64), ("-2", -2), ("0.5", 0.5), (".5", 0.5), ("1.", 1.0), ("1e-3", 1e-3),
    ("2.5E4", 2.5e4), ("true", True), ("True", True), ("false", False), ("False", False),
    ("null", None), ("None", None), ("'64'", "64"), ('"x"', "x"), ("implicit", "implicit"),
    ("1e", "1e"), ("1.2.3", "1.2.3"), ("\u0663", "\u0663"), ("1.\u0665", "1.\u0665"),
])
def test_values_are_numbers_words_or_strings(text, value):
    from skyformer.registry.variants import parse_variant

    assert parse_variant(f" m[a={text}] ") == ("m", (("a", value),))


@pytest.mark.parametrize("value", [64, -2, 0.5, 1e-3, True, False, None, "implicit", "64",
                                   "true", "1e-3", "a b", " spaced", "trailing ",
                                   float("inf"), float("-inf"), "inf", "-inf", "nan"])
def test_a_variant_name_reads_back_the_options_it_was_given(value):
    from skyformer.registry.variants import parse_variant, variant_name

    name = variant_name("m[x=1]", {"a": value})
    assert parse_variant(name) == ("m", (("x", 1), ("a", value)))
    assert variant_name(" m ", {}) == "m"


def test_a_variant_name_reads_back_nan_as_a_float():
    """``str(float("nan"))`` is ``nan``, which read back as the string 'nan'."""
    import math

    from skyformer.registry.variants import parse_variant, variant_name

    (_, value), = parse_variant(variant_name("m", {"a": float("nan")}))[1]
    assert isinstance(value, float) and math.isnan(value)


def test_a_variants_values_reach_its_config():
    method = get_method("performer[num_features=32,orthogonal=False,scale=.5]")
    config = method.make_config()
    assert (config.num_features, config.orthogonal, config.scale) == (32, False, 0.5)
    assert get_method("skyformer[landmark_stride=None]").make_config().landmark_stride is None


def test_a_variant_named_inside_a_compiled_function_is_traced():
    """Parsed with string methods alone, and the Method made without
    ``dataclasses.fields``: ``torch.compile(fullgraph=True)`` traces a call that names a
    variant for the first time."""
    from skyformer.registry import methods

    name = "skyformer[pinv_gradient=implicit,num_features=7]"
    methods._VARIANTS.pop(name, None)
    q = make_qkv(1, 2, 40, 8)[0]
    key = skyformer.random_key(0)

    def f(q):
        return skyformer.attention(q, q, q, name, generator=key)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(q)
    torch.testing.assert_close(out, f(q))


def test_a_compiled_call_with_options_traces_no_cached_function(recwarn):
    """The misspelt-argument hint's cached names were read on every call with options:
    Dynamo then traced a functools cache and warned on each fresh compile. They are
    read only for an option the method lacks."""
    import warnings

    q = make_qkv(1, 2, 40, 8)[0]
    key = skyformer.random_key(0)

    def f(q):
        return skyformer.attention(q, q, q, "skyformer", generator=key, num_features=7)

    torch._dynamo.reset()
    warnings.simplefilter("always")
    torch.compile(f, fullgraph=True, backend="eager")(q)
    assert not [w for w in recwarn if "functools" in str(w.message)]


def test_a_name_with_brackets_cannot_be_registered():
    @dataclasses.dataclass(frozen=True)
    class Config:
        num_features: int = 1

    for name in ("mine[x=1]", "softmax ", "my method", "pkg:fn", "fn@softmax", ""):
        with pytest.raises(TypeError, match="letters, digits"):
            register(name, Config, Capabilities(target="softmax"))


@pytest.mark.parametrize("method", ["performer", "linformer"])
def test_a_seeded_state_leaves_every_generator_as_it_was(method, monkeypatch):
    """``new_state(seed)`` draws under the seed on the CPU and restores its generator; it
    must not seed the GPUs' generators either (``torch.manual_seed`` would: two runs with
    different seeds would then share their CUDA dropout masks after set_attention)."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    bound = get_method(method).bind(2, 8, **({"max_seq_len": 16} if method == "linformer"
                                            else {}))
    before = torch.get_rng_state()
    first, again = bound.new_state(seed=3), bound.new_state(seed=3)
    assert seeded == []
    assert torch.equal(torch.get_rng_state(), before)
    for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_registration_refuses_what_no_call_could_reach(monkeypatch):
    """Refused when registered, with a sentence: a core whose config parameter has
    another name (it would be called with the options as keywords, a TypeError at every
    call), an option named like a call argument, the names skyformer.hf gives the
    model's own attention, and an option without a default (skyformer list and approx
    bind without options). A public form taking every option registers."""
    from skyformer.registry import _REGISTRY

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        num_features: int | None = None

    def cfg_named_otherwise(q, k, v, cfg, *, key_padding_mask=None, generator=None):
        return q

    with pytest.raises(TypeError, match=r"'x' takes neither a config .* nor the options "
                                        r"num_features as keyword arguments .* name its "
                                        r"fourth parameter config\."):
        register("x", Cfg, Capabilities(target="softmax"))(cfg_named_otherwise)

    @dataclasses.dataclass(frozen=True)
    class Clashing:
        generator: int = 1

    with pytest.raises(TypeError, match=r"option names \['generator'\] are arguments of "
                                        r"every call .* rename the option in Clashing\."):
        register("x", Clashing, Capabilities(target="softmax"))
    for reserved in ("exact", "sdpa"):
        with pytest.raises(ValueError, match=rf"{reserved!r} names the model's own attention"):
            register(reserved, Cfg, Capabilities(target="softmax"))

    @dataclasses.dataclass(frozen=True)
    class Required:  # calls that pass it worked; skyformer list and approx failed
        num_features: int
        gamma: float = 0.1

    with pytest.raises(TypeError, match=r"'x': every option needs a default .* Required has "
                                        r"none for num_features; give it one"):
        register("x", Required, Capabilities(target="softmax"))

    @dataclasses.dataclass(frozen=True)
    class WithInitVar:  # the constructor's arguments count, not the fields
        hint: dataclasses.InitVar[int]
        num_features: int = 8

    with pytest.raises(TypeError, match=r"WithInitVar has none for hint"):
        register("x", WithInitVar, Capabilities(target="softmax"))
    assert not {"x", "exact", "sdpa"} & set(_REGISTRY)

    def public(q, k, v, *, key_padding_mask=None, generator=None, num_features=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.delitem(registry_methods._REGISTRY, "public_form", raising=False)
    register("public_form", Cfg, Capabilities(target="softmax"))(public)
    monkeypatch.setitem(registry_methods._REGISTRY, "public_form",
                        registry_methods._REGISTRY["public_form"])
    q = torch.randn(1, 2, 8, 4)
    torch.testing.assert_close(skyformer.attention(q, q, q, "public_form", num_features=4),
                               torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_a_core_without_the_call_arguments_is_refused_at_registration(monkeypatch):
    """Every call passes key_padding_mask and generator: a function without them is
    refused when registered. One without query_padding_mask registers (it serves the
    calls whose queries share the keys' padding) and a call with a query mask gets a
    sentence, not a TypeError from inside the registry."""
    from skyformer.registry import _REGISTRY

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        num_features: int | None = None

    def no_generator(q, k, v, config, *, key_padding_mask=None, query_padding_mask="auto"):
        return q

    with pytest.raises(TypeError, match=r"registered as 'x' must take the keyword arguments "
                       r"key_padding_mask, generator .* it lacks generator\."):
        register("x", Cfg, Capabilities(target="softmax"))(no_generator)
    assert "x" not in _REGISTRY

    monkeypatch.delitem(registry_methods._REGISTRY, "no_query_mask", raising=False)

    @register("no_query_mask", Cfg, Capabilities(target="softmax"))
    def no_query_mask(q, k, v, config, *, key_padding_mask=None, generator=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setitem(registry_methods._REGISTRY, "no_query_mask",
                        registry_methods._REGISTRY["no_query_mask"])
    q, k, v = make_qkv(1, 2, 8, 4, nk=5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # every query real, as library callers say for cross-attention: the same as "auto"
    for call in (lambda: no_query_mask(q, k, v),
                 lambda: skyformer.attention(q, k, v, "no_query_mask"),
                 lambda: skyformer.attention(q, k, v, "no_query_mask", query_padding_mask=None)):
        torch.testing.assert_close(call(), want)
    layer = skyformer.MultiHeadAttention(8, 2, "no_query_mask").double()
    layer(torch.randn(1, 6, 8, dtype=torch.float64),
          context=torch.randn(1, 4, 8, dtype=torch.float64))
    # a padding attn_mask of real keys reaches such a core as no mask (read to say so),
    # where it would refuse a key mask with every query called real
    all_real = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    torch.testing.assert_close(skyformer.scaled_dot_product_attention(
        q, q, q, attn_mask=all_real, method="no_query_mask", query_padding_mask=None),
        torch.nn.functional.scaled_dot_product_attention(q, q, q))
    padded = torch.ones(1, 8, dtype=torch.bool)
    padded[0, 6:] = False  # a key mask, and queries called real: the core cannot say so
    monkeypatch.delitem(registry_methods._REGISTRY, "no_query_mask_public", raising=False)

    @register("no_query_mask_public", Cfg, Capabilities(target="softmax"))
    def public_form(q, k, v, *, key_padding_mask=None, generator=None, num_features=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setitem(registry_methods._REGISTRY, "no_query_mask_public",
                        registry_methods._REGISTRY["no_query_mask_public"])
    for name in ("no_query_mask", "no_query_mask[num_features=3]", "no_query_mask_public"):
        with pytest.raises(TypeError, match=rf"{re.escape(name)} takes no query_padding_mask "
                           r".* add query_padding_mask='auto' to the function"):
            skyformer.attention(q, q, q, name, key_padding_mask=padded, query_padding_mask=None)


def test_the_contributing_template_registers_and_runs(monkeypatch):
    """The core of CONTRIBUTING.md's step 1, filled in, is a method every entry point
    runs (it lacked query_padding_mask, which every call passes)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "CONTRIBUTING.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "@register" in b)
    source = textwrap.dedent(block).replace("<name>", "contributed").replace(
        "    ...\n", "    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)\n")
    monkeypatch.delitem(registry_methods._REGISTRY, "contributed", raising=False)

    @dataclasses.dataclass(frozen=True)
    class NameConfig:
        num_features: int | None = None

    from skyformer.ops.shared.inputs import (
        check_attention_inputs,
        check_generator,
        zero_padded_queries,
    )
    namespace = {"__name__": "contributing", "register": register,
                 "Capabilities": Capabilities, "Tensor": torch.Tensor,
                 "torch": torch, "NameConfig": NameConfig,
                 "check_attention_inputs": check_attention_inputs,
                 "check_generator": check_generator, "zero_padded_queries": zero_padded_queries}
    exec(compile("from __future__ import annotations\n" + source, "CONTRIBUTING.md", "exec"),
         namespace)
    try:
        q = torch.randn(1, 2, 8, 4)
        torch.testing.assert_close(skyformer.attention(q, q, q, "contributed"),
                                   torch.nn.functional.scaled_dot_product_attention(q, q, q))
    finally:
        registry_methods._REGISTRY.pop("contributed", None)


@dataclasses.dataclass(frozen=True)
class _Scaled:
    factor: float = 1.0
    causal: bool = False


def _register_scaled(monkeypatch, name, capabilities, offset=0.0):
    """A method of this test's own: factor x mean(V) + offset, registered for the test."""
    monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)

    @register(name, _Scaled, capabilities)
    def scaled(q, k, v, config, *, key_padding_mask=None, query_padding_mask="auto",
               generator=None):
        return (config.factor * v.mean(2, keepdim=True) + offset).expand(*q.shape[:3],
                                                                          v.shape[-1])

    monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])
    return scaled


def test_declared_incapabilities_are_enforced_on_every_route(monkeypatch):
    """half_precision=False under autocast (the core got bfloat16), gqa and varlen False
    (never checked), causal=False with a causal option in the config or a variant's
    name (run silently): each is refused with the capability's sentence."""
    caps = Capabilities(target="softmax", half_precision=False, gqa=False, varlen=False,
                        causal=False)
    _register_scaled(monkeypatch, "scaled_mean", caps)
    q, k, v = (t.float() for t in make_qkv(1, 2, 6, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(CapabilityError,
                                                                     match="bfloat16 inputs"):
        skyformer.attention(q, k, v, "scaled_mean")
    with pytest.raises(CapabilityError, match="fewer key/value heads"):
        skyformer.scaled_dot_product_attention(q, k[:, :1], v[:, :1], enable_gqa=True,
                                               method="scaled_mean")
    with pytest.raises(CapabilityError, match="packed variable-length"):
        skyformer.scaled_dot_product_attention(q[:1], k[:1], v[:1], method="scaled_mean",
                                               cu_seqlens=torch.tensor([0, 2, 6]))
    for call in (lambda: skyformer.attention(q, k, v, "scaled_mean[causal=true]"),
                 lambda: skyformer.MultiHeadAttention(8, 2, "scaled_mean", causal=True)):
        with pytest.raises(CapabilityError, match="causal"):
            call()
    skyformer.attention(q, k, v, "scaled_mean[factor=2.0]")  # what it can do, it does


def test_a_method_without_masks_runs_no_packed_sequences(monkeypatch):
    """Packed sequences run as a padded batch with its key padding mask: mask=False left
    varlen=True, so cu_seqlens got the mask's sentence, which names an argument the
    caller did not pass, and the method was listed among those that run them. varlen now
    follows mask, and a registration that says both is refused."""
    caps = Capabilities(target="softmax", mask=False)
    assert not caps.varlen and Capabilities(target="softmax").varlen
    _register_scaled(monkeypatch, "scaled_unmasked", caps)
    q = make_qkv(1, 2, 6, 4)[0]
    with pytest.raises(CapabilityError, match=r"^scaled_unmasked cannot run packed "
                       r"variable-length sequences \(cu_seqlens\); methods that can: softmax"):
        skyformer.scaled_dot_product_attention(q, q, q, method="scaled_unmasked",
                                               cu_seqlens=torch.tensor([0, 2, 6]))
    able = registry_methods._capability_sentence("softmax", "varlen")  # who can run them
    assert "softmax" in able and "scaled_unmasked" not in able
    with pytest.raises(ValueError, match=r"varlen=True needs mask=True: packed "
                                         r"variable-length sequences run as a padded batch"):
        Capabilities(target="softmax", mask=False, varlen=True)


def test_the_public_function_refuses_what_its_capabilities_exclude(monkeypatch):
    """The function ``register`` returns ran a key padding mask, other lengths or half
    inputs past capabilities that exclude them (a mask ignored, silently), where
    ``skyformer.attention`` and the layers refuse them with the capability's sentence."""
    caps = Capabilities(target="softmax", mask=False, cross_attention=False,
                        half_precision=False)
    scaled = _register_scaled(monkeypatch, "scaled_unable", caps)
    q, k, v = (t.float() for t in make_qkv(1, 2, 6, 4, nk=9))
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, 4:] = False
    for call, sentence in (
            (lambda: scaled(q, q, q, key_padding_mask=mask), "honour a key_padding_mask"),
            (lambda: scaled(q, k, v), "attend with a different number of queries and keys"),
            (lambda: scaled(q.half(), q.half(), q.half()), "take float16/bfloat16 inputs")):
        with pytest.raises(CapabilityError, match=f"scaled_unable cannot {sentence}"):
            call()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(CapabilityError,
                                                                     match="bfloat16 inputs"):
        scaled(q, q, q)
    assert scaled(q, q, q, factor=2.0).shape == (1, 2, 6, 4)  # what it can do, it does


@dataclasses.dataclass(frozen=True)
class _Positions:
    max_seq_len: int | None = None


def test_a_fixed_length_method_refuses_more_keys_than_its_max_seq_len(monkeypatch):
    """Capabilities(fixed_length=True) filled max_seq_len in, and a longer input reached
    the method, whose per-position tensors then failed in torch's words (or were cut
    silently); every route now refuses it in a sentence."""
    monkeypatch.delitem(registry_methods._REGISTRY, "positions", raising=False)

    @register("positions", _Positions, Capabilities(target="softmax", fixed_length=True))
    def positions(q, k, v, config, *, key_padding_mask=None, query_padding_mask="auto",
                  generator=None):
        weights = torch.ones(config.max_seq_len or k.shape[2])[: k.shape[2]]  # [N]
        return (weights[:, None] * v).mean(2, keepdim=True).expand(*q.shape[:3], v.shape[-1])

    monkeypatch.setitem(registry_methods._REGISTRY, "positions",
                        registry_methods._REGISTRY["positions"])
    q = torch.randn(1, 2, 9, 4)
    sentence = (r"^positions(\[max_seq_len=8\])?: the input has 9 keys but max_seq_len=8; "
                r".* larger max_seq_len\.$")
    for call in (lambda: positions(q, q, q, max_seq_len=8),
                 lambda: skyformer.attention(q, q, q, "positions[max_seq_len=8]"),
                 lambda: skyformer.MultiHeadAttention(8, 2, "positions", seq_len=8)(
                     torch.randn(1, 9, 8))):
        with pytest.raises(CapabilityError, match=sentence):
            call()
    assert positions(q, q, q, max_seq_len=9).shape == (1, 2, 9, 4)  # what fits runs
    assert positions(q[:, :, :5], q[:, :, :5], q[:, :, :5], max_seq_len=8).shape[2] == 5


def test_a_variant_follows_its_method_registered_again(monkeypatch):
    """Variants were cached by name: after the method was registered again, its variant
    still ran the old function."""
    q, k, v = make_qkv(1, 2, 6, 4)
    caps = Capabilities(target="softmax")
    _register_scaled(monkeypatch, "scaled_again", caps)
    first = skyformer.attention(q, k, v, "scaled_again[factor=2.0]")
    _register_scaled(monkeypatch, "scaled_again", caps, offset=1.0)
    again = skyformer.attention(q, k, v, "scaled_again[factor=2.0]")
    torch.testing.assert_close(again, first + 1.0)


@pytest.mark.parametrize("text", ["none", "None", "Auto"])
def test_a_query_padding_mask_word_other_than_auto_is_refused(text):
    """Any string passed for query_padding_mask was taken for "auto": "None" (meaning
    every query real) zeroed the rows of the queries at padded keys without a word."""
    q, k, v = make_qkv(1, 2, 6, 4)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    for call in (lambda: skyformer.attention(q, k, v, "softmax", key_padding_mask=mask,
                                             query_padding_mask=text),
                 lambda: skyformer.softmax_attention(q, k, v, key_padding_mask=mask,
                                                     query_padding_mask=text),
                 lambda: get_method("linear").bind()(q, k, v, query_padding_mask=text)):
        with pytest.raises(ValueError, match=r"query_padding_mask must be a bool tensor "
                                             rf"\[B, Nq\], None or 'auto', got '{text}'"):
            call()


@pytest.mark.parametrize("argument, value", [
    ("num_heads", 0), ("num_heads", 2.0), ("head_dim", -1), ("head_dim", True),
    ("seq_len", 0), ("seq_len", "64"),
])
def test_a_layer_shape_that_is_not_a_positive_integer_is_refused_at_bind(argument, value):
    """bind took any num_heads, head_dim and seq_len: a state was built with 0 heads or
    failed inside torch.randn, and a seq_len of "64" or 0 was dropped without a word
    (or named max_seq_len, an option the caller never gave)."""
    shape = {"num_heads": 2, "head_dim": 4, "seq_len": 16, argument: value}
    for method in ("linformer", "skyformer"):
        with pytest.raises(ValueError, match=rf"{method}: {argument} must be a positive "
                                             rf"integer or None, got {re.escape(repr(value))}"):
            get_method(method).bind(shape["num_heads"], shape["head_dim"],
                                    seq_len=shape["seq_len"])
    if argument == "seq_len":
        with pytest.raises(ValueError, match="seq_len must be a positive integer"):
            skyformer.MultiHeadAttention(8, 2, "skyformer", seq_len=value)


@pytest.mark.parametrize("option, value", [("num_features", 128.0), ("causal", 0)])
def test_replace_validates_a_value_equal_to_the_current_one_of_another_type(option, value):
    """replace returned the binding unchanged for 128.0 (== 128) or 0 (== False), so a
    value that bind and make_config refuse passed without a word."""
    bound = get_method("skyformer").bind(2, 8)
    assert bound.options()["num_features"] == 128 and bound.options()["causal"] is False
    with pytest.raises(ValueError, match=rf"skyformer: {option} must be"):
        bound.replace(**{option: value})
    assert bound.replace(num_features=128, causal=False) is bound


# The methods with a per-layer state, bound with options under which it draws everything
SEEDED_STATES = {"performer": {"num_features": 12}, "linformer": {"max_seq_len": 16},
                 "nystromformer": {"conv_kernel": 3}}


def _state_values(state: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in state.state_dict().values()]


@pytest.mark.parametrize("method", sorted(SEEDED_STATES))
def test_a_seeded_state_holds_what_the_global_generator_seeded_alike_draws(method):
    """``new_state(seed)`` draws from a generator of its own the values the factory draws
    from torch's global generator seeded with the same seed (so a seed keeps its states)."""
    bound = get_method(method).bind(2, 8, **SEEDED_STATES[method])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        expected = _state_values(bound.method.state(bound.config, 2, 8))
    got = _state_values(bound.new_state(seed=5))
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", sorted(SEEDED_STATES))
def test_a_seeded_state_is_built_apart_from_draws_in_another_thread(method, monkeypatch):
    """One thread builds seeded states while another draws from the global generator in the
    middle of each build (a barrier at the state's first parameter or buffer): the states
    equal those built alone, and the other thread draws what it draws alone."""
    import threading

    bound = get_method(method).bind(2, 8, **SEEDED_STATES[method])
    alone = [_state_values(bound.new_state(seed=s)) for s in (0, 1)]
    drawn_alone = draws_alone(2)

    barrier, builder = threading.Barrier(2, timeout=30), threading.current_thread()
    paused = []  # the states paused in (kept: a freed one's id could come back)

    def pause_once(register):
        def registered(module, name, value, *args, **kwargs):
            if threading.current_thread() is builder and isinstance(
                    module, bound.method.state) and all(m is not module for m in paused):
                paused.append(module)
                barrier.wait()  # the other thread draws now
                barrier.wait()
            return register(module, name, value, *args, **kwargs)
        return registered

    for name in ("register_buffer", "register_parameter"):
        monkeypatch.setattr(torch.nn.Module, name, pause_once(getattr(torch.nn.Module, name)))
    other = GlobalDraws(barrier, 2)
    other.start()
    built = [_state_values(bound.new_state(seed=s)) for s in (0, 1)]
    other.join()
    for state, expected in zip(built, alone, strict=True):
        for a, b in zip(state, expected, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(other.drawn, drawn_alone, strict=True):
        assert torch.equal(a, b)


class _Drawn(torch.nn.Module):
    def __init__(self, config, num_heads, head_dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(num_heads, head_dim))


class _DrawnTakingAnything(_Drawn):
    def __init__(self, config, num_heads, head_dim, **ignored):
        super().__init__(config, num_heads, head_dim)


@pytest.mark.parametrize("factory", [_Drawn, _DrawnTakingAnything])
def test_a_factory_without_a_generator_is_seeded_through_the_global_generator(factory):
    """A state factory registered without a ``generator`` argument (also one taking any
    keyword, which may drop it) still draws under the seed: torch's global CPU generator
    seeded for the build, restored after."""
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        num_features: int = 2

    @register("drawn_state", Cfg, Capabilities(target="softmax"), state=factory)
    def drawn_state(q, k, v, config, *, key_padding_mask=None, generator=None, weight=None):
        return q

    try:
        bound = get_method("drawn_state").bind(2, 3)
        before = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            expected = torch.randn(2, 3)
        assert torch.equal(bound.new_state(seed=4).weight, expected)
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        registry_methods._REGISTRY.pop("drawn_state")


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_a_state_seed_out_of_range_gets_a_sentence(seed):
    """new_state takes the seeds every seeded generator takes: an integer in [0, 2^64)
    (torch would wrap -1 onto 2^64 - 1 and report 2^64 as an overflow)."""
    bound = get_method("performer").bind(2, 8, num_features=4)
    with pytest.raises(ValueError, match=r"new_state's seed must be an integer from 0 to "
                                         r"2\^64 - 1"):
        bound.new_state(seed=seed)


@pytest.mark.parametrize(("variant", "said"), [
    ("skyformer[scale=none]", "got 'none'"),
    ("skyformer[causal=yes]", "got 'yes'"),
])
def test_a_variant_value_its_method_refuses_says_how_brackets_write_values(variant, said):
    """[scale=none] needs null (or None), [causal=yes] true: the method's sentence alone
    did not say how a variant's brackets read a value."""
    with pytest.raises(ValueError, match=re.escape(said) + r" \(in a variant's brackets a "
                                         r"value is a number, true / false, null \(None\) or "
                                         r"a string, quoted where"):
        get_method(variant)
    with pytest.raises(ValueError, match=r"has no option 'colour'; its options are"):
        get_method("skyformer[colour=red]")  # an unknown option: its own sentence alone
    with pytest.raises(ValueError) as out_of_range:  # read as meant: the method's sentence
        get_method("skyformer[gamma=0]")
    assert "brackets" not in str(out_of_range.value)
