from __future__ import annotations

import inspect

import pytest
import torch

from skyformer import MultiHeadAttention, list_methods
from skyformer.registry import CapabilityError, get_method
from tests.conftest import lacks, mask_for
from tests.test_contract import MAX_LEN


@pytest.mark.parametrize("method", list_methods())
def test_module_forward_backward_and_mask(method):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, method=method, seq_len=MAX_LEN)
    x = torch.randn(2, 20, 32)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 14:] = False
    lacks(method, "mask", lambda: layer(x, key_padding_mask=mask))  # mask=False: refused
    y = layer(x, key_padding_mask=mask_for(method, mask),
              generator=torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    y.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert method in repr(layer)


def test_module_equals_manual_projection_pipeline():
    torch.manual_seed(1)
    layer = MultiHeadAttention(16, 2, method="softmax")
    x = torch.randn(1, 7, 16)
    q = layer.q_proj(x).view(1, 7, 2, 8).transpose(1, 2)
    k = layer.k_proj(x).view(1, 7, 2, 8).transpose(1, 2)
    v = layer.v_proj(x).view(1, 7, 2, 8).transpose(1, 2)
    attn = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    expected = layer.out_proj(attn.transpose(1, 2).reshape(1, 7, 16))
    torch.testing.assert_close(layer(x), expected)


def test_a_causal_layer_given_a_context_of_another_length_says_cross_attention_is_another_layer():
    layer = MultiHeadAttention(16, 2, "skyformer", causal=True, num_features=4)
    with pytest.raises(ValueError, match=r"built with causal=True, .* x holds 5 positions, "
                                         r"context 7; a decoder's cross-attention to an "
                                         r"encoder is a layer of its own, built without "
                                         r"causal=True"):
        layer(torch.randn(2, 5, 16), context=torch.randn(2, 7, 16))


def test_cross_attention_with_context():
    layer = MultiHeadAttention(16, 2, method="kernelized")
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    assert layer(x, context=ctx).shape == (2, 5, 16)


def test_options_and_errors():
    layer = MultiHeadAttention(16, 2, method="skyformer", num_features=8)
    assert layer.config.num_features == 8
    with pytest.raises(ValueError, match=r"MultiHeadAttention: dim \(10\) must be divisible by "
                       r"num_heads \(3\), .*; pass num_heads among 1, 2, 5, 10\."):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="no option"):
        MultiHeadAttention(16, 2, method="skyformer", features=8)
    with pytest.raises(ValueError, match=r"\[B, N, 16\]"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="unknown attention method"):
        MultiHeadAttention(16, 2, method="nope")
    with pytest.raises(CapabilityError):
        MultiHeadAttention(16, 2, method="nystromformer", causal=True)
    queries = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_padding_mask marks the padded queries too"):
        layer(torch.randn(2, 5, 16), query_padding_mask=queries)  # not silently ignored
    layer(torch.randn(2, 5, 16), context=torch.randn(2, 7, 16), query_padding_mask=queries)



@pytest.mark.parametrize(("argument", "value", "says"), [
    ("batch_first", True, r"always takes x batch-first, \[B, N, dim\]; leave batch_first "
                          r"out \(a sequence-first x \[N, B, dim\] converts with "
                          r"x.transpose\(0, 1\)\)"),
    ("kdim", 4, r"projects keys and values from a context of width dim \(16\); leave kdim "
                r"out and bring the context to that width first"),
    ("vdim", 16, r"leave vdim out"),
    ("add_bias_kv", False, r"has no add_bias_kv: it attends to the keys and values given; "
                           r"leave add_bias_kv out"),
    ("add_zero_attn", True, r"leave add_zero_attn out"),
    ("dtype", torch.float64, r"takes no dtype: build it and call layer.to\(dtype\), or "
                             r"build it in a `with torch.device\(...\)` block"),
])
def test_torch_multihead_attention_arguments_get_their_own_sentence(argument, value, says):
    """torch.nn.MultiheadAttention's arguments were read as options of the method ("skyformer
    has no option 'batch_first'; its options are: ..."), naming options that have nothing
    to do with them; each gets a sentence saying what the layer does instead."""
    with pytest.raises(ValueError, match=r"MultiHeadAttention .*" + says):
        MultiHeadAttention(16, 2, method="skyformer", **{argument: value})


@pytest.mark.parametrize("cached", [False, True], ids=["forward", "decoding"])
def test_keys_passed_where_the_padding_mask_goes_get_a_sentence(cached):
    """``layer(x, keys)``, torch.nn.MultiheadAttention's call with the keys second, put a
    float tensor [B, M, dim] in key_padding_mask's place and got the advice to convert a
    0/1 or additive mask with ``mask == 1`` / ``mask == 0``; it is now told to pass
    the keys' source as ``context``."""
    layer = MultiHeadAttention(16, 2, method="softmax", causal=cached)
    x = torch.randn(2, 5, 16)
    cache = {"cache": layer.new_cache()} if cached else {}
    with pytest.raises(ValueError, match=r"MultiHeadAttention: key_padding_mask must be "
                       r"\[B, N\] bool \(True = real token\), got a tensor of shape "
                       r"\(2, 7, 16\), the shape of x or a context; .*pass their source as "
                       r"context=\.\.\."):
        layer(x, torch.randn(2, 7, 16), **cache)


def test_keys_of_another_width_passed_where_the_padding_mask_goes_get_the_sentence():
    """torch.nn.MultiheadAttention's ``kdim``/``vdim`` call, ``layer(x, keys)`` with keys
    [B, M, 8] narrower than the layer, got the advice to convert a 0/1 mask with
    ``mask == 1``; it gets the sentence of keys passed there, with the width to bring
    them to."""
    layer = MultiHeadAttention(16, 2, method="softmax")
    with pytest.raises(ValueError, match=r"got a tensor of shape \(2, 7, 8\), the shape of "
                       r"keys or values; .*pass their source as context=\.\.\., of width "
                       r"dim \(16\): bring it to that width first"):
        layer(torch.randn(2, 5, 16), torch.randn(2, 7, 8))

@pytest.mark.parametrize(("call", "says"), [
    (lambda layer, x: layer(x, x, x),
     r"takes one x \(and key_padding_mask\) positionally, not torch.nn.MultiheadAttention's "
     r"\(query, key, value\): .*context=\.\.\."),
    (lambda layer, x: layer(x, need_weights=False),
     r"returns the output alone, with no attention weights \(the approximate methods form "
     r"no attention matrix\); leave need_weights out, and for the matrix the layer's "
     r"method applies call layer.attention_weights\(x, key_padding_mask\)"),
    (lambda layer, x: layer(x, attn_mask=torch.ones(5, 5, dtype=torch.bool)),
     r"takes no attn_mask: .*causal=True.*key_padding_mask.*"
     r"skyformer.scaled_dot_product_attention"),
    (lambda layer, x: layer(x, is_causal=True),
     r"takes no is_causal: build the layer with causal=True"),
    (lambda layer, x: layer(x, mask=None),
     r"got an unexpected keyword argument 'mask'; it takes key_padding_mask, context, "
     r"query_padding_mask, generator and cache"),
], ids=["query_key_value", "need_weights", "attn_mask", "is_causal", "unknown"])
def test_torch_multihead_attention_calls_get_their_own_sentence(call, says):
    """torch.nn.MultiheadAttention's call, ``layer(q, k, v, need_weights=..., attn_mask=...,
    is_causal=...)``, failed with Python's "forward() takes from 2 to 3 positional
    arguments but 4 were given" or "unexpected keyword argument", while the constructor
    refuses torch's arguments in a sentence; each now says what the layer does instead."""
    layer = MultiHeadAttention(16, 2, method="softmax")
    with pytest.raises(TypeError, match=r"MultiHeadAttention.* " + says):
        call(layer, torch.randn(2, 5, 16))


def test_torch_calls_sentence_names_the_drop_in():
    """``layer(q, k, v)`` is told how many positional arguments it passed and which layer
    takes torch's call."""
    layer = MultiHeadAttention(16, 2, method="softmax")
    x = torch.randn(2, 5, 16)
    with pytest.raises(TypeError, match=r"it got 3 positional arguments\. .*"
                                        r"skyformer.TorchMultiheadAttention takes torch's"):
        layer(x, x, x)


def test_a_number_where_the_method_goes_names_dropout():
    """``MultiHeadAttention(8, 2, 0.1)``: torch's third positional argument is dropout;
    it was looked up as a method ("unknown attention method 0.1")."""
    with pytest.raises(TypeError, match=r"method must be a method's name .*got float 0\.1; "
                                        r"dropout is keyword-only here: dropout=0\.1\.$"):
        MultiHeadAttention(8, 2, 0.1)


@pytest.mark.parametrize("layer_class", ["MultiHeadAttention", "TorchMultiheadAttention"])
def test_both_layers_take_the_dropout_range_torch_takes(layer_class):
    """dropout=1.0, which torch's layers take (every attention output dropped: the output
    projection's bias is left), was refused by MultiHeadAttention alone; both layers
    check their configuration in one place now."""
    import skyformer

    make = getattr(skyformer, layer_class)
    x = torch.randn(2, 5, 8)
    if layer_class == "MultiHeadAttention":
        layer = make(8, 2, dropout=1.0).train()
        out = layer(x)
    else:
        layer = make(8, 2, dropout=1.0, batch_first=True).train()
        out = layer(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(out, layer.out_proj.bias.expand_as(out))
    with pytest.raises(ValueError, match=rf"^{layer_class}: dropout must be a number in "
                                         r"\[0, 1\], got 1\.5\.$"):
        make(8, 2, dropout=1.5)
    with pytest.raises(ValueError, match=r"must be divisible by num_heads \(3\), .* pass "
                                         r"num_heads among 1, 2, 4, 8\.$"):
        make(8, 3)


def test_a_context_of_another_batch_is_named_at_the_layer():
    """A context of another batch size was named in the heads' shapes ("q (3, 2, 5, 4),
    k (2, 2, 7, 4)"), and with an empty x it was taken in silence."""
    layer = MultiHeadAttention(8, 2, method="softmax")
    for n in (5, 0):
        with pytest.raises(ValueError, match=rf"x and context must hold the same batch, got "
                                             rf"3 and 2 sequences \(x \(3, {n}, 8\), context "
                                             r"\(2, 7, 8\)\)"):
            layer(torch.randn(3, n, 8), context=torch.randn(2, 7, 8))


def test_an_empty_context_gives_zeros_through_the_output_projection():
    """No key to attend to (a context of length 0): torch.nn.MultiheadAttention's output,
    the output projection of zeros; the methods refused it as an empty input."""
    layer = MultiHeadAttention(8, 2, method="skyformer", num_features=4)
    x = torch.randn(3, 5, 8, requires_grad=True)
    out = layer(x, context=torch.randn(3, 0, 8))
    torch.testing.assert_close(out, layer.out_proj.bias.expand(3, 5, 8))
    out.sum().backward()
    assert x.grad is not None and not x.grad.any()
    with pytest.raises(ValueError, match=r"query_padding_mask must have shape \[B, Nq\] = "
                                         r"\[3, 5\], got \(7, 7\)"):
        layer(x, context=torch.randn(3, 0, 8),
              query_padding_mask=torch.ones(7, 7, dtype=torch.bool))


def test_forward_says_how_a_randomised_layer_draws_in_eval_mode():
    """``eval()`` fixes no draw: a randomised method takes a fresh key from torch's
    global generator on every call unless ``generator`` is passed, which forward's
    docstring says (it named every argument but ``generator``)."""
    doc = inspect.getdoc(MultiHeadAttention.forward)
    names = [n for n in inspect.signature(MultiHeadAttention.forward).parameters if n != "self"]
    assert [n for n in names if f"``{n}" not in doc] == []
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method="skyformer", num_features=4).eval()
    x = torch.randn(1, 12, 16)
    assert not torch.equal(layer(x), layer(x))
    assert torch.equal(layer(x, generator=torch.Generator().manual_seed(1)),
                       layer(x, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("cached", [False, True], ids=["forward", "decoding"])
def test_a_wrong_padding_mask_gets_the_same_sentence_with_a_cache(cached):
    """A decoding step names the argument the caller passed (key_padding_mask), with the
    forward's conversion of a 0/1 mask, not the decoding state's own argument."""
    layer = MultiHeadAttention(16, 2, method="linear", causal=True)
    x = torch.randn(2, 5, 16)
    cache = {"cache": layer.new_cache()} if cached else {}
    with pytest.raises(TypeError, match=r"linear: key_padding_mask must be a bool tensor .*"
                                        r"converts with mask == 1"):
        layer(x, torch.ones(2, 5, dtype=torch.long), **cache)
    with pytest.raises(ValueError, match=r"linear: key_padding_mask must have shape "
                                         r"\[B, Nk\] = \[2, 5\], got \(2, 4\)"):
        layer(x, torch.ones(2, 4, dtype=torch.bool), **cache)

@pytest.mark.parametrize(("method", "cross"), [("skyformer", False), ("skyformer", True),
                                                ("linformer", False)])
def test_attention_weights_are_the_matrix_forward_applies(method, cross):
    """With one key: forward is the output projection of the weights applied to the
    projected values (Linformer's own projections included); padded keys get weight 0."""
    from skyformer import random_key

    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method, num_features=4, seq_len=12).double().eval()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    context = torch.randn(2, 12, 16, dtype=torch.float64) if cross else None
    source = x if context is None else context
    mask = torch.ones(2, source.shape[1], dtype=torch.bool)
    mask[1, -3:] = False
    weights = layer.attention_weights(x, mask, context=context, generator=random_key(3))
    out = layer(x, mask, context=context, generator=random_key(3))
    assert weights.shape == (2, 2, 10, source.shape[1])
    attended = (weights @ layer._split(layer.v_proj(source))).transpose(1, 2).reshape(2, 10, 16)
    torch.testing.assert_close(out, layer.out_proj(attended), rtol=1e-9, atol=1e-10)
    assert torch.all(weights[1, :, :, -3:] == 0)


def test_attention_weights_of_a_method_without_them_and_of_no_query():
    layer = MultiHeadAttention(16, 2, "kdeformer")
    with pytest.raises(CapabilityError, match=r"^MultiHeadAttention.attention_weights: "
                       r"kdeformer cannot give attention weights"):
        layer.attention_weights(torch.randn(1, 8, 16))
    sky = MultiHeadAttention(16, 2, "skyformer")
    assert sky.attention_weights(torch.randn(2, 0, 16)).shape == (2, 2, 0, 0)
    with pytest.raises(ValueError, match="x must have shape"):
        sky.attention_weights(torch.randn(2, 8, 15))


def test_method_state_module_is_owned_and_passed():
    """A method's state module (e.g. learned projections) is a submodule of the layer and
    its output reaches the function as keyword arguments."""
    import dataclasses as dc

    from skyformer.registry import _REGISTRY, Capabilities, register

    @dc.dataclass(frozen=True)
    class Cfg:
        num_features: int = 3

    class State(torch.nn.Module):
        def __init__(self, cfg, heads, head_dim):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.full((heads, 1, 1), 2.0))

        def forward(self, q, k):
            return {"gain": self.gain}

    def scaled_values(q, k, v, *, key_padding_mask=None, generator=None, num_features=3, gain=None):
        return v * (1.0 if gain is None else gain)

    register("test_state_method", Cfg, Capabilities(target="softmax"), state=State)(scaled_values)
    try:
        layer = MultiHeadAttention(8, 2, method="test_state_method")
        assert any(name.startswith("method_state") for name, _ in layer.named_parameters())
        x = torch.randn(1, 4, 8)
        layer(x).sum().backward()
        assert layer.method_state.gain.grad is not None
    finally:
        del _REGISTRY["test_state_method"]


@pytest.mark.parametrize("method", ["performer", "linformer"])
def test_a_layer_with_fixed_draws_leaves_the_global_generator_alone(method):
    """Performer's features and Linformer's projections are the layer's (its state
    module): a forward pass draws nothing, so the global random stream (dropout masks
    elsewhere in the model) is the same whichever method the layer runs."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method=method, seq_len=MAX_LEN)
    x = torch.randn(1, 12, 16)
    before = torch.get_rng_state()
    layer(x)
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(TypeError, match="generator must be"):  # still checked
        layer(x, generator="seed")


STATE_OPTIONS = {"performer": {"num_features": 8}, "linformer": {"num_features": 8},
                 "nystromformer": {"num_features": 8, "conv_kernel": 3}}


@pytest.mark.parametrize("method", [m for m in list_methods() if get_method(m).state])
def test_a_layer_built_on_meta_is_initialised_by_reset_parameters(method):
    """PyTorch's recipe for large models: build on the meta device, ``to_empty``, then
    ``reset_parameters()`` of every module that has one. The method's state (Performer's
    features and redraw seed, Linformer's projections, Nystromformer's convolution) is
    drawn again as at construction, not left as uninitialised memory."""
    options = {"seq_len": MAX_LEN, **STATE_OPTIONS.get(method, {})}
    torch.manual_seed(0)
    built = MultiHeadAttention(16, 2, method=method, **options)
    with torch.device("meta"):
        layer = MultiHeadAttention(16, 2, method=method, **options)
    layer = layer.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    want = built.state_dict()
    assert any(key.startswith("method_state.") for key in want)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, want[key]), key


@pytest.mark.parametrize("method", ["softmax", "skyformer", "performer", "linformer"])
def test_an_empty_batch_gives_an_empty_output_as_torch_does(method):
    """torch.nn.MultiheadAttention returns [0, N, dim] for an empty batch (a model's
    empty sub-batch); the layer refused it with the methods' "skip the call" sentence."""
    options = {} if method == "softmax" else {"num_features": 8}
    layer = MultiHeadAttention(16, 2, method, seq_len=40, **options)
    x = torch.randn(0, 40, 16, requires_grad=True)
    out = layer(x, key_padding_mask=torch.ones(0, 40, dtype=torch.bool))
    assert out.shape == (0, 40, 16)
    out.sum().backward()
    assert x.grad.shape == x.shape
    # every trained parameter gets a gradient (DDP expects one on each rank)
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    assert layer(torch.randn(2, 0, 16)).shape == (2, 0, 16)
    # the method's sentences for a mask it would refuse, though it is not called
    with pytest.raises(ValueError, match=rf"^{method}: key_padding_mask must have shape "
                                         r"\[B, Nk\] = \[0, 40\], got \(3, 6\)\.$"):
        layer(torch.randn(0, 40, 16), key_padding_mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match=rf"^{method}: key_padding_mask must be a bool tensor"):
        layer(torch.randn(0, 40, 16), key_padding_mask=torch.ones(0, 40))
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta but the inputs are on "):
        layer(torch.randn(0, 40, 16), key_padding_mask=torch.ones(0, 40, dtype=torch.bool,
                                                                   device="meta"))


def test_a_mask_without_a_real_token_gets_a_warning_naming_both_conventions():
    """torch.nn.MultiheadAttention's key_padding_mask (True = padding) passed for a batch
    without padding is False everywhere here: every output was 0 without a word. The
    layer (its forward and a decoding step) and skyformer.attention warn, from the
    user's line; a mask with one real token, a batch element of padding only beside
    real ones, a mask of the wrong shape (its sentence alone) and a sequence-parallel
    shard of padding (tests/distributed) do not."""
    import warnings

    import skyformer

    layer = MultiHeadAttention(16, 2, method="softmax")
    x = torch.randn(2, 5, 16)
    nothing_real = torch.zeros(2, 5, dtype=torch.bool)
    says = (r"softmax: key_padding_mask is False everywhere, so every key is padding and "
            r"every output row is 0\. Here True marks a real token .* "
            r"torch\.nn\.MultiheadAttention's key_padding_mask marks padding with True: "
            r"pass ~mask, or None where nothing is padded\.")
    with pytest.warns(UserWarning, match=says) as caught:
        out = layer(x, key_padding_mask=nothing_real)
    assert caught[0].filename == __file__
    torch.testing.assert_close(out, layer.out_proj(torch.zeros(2, 5, 16)))
    q = torch.randn(2, 2, 5, 8)
    with pytest.warns(UserWarning, match=says.replace("softmax", "skyformer")):
        skyformer.attention(q, q, q, "skyformer", key_padding_mask=nothing_real)
    decoder = MultiHeadAttention(16, 2, method="skyformer", causal=True)
    with pytest.warns(UserWarning, match=says.replace("softmax", "skyformer")):
        decoder(x, key_padding_mask=nothing_real, cache=decoder.new_cache())  # a prefill
    one_empty = nothing_real.clone()
    one_empty[0, 2] = True  # batch element 1 is padding only: legitimate
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, key_padding_mask=one_empty)
        skyformer.attention(q, q, q, "skyformer", key_padding_mask=one_empty)
        with pytest.raises(ValueError, match=r"must have shape \[B, Nk\] = \[2, 5\]"):
            skyformer.attention(q, q, q, "skyformer",  # the sentence alone, no warning first
                                key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))


def test_sequence_first_input_with_a_mask_is_named_as_such():
    """torch's default layout, [N, B, dim], beside a [B, N] mask: the method's sentence
    blamed the mask's shape ([B, Nk] = [50, 2]) for the input's layout. Which of the two
    is transposed the layer cannot tell: it names both fixes."""
    layer = MultiHeadAttention(dim=16, num_heads=2, method="softmax")
    x, mask = torch.randn(2, 10, 16), torch.ones(2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^MultiHeadAttention: x \(10, 2, 16\) and "
                                         r"key_padding_mask \(2, 10\) disagree .* pass "
                                         r"x\.transpose\(0, 1\), else pass key_padding_mask"):
        layer(x.transpose(0, 1), key_padding_mask=mask)
    with pytest.raises(ValueError, match=r"^MultiHeadAttention: context \(10, 2, 16\) "
                                         r"and key_padding_mask"):
        layer(torch.randn(2, 3, 16), key_padding_mask=mask, context=x.transpose(0, 1))
    assert layer(x, key_padding_mask=mask).shape == (2, 10, 16)
