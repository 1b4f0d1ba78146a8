"""Methods registered from outside the library (``skyformer.registry.register``): what
they must return, and registering one again."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
import typing

import numpy as np
import pytest
import torch

import skyformer
from skyformer.registry import Capabilities, register
from skyformer.registry import methods as registry_methods


@dataclasses.dataclass(frozen=True)
class _Options:
    width: int = 2


@pytest.fixture
def plugin():
    """``register(name, body)``: a method from outside whose core returns
    ``body(q, k, v)``; the names are taken out of the registry afterwards."""
    names = []

    def make(name, body):
        @register(name, _Options, Capabilities(target="softmax"))
        def core(q, k, v, config, *, key_padding_mask=None, generator=None):
            return body(q, k, v)

        names.append(name)
        return core

    yield make
    for name in names:
        registry_methods._REGISTRY.pop(name, None)


WRONG = [
    ("few_rows", lambda q, k, v: v[:, :, :3], r"tensor of shape \[2, 2, 3, 5\]"),
    ("transposed", lambda q, k, v: v.transpose(1, 2), r"tensor of shape \[2, 6, 2, 5\]"),
    ("head_dim", lambda q, k, v: q, r"float32 tensor of shape \[2, 2, 6, 4\]"),
    ("dtype", lambda q, k, v: v.double(), r"float64 tensor"),
]


@pytest.mark.parametrize("name,body,said", WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_output_is_named_at_every_entry_point(plugin, name, body, said):
    """A plugin's output of the wrong shape or dtype used to pass through (a layer then
    returned fewer rows) or to fail deep in torch; now each route names the method,
    what it returned and what it must."""
    plugin(f"plugin_{name}", body)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    v = torch.randn(2, 2, 6, 5)
    pattern = rf"the attention method 'plugin_{name}' \(.*core\) returned a .*{said}.*" \
              r"\[B, H, Nq, Dv\] = \[2, 2, 6, 5\]"
    for call in (lambda: skyformer.attention(q, k, v, f"plugin_{name}"),
                 lambda: skyformer.scaled_dot_product_attention(q, k, v,
                                                                method=f"plugin_{name}")):
        with pytest.raises(TypeError, match=pattern):
            call()


def test_a_dtype_autocast_chose_is_named_as_autocasts(plugin):
    """Under torch.autocast the inputs reach the method in bfloat16; one that upcasts and
    returns float32 was told to return 'q's dtype (bfloat16)' for float32 inputs given,
    without a word of autocast."""
    plugin("plugin_upcast", lambda q, k, v: v.float())
    q = torch.randn(1, 2, 4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"in q's dtype \(bfloat16\); torch.autocast cast the inputs to "
                             r"bfloat16, so that is the dtype to return"):
        skyformer.attention(q, q, q, "plugin_upcast")


def test_a_plugin_takes_inputs_of_mixed_dtypes_that_autocast_unifies(plugin):
    """Llama's rotary step under torch.autocast hands float32 q, k beside a bfloat16 v;
    the input checks ran before autocast's cast and refused them ('must share one
    dtype'), where the library's methods run."""
    plugin("plugin_mixed", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v))
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert skyformer.attention(q, k, v, "plugin_mixed").dtype == torch.bfloat16
    with pytest.raises(TypeError, match="plugin_mixed: q, k, v must share one dtype"):
        skyformer.attention(q, k, v, "plugin_mixed")  # without autocast: refused


def test_a_layer_does_not_return_fewer_rows_than_it_took(plugin):
    plugin("plugin_rows", lambda q, k, v: v[:, :, :3])
    layer = skyformer.MultiHeadAttention(dim=8, num_heads=2, method="plugin_rows")
    with pytest.raises(TypeError, match=r"'plugin_rows'.*shape \[2, 2, 3, 4\]"):
        layer(torch.randn(2, 6, 8))


def test_a_method_that_returns_no_tensor_is_named(plugin):
    plugin("plugin_list", lambda q, k, v: v.tolist())
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(TypeError, match=r"'plugin_list' .* returned a list; a method "
                                        r"returns one tensor \[B, H, Nq, Dv\] = \[1, 1, 3, 2\]"):
        skyformer.attention(q, q, q, "plugin_list")


def test_a_right_output_passes_as_it_is(plugin):
    plugin("plugin_values", lambda q, k, v: v * 1)
    q, k, v = (torch.randn(1, 2, 5, 3) for _ in range(3))
    torch.testing.assert_close(skyformer.attention(q, k, v, "plugin_values"), v)


def test_a_plugins_inputs_get_the_librarys_checks_and_padded_rows_are_zero(plugin):
    """A plugin that checks nothing: 3-D inputs (which it ran and returned 3-D), a mask
    of the wrong shape or dtype get the library's sentences naming the method; the
    output rows of padded queries are 0, as every method's (README conventions)."""
    plugin("plugin_unchecked", lambda q, k, v: v * 1)
    q = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match=r"plugin_unchecked: q must have shape \[B, H, N, D\]"):
        skyformer.attention(q, q, q, "plugin_unchecked")
    q = torch.randn(2, 2, 6, 4)
    for mask, said in ((torch.ones(2, 5, dtype=torch.bool), "plugin_unchecked: "),
                       (torch.ones(2, 6), "plugin_unchecked: ")):
        with pytest.raises((ValueError, TypeError), match=said):
            skyformer.attention(q, q, q, "plugin_unchecked", key_padding_mask=mask)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out = skyformer.attention(q, q, q, "plugin_unchecked", key_padding_mask=mask)
    assert torch.equal(out[1, :, 4:], torch.zeros(2, 2, 4))
    torch.testing.assert_close(out[0], q[0])


@pytest.mark.parametrize("generator", ["seed", 7, "keys"])
def test_a_plugins_generator_gets_the_librarys_check(plugin, generator):
    """A plugin that draws nothing took any generator silently (a seed as an int, a
    string), where the library's methods name what they take."""
    plugin("plugin_no_draws", lambda q, k, v: v * 1)
    q = torch.randn(3, 2, 6, 4)
    if generator == "keys":
        generator = torch.stack([skyformer.random_key(i) for i in range(3)])
    with pytest.raises(TypeError, match=r"plugin_no_draws'?.*: generator (must be|takes one "
                                        r"random key)"):
        skyformer.attention(q, q, q, "plugin_no_draws", generator=generator)
    skyformer.attention(q, q, q, "plugin_no_draws", generator=torch.Generator())


def _returning_values(monkeypatch, name, config_class):
    """Register ``name``, options ``config_class``, as a method returning ``v``; taken out
    of the registry after the test."""
    monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)

    @register(name, config_class, Capabilities(target="softmax"))
    def values(q, k, v, config, *, key_padding_mask=None, generator=None):
        return v * 1

    monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])


@dataclasses.dataclass(frozen=True)
class _Typed:
    num_features: int = 8
    scale: float | None = None
    mode: typing.Literal["a", "b"] = "a"
    flag: bool = False


@pytest.mark.parametrize(("option", "value", "said"), [
    ("num_features", "abc", r"num_features must be an int .*got 'abc' \(str\)"),
    ("num_features", 2.5, r"num_features must be an int .*got 2\.5 \(float\)"),
    ("num_features", True, r"num_features must be an int .*got True \(bool\)"),
    ("scale", "x", r"scale must be a float or None"),
    ("mode", "c", r"mode must be 'a' or 'b'"),
    ("flag", 1, r"flag must be a bool")])
def test_a_plugins_options_are_held_to_their_annotations(monkeypatch, option, value, said):
    """A plugin's config may check nothing: a value its annotation excludes failed deep
    in the method (a str compared with a Tensor) or ran (2.5 for an int); it is refused
    in a sentence, at the call, in a variant's name and in a layer's constructor. An int
    for a float and the values of a Literal pass."""
    _returning_values(monkeypatch, "plugin_typed", _Typed)
    q = torch.randn(1, 2, 4, 3)
    pattern = rf"plugin_typed: option {said} \(as _Typed declares it\)|{said}"
    with pytest.raises(TypeError, match=pattern):
        skyformer.attention(q, q, q, "plugin_typed", **{option: value})
    with pytest.raises(TypeError, match=pattern):
        skyformer.MultiHeadAttention(6, 2, "plugin_typed", **{option: value})
    if isinstance(value, str):
        with pytest.raises(TypeError, match=pattern):
            skyformer.get_method(f"plugin_typed[{option}={value}]")
    assert skyformer.attention(q, q, q, "plugin_typed", scale=1, mode="b").shape == q.shape


class _Mode(enum.Enum):
    LOCAL = "local"


@dataclasses.dataclass(frozen=True)
class _Lenient:
    mode: _Mode = _Mode.LOCAL
    widths: tuple[int, ...] = (1,)
    level: typing.Literal[1.0, 2.0] = 1.0
    count: typing.Literal[1, 2] = 1
    rate: float = 0.5
    flag: bool = False

    def __post_init__(self):  # the config converts what the command line gives
        object.__setattr__(self, "mode", _Mode(self.mode))
        object.__setattr__(self, "widths", tuple(self.widths))


def test_the_annotation_checks_take_what_a_config_converts_and_numpy_numbers(monkeypatch):
    """The checks refused values that worked: a str for an Enum the config converts, a
    list for a tuple (--option gives JSON lists), 2 for Literal[1.0, 2.0], NumPy's
    float32 and bool_. Plain annotations alone are checked; a flag is still no number."""
    _returning_values(monkeypatch, "plugin_lenient", _Lenient)
    q = torch.randn(1, 2, 4, 3)
    for options in ({"mode": "local"}, {"widths": [2, 3]}, {"level": 2},
                    {"rate": np.float32(0.25)}, {"flag": np.bool_(True)}):
        assert skyformer.attention(q, q, q, "plugin_lenient", **options).shape == q.shape
    for options, said in (({"level": True}, "level must be 1.0 or 2.0"),
                          ({"count": 2.0}, "count must be 1 or 2"),  # no count: a float
                          ({"widths": "ab"}, "widths must be a tuple"),
                          ({"rate": True}, "rate must be a float")):
        with pytest.raises(TypeError, match=said):
            skyformer.attention(q, q, q, "plugin_lenient", **options)


def test_a_name_held_by_another_function_is_refused_with_what_to_do(plugin):
    plugin("plugin_taken", lambda q, k, v: v)
    with pytest.raises(ValueError, match=r"'skyformer' is already registered, by "
                       r"skyformer\.ops\.skyformer\..*; register .* under another name"):
        register("skyformer", _Options, Capabilities(target="softmax"))(
            lambda q, k, v, config, *, key_padding_mask=None, generator=None: v)

    def other(q, k, v, config, *, key_padding_mask=None, generator=None):
        return v

    with pytest.raises(ValueError, match="'plugin_taken' is already registered"):
        register("plugin_taken", _Options, Capabilities(target="softmax"))(other)


def test_reloading_the_module_that_registers_a_method_replaces_it(tmp_path, monkeypatch):
    """``importlib.reload`` of a plugin (or a notebook cell run twice) defines the same
    function again: it takes the name's place instead of failing."""
    (tmp_path / "reloaded_plugin.py").write_text(
        "import dataclasses\n"
        "from skyformer.registry import Capabilities, register\n"
        "SCALE = 2.0\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Options:\n"
        "    pass\n"
        "@register('plugin_reloaded', Options, Capabilities(target='softmax'))\n"
        "def core(q, k, v, config, *, key_padding_mask=None, generator=None):\n"
        "    return v * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # the edit below keeps its size
    try:
        module = importlib.import_module("reloaded_plugin")
        q = torch.ones(1, 1, 2, 2)
        assert skyformer.attention(q, q, q, "plugin_reloaded").max() == 2.0
        text = (tmp_path / "reloaded_plugin.py").read_text().replace("2.0", "3.0")
        (tmp_path / "reloaded_plugin.py").write_text(text)
        importlib.reload(module)
        assert skyformer.attention(q, q, q, "plugin_reloaded").max() == 3.0
    finally:
        registry_methods._REGISTRY.pop("plugin_reloaded", None)
        sys.modules.pop("reloaded_plugin", None)


def test_a_config_that_is_not_frozen_is_refused():
    @dataclasses.dataclass
    class Loose:
        width: int = 2

    with pytest.raises(TypeError, match=r"config_class of 'plugin_loose' must be a frozen "
                                        r"dataclass .*dataclass\(frozen=True\)"):
        register("plugin_loose", Loose, Capabilities(target="softmax"))
    assert "plugin_loose" not in skyformer.list_methods()


def test_a_config_without_a_docstring_lists_its_fields_in_the_public_docstring(plugin):
    """The generated docstring ended in an empty "Options" section."""
    public = plugin("plugin_documented", lambda q, k, v: v)
    assert public.__doc__.rstrip().endswith(
        "Options (``_Options``, keyword arguments):\n\nwidth: int = 2")


def test_a_plugin_without_a_sequence_parallel_form_is_told_why(plugin):
    """It was given the reason of the library's sparse methods (hashing, clustering)."""
    from skyformer.distributed.forms import form_of

    plugin("plugin_local", lambda q, k, v: v)
    with pytest.raises(ValueError, match=r"plugin_local cannot run sequence parallel: it is "
                                         r"registered from outside the library"):
        form_of("plugin_local")
    with pytest.raises(ValueError, match=r"reformer cannot run sequence parallel: its keys "
                                         r"enter through more than sums"):
        form_of("reformer")


def test_a_method_registered_in_its_public_form_is_named_as_itself():
    """A function taking its options as keyword arguments (no config argument) runs
    through an adapter of the registry's: the sentences named that adapter
    (skyformer.registry.signature.core_of.<locals>.adapted), registering the same
    function again was refused, and sequence parallelism took it for a library method."""
    from skyformer.distributed.forms import form_of

    def public_plugin(q, k, v, *, key_padding_mask=None, generator=None, width=2):
        return v[:, :, :3]

    try:
        for _ in range(2):  # the same function again (a reload) takes its place
            register("plugin_public", _Options, Capabilities(target="softmax"))(public_plugin)
        q = torch.randn(1, 1, 6, 4)
        with pytest.raises(TypeError, match=r"the attention method 'plugin_public' "
                                            r"\(test_plugin_methods\..*public_plugin\)"):
            skyformer.attention(q, q, q, "plugin_public")
        with pytest.raises(ValueError, match="registered from outside the library"):
            form_of("plugin_public")
    finally:
        registry_methods._REGISTRY.pop("plugin_public", None)


def test_a_config_with_a_factory_or_an_optional_field_reads_as_declared():
    """A default factory showed as <dataclasses._MISSING_TYPE object> in the public
    function's signature and docstring, and Optional[str] as Optional."""
    import inspect

    @dataclasses.dataclass(frozen=True)
    class Shaped:
        sizes: tuple = dataclasses.field(default_factory=tuple)
        label: typing.Optional[str] = None  # noqa: UP045 (the spelling under test)

    try:
        public = register("plugin_shaped", Shaped, Capabilities(target="softmax"))(
            lambda q, k, v, config, *, key_padding_mask=None, generator=None: v)
        shown = str(inspect.signature(public))
        # (annotations are strings here: this module has from __future__ import)
        assert "sizes: 'tuple' = tuple()" in shown and "_MISSING_TYPE" not in shown, shown
        assert public.__doc__.rstrip().endswith(
            "sizes: tuple = tuple()\nlabel: typing.Optional[str] = None"), public.__doc__
    finally:
        registry_methods._REGISTRY.pop("plugin_shaped", None)


def test_a_method_with_options_as_keywords_keeps_one_adapter_however_often_called():
    """Registered in public form (options as keyword arguments), its core was adapted
    anew at every read, and the call's cached signature took one entry a call: a leak
    of about 600 bytes a call with an attention mask (one per layer per forward)."""
    @dataclasses.dataclass(frozen=True)
    class Features:
        num_features: int = 8

    @register("keyword_options", Features, Capabilities(target="softmax", attn_mask=True))
    def keyword_options(q, k, v, *, key_padding_mask=None, query_padding_mask="auto",
                        generator=None, num_features=8, attn_mask=None):
        scores = (q @ k.transpose(-1, -2)).masked_fill(~attn_mask, float("-inf"))
        return torch.softmax(scores, -1) @ v

    method = skyformer.get_method("keyword_options")
    assert method.core is method.core
    q = torch.randn(1, 2, 6, 8)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    skyformer.scaled_dot_product_attention(q, q, q, attn_mask=causal, method="keyword_options")
    before = registry_methods._argument_names.cache_info().currsize
    for _ in range(20):
        skyformer.scaled_dot_product_attention(q, q, q, attn_mask=causal,
                                               method="keyword_options")
    assert registry_methods._argument_names.cache_info().currsize == before


@pytest.mark.parametrize(("make", "said"), [
    (lambda: lambda q, k, v, config, extra, *, key_padding_mask=None, generator=None: v,
     r"with q, k, v, config by position \(missing a required argument: 'extra'\)"),
    (lambda: lambda q, k, *, key_padding_mask=None, generator=None, width=2: k,
     r"with q, k, v by position \(too many positional arguments\)"),
])
def test_a_function_no_call_can_run_is_refused_at_registration(make, said):
    """Only the keyword arguments were checked: a core with an extra positional
    parameter, or a public form without v, registered and failed at every call with
    Python's sentence about a function the user never called."""
    with pytest.raises(TypeError, match=r"register: the function registered as 'unrunnable' "
                                        r"cannot be called as every call calls it, " + said):
        register("unrunnable", _Options, Capabilities(target="softmax"))(make())
    assert "unrunnable" not in skyformer.list_methods()


def _core(q, k, v, config, *, key_padding_mask=None, generator=None):
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


@dataclasses.dataclass(frozen=True)
class _Features:
    num_features: int = 8


def _keyword_form(q, k, v, *, key_padding_mask=None, generator=None, num_features=16):
    return _core(q, k, v, None)


@pytest.mark.parametrize(("config", "capabilities", "function", "error", "said"), [
    (_Options, Capabilities(target="softmax", attn_mask=True), _core, TypeError,
     r"'misdeclared' declares attn_mask=True, so calls pass it an attn_mask, which the "
     r"function registered does not take"),
    (_Features, Capabilities(target="softmax"), _keyword_form, ValueError,
     r"'misdeclared' defaults num_features to 16 in its function and to 8 in _Features"),
], ids=["attn-mask-not-taken", "two-defaults"])
def test_a_registration_its_calls_would_contradict_is_refused(config, capabilities, function,
                                                              error, said):
    """attn_mask=True on a function without it failed at its first masked call naming
    scaled_dot_product_attention; a keyword default other than the config's made
    direct and registered calls differ."""
    with pytest.raises(error, match=r"register: " + said):
        register("misdeclared", config, capabilities)(function)
    assert "misdeclared" not in skyformer.list_methods()


def test_an_output_on_another_device_and_a_core_under_two_names_are_said_so():
    """An output on another device failed later in torch without the method's name; a
    core registered twice was named by its first name alone, also in calls of the
    second."""
    register("first_name", _Options, Capabilities(target="softmax"))(
        lambda q, k, v, config, *, key_padding_mask=None, generator=None: v.to("meta"))
    core = skyformer.get_method("first_name").core
    register("second_name", _Options, Capabilities(target="softmax"))(core)
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(TypeError, match=r"the attention method 'first_name' or 'second_name' "
                                        r"\(.*\) returned a tensor on meta for q on cpu; .* "
                                        r"device=q.device"):
        skyformer.attention(q, q, q, "second_name")


def test_defaults_and_state_arguments_registration_leaves_alone():
    """Registration refuses what no call can run, not what runs: a keyword default of
    None, a list or NaN beside the config's, and a state argument a layer passes by
    name to a core with a per-layer state."""
    @dataclasses.dataclass(frozen=True)
    class Odd:
        eps: float = float("nan")
        windows: list = dataclasses.field(default_factory=lambda: [1, 2])
        scale: float | None = 0.5

    register("odd_defaults", Odd, Capabilities(target="softmax"))(
        lambda q, k, v, *, key_padding_mask=None, generator=None, eps=float("nan"),
        windows=(1, 2), scale=None: v)
    q = torch.randn(1, 2, 6, 4)
    assert skyformer.attention(q, q, q, "odd_defaults").shape == q.shape

    class Scale(torch.nn.Module):
        def forward(self, q, k):
            return {"scale": torch.tensor(0.5)}

    @register("stateful_positional", _Options, Capabilities(target="softmax"),
              state=lambda config, heads, dim: Scale())
    def stateful_positional(q, k, v, config, scale, *, key_padding_mask=None, generator=None):
        return v * scale

    layer = skyformer.MultiHeadAttention(8, 2, "stateful_positional")
    assert layer(torch.randn(1, 5, 8)).shape == (1, 5, 8)
