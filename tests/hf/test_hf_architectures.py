"""Decoders, cross-attention, grouped-query attention, ViT, dropout and per-layer state,
on tiny randomly initialised transformers models (exact method vs transformers' SDPA)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import skyformer.hf as shf
from skyformer import CapabilityError, random_key, registry
from skyformer.hf.attention import skyformer_attention_forward
from tests.conftest import make_qkv
from tests.hf.conftest import tiny_bert

ATOL = 1e-5  # float32 rounding between two exact computations


def ids_and_padding(b=3, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, 7:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    return ids, mask


def copy_as(model, implementation):
    import copy

    other = copy.deepcopy(model)
    other.set_attn_implementation(implementation)
    return other


@torch.no_grad()
def test_decoder_causal_with_left_and_right_padding():
    model = tiny_bert(is_decoder=True)
    ids, mask = ids_and_padding()
    exact = model(input_ids=ids, attention_mask=mask).last_hidden_state
    every_layer = copy_as(model, "skyformer:softmax")
    one_layer = copy_as(model, "sdpa")
    shf.set_attention(one_layer, "softmax", layers=[1])
    real = mask.bool()
    for ours in (every_layer, one_layer):
        out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out[real], exact[real], rtol=0, atol=ATOL)
    # No padding: transformers passes no mask and relies on is_causal.
    full = torch.ones_like(mask)
    torch.testing.assert_close(
        copy_as(model, "skyformer:softmax")(input_ids=ids, attention_mask=full).last_hidden_state,
        model(input_ids=ids, attention_mask=full).last_hidden_state, rtol=0, atol=ATOL,
    )


@torch.no_grad()
def test_causal_gaussian_method_does_not_look_ahead():
    model = copy_as(tiny_bert(is_decoder=True), "skyformer:kernelized")
    ids = ids_and_padding()[0][:1]
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 5) % 64
    a = model(input_ids=ids).last_hidden_state
    b = model(input_ids=changed).last_hidden_state
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax", "performer"])
@torch.no_grad()
def test_causal_approximations_serve_a_decoder_without_looking_ahead(method):
    model = copy_as(tiny_bert(is_decoder=True), f"skyformer:{method}")
    ids = ids_and_padding()[0][:1]
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 5) % 64
    torch.manual_seed(0)
    a = model(input_ids=ids).last_hidden_state
    torch.manual_seed(0)
    b = model(input_ids=changed).last_hidden_state
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


def test_a_decoder_refuses_options_of_the_causal_form_up_front():
    """gamma = 0 cannot run causal Nystrom (its core is a Cholesky factorisation): said by
    set_attention, before any forward pass, without asking for an option not to pass."""
    model = tiny_bert(is_decoder=True)
    with pytest.raises(ValueError, match=r"uses causal attention .* refuses these options: "
                                         r"nystrom_softmax: causal=True needs gamma > 0"):
        shf.set_attention(model, "nystrom_softmax", gamma=0.0, pinv="exact")
    assert shf.describe(model)[0]["method"].startswith("exact")  # nothing changed
    shf.set_attention(tiny_bert(), "nystrom_softmax", gamma=0.0, pinv="exact")  # encoder


def test_a_decoder_refuses_an_option_every_form_refuses_without_naming_the_causal_form():
    """num_features=0 is refused by any form: the sentence is the option's own, not one
    that blames the causal form (whose change would not help)."""
    model = tiny_bert(is_decoder=True)
    with pytest.raises(ValueError) as err:
        shf.set_attention(model, "skyformer", num_features=0)
    assert "num_features must be a positive integer" in str(err.value)
    assert "causal" not in str(err.value)


def test_decoder_refuses_methods_without_causal_masking(tmp_path):
    model = tiny_bert(is_decoder=True)
    with pytest.raises(CapabilityError,
                       match="layer 0 \\(BertSelfAttention\\) uses causal attention"):
        shf.set_attention(model, "nystromformer")
    model.save_pretrained(tmp_path)
    with pytest.raises(CapabilityError,
                       match="cannot do causal masking; methods that can: softmax"):
        shf.from_pretrained(tmp_path, "nystromformer")  # fails at load time
    from transformers import AutoModel

    plain = AutoModel.from_pretrained(tmp_path, attn_implementation="skyformer:nystromformer")
    with pytest.raises(CapabilityError, match="causal"):  # the plain route: first forward pass
        plain(input_ids=torch.ones(1, 4, dtype=torch.long))


@torch.no_grad()
def test_cross_attention_with_as_many_queries_as_encoder_tokens():
    """Nq == Nk in cross-attention: the encoder's padding must not mark decoder queries."""
    model = tiny_bert(is_decoder=True, add_cross_attention=True)
    ids, mask = ids_and_padding()
    g = torch.Generator().manual_seed(1)
    encoder = torch.randn(3, 10, 32, generator=g)
    encoder_mask = torch.ones(3, 10, dtype=torch.long)
    encoder_mask[2, 4:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "encoder_hidden_states": encoder,
                  "encoder_attention_mask": encoder_mask}
    exact = model(**kwargs).last_hidden_state
    names = [r["module"] for r in shf.describe(model)]
    assert any("crossattention" in n for n in names)
    out = copy_as(model, "skyformer:softmax")(**kwargs).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], exact[real], rtol=0, atol=ATOL)


def test_a_bert_decoders_cross_attention_refuses_methods_mixing_queries():
    """A BERT decoder (causal self-attention, cross-attention over an encoder's states)
    marks its config ``is_decoder``: its cross-attention takes linear (each output from
    its own query), not nystrom_softmax, whose landmarks mix the decoder's tokens."""
    model = tiny_bert(is_decoder=True, add_cross_attention=True)
    shf.set_attention(model, "linear")
    with pytest.raises(CapabilityError, match=r"layer 0 \(BertCrossAttention\) is the "
                                              r"cross-attention of a causal decoder"):
        shf.set_attention(model, "nystrom_softmax")
    assert {row["method"] for row in shf.describe(model)} == {"linear"}  # nothing changed


def test_a_gpt2_given_cross_attention_refuses_methods_mixing_queries_on_both_routes():
    """GPT-2 with add_cross_attention marks neither its modules nor its config is_decoder:
    skyformer was accepted in its cross-attention, and a later token moved the earlier
    logits (8.7e-4). Refused at set_attention (the model builds causal masks) and on the
    attn_implementation route (its config adds cross-attention to a decoder)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64,
                        add_cross_attention=True, bos_token_id=0, eos_token_id=0)
    model = GPT2Model(config).eval()
    with pytest.raises(CapabilityError, match=r"is the cross-attention of a causal decoder"):
        shf.set_attention(model, "skyformer", num_features=4)
    model.set_attn_implementation("skyformer:skyformer")
    states = torch.randn(1, 5, 32)
    with torch.no_grad(), pytest.raises(CapabilityError, match="cross-attention of a causal"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), encoder_hidden_states=states)


@torch.no_grad()
def test_llama_grouped_query_attention_with_padding():
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaModel(config).eval()
    ids, mask = ids_and_padding()
    exact = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out = copy_as(model, "skyformer:softmax")(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], exact[real], rtol=0, atol=ATOL)
    with pytest.raises(CapabilityError, match="causal"):
        shf.set_attention(model, "nystromformer")
    # Training with attention dropout: softmax hands the un-repeated heads to SDPA.
    config.attention_dropout = 0.5
    trained = copy_as(model, "skyformer:softmax").train()
    for _, _, module in shf.attention_modules(trained):
        module.attention_dropout = 0.5
    with torch.enable_grad():
        out = trained(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_vit_encoder():
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = ViTModel(config).eval()
    pixels = torch.randn(2, 3, 16, 16)
    exact = model(pixel_values=pixels).last_hidden_state
    ours = copy_as(model, "skyformer:softmax")
    torch.testing.assert_close(ours(pixel_values=pixels).last_hidden_state, exact,
                               rtol=0, atol=ATOL)
    shf.set_attention(ours, "skyformer", layers=[0], num_features=8, seed=0)
    assert [r["layer"] for r in shf.describe(ours)] == [0, 1]  # ViT has no layer_idx
    assert [r["method"] for r in shf.describe(ours)] == ["skyformer", "softmax"]


class _Module(nn.Module):
    """Stands in for a transformers attention module in direct calls."""

    is_causal = False


def test_dropout_in_training():
    q, k, v = make_qkv(2, 2, 12, 8, dtype=torch.float32)
    module = _Module().train()

    def call(method, dropout, seed=0):
        torch.manual_seed(seed)
        out, weights = skyformer_attention_forward(
            f"skyformer:{method}", method, module, q, k, v, None, dropout=dropout)
        assert weights is None
        return out

    # Other methods: inverted dropout on the attention output.
    plain = call("kernelized", 0.0)
    dropped = call("kernelized", 0.5)
    kept = dropped != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(dropped[kept], 2 * plain[kept])
    # Exact softmax: dropout on the probabilities, as transformers' SDPA path does it.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(3)
    reference, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.5)
    torch.testing.assert_close(call("softmax", 0.5, seed=3), reference)
    assert not torch.allclose(call("softmax", 0.5, seed=3), call("softmax", 0.0))
    module.eval()  # transformers passes dropout=0 in eval; an explicit one is ignored too
    torch.testing.assert_close(call("kernelized", 0.5), plain)


def test_a_module_inside_a_model_is_refused_with_the_call_that_works():
    """BERT's encoder holds the config but cannot switch it: an AttributeError, after a
    key was left on the module."""
    model = tiny_bert()
    with pytest.raises(TypeError, match=r"BertEncoder holds a transformers config.*pass the "
                                        r"whole model, with layers=\[\.\.\.\]"):
        shf.set_attention(model.encoder, "performer")
    assert not [key for key in vars(model.encoder) if key.startswith("_skyformer")]
    assert {row["method"] for row in shf.describe(model)} == {"exact (sdpa)"}
    shf.set_attention(model, "performer", layers=[0], num_features=8)
    with pytest.raises(TypeError, match="BertEncoder holds a transformers config"):
        shf.restore_exact(model.encoder)  # it cleared every layer before failing
    assert [row["method"] for row in shf.describe(model)] == ["performer", "exact"]


def test_refused_keyword_arguments():
    """A sliding window is in the mask transformers builds (as for SDPA): the methods that
    take any mask honour it, the others refuse it; soft-capping no method applies."""
    q, k, v = make_qkv(1, 2, 6, 8, dtype=torch.float32)
    window = torch.ones(6, 6, dtype=torch.bool).tril().triu(-3)[None, None]
    out, _ = skyformer_attention_forward("skyformer:softmax", "softmax", _Module(), q, k, v,
                                         window, sliding_window=4)
    torch.testing.assert_close(out.transpose(1, 2),
                               torch.nn.functional.scaled_dot_product_attention(
                                   q, k, v, attn_mask=window))
    with pytest.raises(CapabilityError, match=r"sliding-window pattern \(sliding_window=...\)"):
        skyformer_attention_forward("skyformer:skyformer", "skyformer", _Module(), q, k, v,
                                    None, sliding_window=4)
    with pytest.raises(CapabilityError, match=r"logit soft-capping \(softcap=...\)"):
        skyformer_attention_forward("skyformer:softmax", "softmax", _Module(), q, k, v, None,
                                    softcap=30.0)


@pytest.mark.parametrize("name, value, what", [
    ("s_aux", torch.zeros(2), "attention sinks"),  # gpt-oss, MiMo's sliding layers
    ("indices", torch.zeros(1, 6, 2, dtype=torch.int32), "a sparse key selection"),  # DSA
])
def test_what_sdpa_cannot_apply_is_refused_in_exact_layers_too(name, value, what):
    """The exact layers of skyformer's implementations run transformers' SDPA attention,
    which drops attention sinks and sparse key selections without a word (gpt-oss gave
    other hidden states than its own eager attention): refused in a sentence that names
    the model's own attention, which the approximate methods' sentence names too."""
    q, k, v = make_qkv(1, 2, 6, 8, dtype=torch.float32)
    own = r"attn_implementation='eager'"
    for implementation, method in (("skyformer", "exact"), ("skyformer:linear", "linear")):
        with pytest.raises(CapabilityError, match=rf"{what} \({name}=...\).*{own}"):
            skyformer_attention_forward(implementation, method, _Module(), q, k, v, None,
                                        **{name: value})


@torch.no_grad()
def test_output_attentions_gives_each_layers_weights():
    """output_attentions=True gave an empty tuple of attention maps: each layer now gives
    the matrix its method applies (skyformer.attention_weights), softmax's equal to the
    eager model's, a layer left exact included (transformers' SDPA gives none, which
    shifted the others' in the tuple); a method without one says that it gives none."""
    import warnings

    ids, mask = ids_and_padding()
    eager = copy_as(tiny_bert(), "eager")
    expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model = tiny_bert()
    shf.set_attention(model, "softmax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == 2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # a layer left exact gives its maps too: attentions[i] stays layer i's
    shf.set_attention(model, "exact")
    shf.set_attention(model, "nystrom_softmax", layers=[1], num_features=4, seed=0)
    mixed = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(mixed) == 2 and mixed[1].shape == (3, 4, 10, 10)
    torch.testing.assert_close(mixed[0], expected[0], atol=ATOL, rtol=0)
    shf.set_attention(model, "nystrom_softmax", num_features=4, seed=0)
    first = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    again = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert [a.shape for a in first] == [(3, 4, 10, 10)] * 2
    for maps, same in zip(first, again, strict=True):
        torch.testing.assert_close(maps, same, rtol=0, atol=0)  # the layer's seed
        assert torch.all(maps[0, :, :, 7:] == 0) and torch.all(maps[1, :, :, :3] == 0)
        torch.testing.assert_close(maps[0, :, :7].sum(-1), torch.ones(4, 7))
    shf.set_attention(model, "kdeformer", num_features=4, seed=0)
    with pytest.warns(UserWarning, match=r"kdeformer returns no attention weights \(its "
                      r"output is not one matrix.*methods that give them: softmax, "
                      r"kernelized, skyformer.*attn_implementation='eager'"):
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert out.attentions == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not asked: no map, no word
        model(input_ids=ids, attention_mask=mask)
    shf.set_attention(model, "exact")
    shf.set_attention(model, "kdeformer", layers=[0], num_features=4, seed=0)
    with pytest.warns(UserWarning, match="kdeformer returns no attention weights"):
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 1  # layer 1's, exact: the missing map is named above
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids, attention_mask=mask)


@torch.no_grad()
def test_output_attentions_kept_by_the_attention_module_itself():
    """Falcon's attention takes output_attentions as its own argument and hands the
    attention function neither it nor a recorder: its maps came back None, without a
    word. The flag of each call is recorded for the function (hf/maps_flag.py)."""
    from transformers import FalconConfig, FalconModel

    config = FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=64, new_decoder_architecture=True, num_kv_heads=2)
    torch.manual_seed(0)
    model = FalconModel(config).eval()
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = copy_as(model, "eager")(ids, output_attentions=True).attentions
    shf.set_attention(model, "softmax")
    got = model(ids, output_attentions=True).attentions
    assert len(got) == 2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    from skyformer.hf.maps_flag import FLAG_NAME

    assert not [m for m in model.modules() if FLAG_NAME in m.__dict__]  # taken off again
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # the flag, traced
    assert compiled(ids).attentions is None
    assert [a.shape for a in compiled(ids, output_attentions=True).attentions] == \
        [(2, 4, 12, 12)] * 2


def test_a_model_with_attention_of_its_own_is_refused_naming_the_models_that_run():
    """DeBERTa computes attention in its own code: the refusal named the mechanism
    but no model a user could turn to."""
    from transformers import DebertaV2Config, DebertaV2Model

    model = DebertaV2Model(DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match=r"DebertaV2Model has no attention module .*"
                       r"BERT, RoBERTa.*Llama.*docs/hf.md"):
        shf.set_attention(model, "nystrom_softmax")


@dataclasses.dataclass(frozen=True)
class _ToyConfig:
    scale: float | None = None


class _ToyState(nn.Module):
    def __init__(self, config, num_heads, head_dim):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))

    def forward(self, q, k):
        return {"temperature": self.temperature}


@pytest.fixture
def learned_method():
    """A method with a learned per-head temperature, registered for one test only."""
    from skyformer.ops import softmax_attention

    def toy(q, k, v, *, key_padding_mask=None, generator=None, scale=None, temperature=None):
        t = temperature if temperature is not None else torch.ones(())
        return softmax_attention(q * t, k, v, key_padding_mask=key_padding_mask, scale=scale)

    registry.register("toy_learned", _ToyConfig, registry.Capabilities(target="softmax"),
                      state=_ToyState)(toy)
    yield "toy_learned"
    del registry._REGISTRY["toy_learned"]


def test_per_layer_state_is_a_trained_submodule(learned_method):
    model = tiny_bert()
    shf.set_attention(model, learned_method, layers=[0])
    state = model.encoder.layer[0].attention.self.skyformer_state
    assert any(p is state.temperature for p in model.parameters())
    ids, mask = ids_and_padding()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert state.temperature.grad is not None and state.temperature.grad.abs().sum() > 0
    shf.set_attention(model, "kernelized", layers=[1])  # layer 0 keeps its trained state
    assert model.encoder.layer[0].attention.self.skyformer_state is state
    shf.restore_exact(model)
    assert not hasattr(model.encoder.layer[0].attention.self, "skyformer_state")


def _as_trained(model, factor: float) -> None:
    """Scale the per-layer parameters (Linformer's projections), as training would move
    them away from what a fresh layer draws."""
    for name, parameter in model.named_parameters():
        if "skyformer_state" in name:
            parameter.mul_(factor)


@torch.no_grad()
def test_saved_per_layer_parameters_come_back_with_from_pretrained(tmp_path):
    """Trained Linformer projections are saved by save_pretrained; loading with the
    method and options they were saved with restores them (transformers alone leaves
    them out), also into a model with a head; other options are refused."""
    from transformers import BertForSequenceClassification

    model = tiny_bert()
    shf.set_attention(model, "linformer", num_features=8, seed=0)
    _as_trained(model, 3.0)
    ids, mask = ids_and_padding()
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = shf.from_pretrained(tmp_path, "linformer", num_features=8, seed=0).eval()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).last_hidden_state,
                               want, rtol=0, atol=0)
    headed = shf.from_pretrained(tmp_path, "linformer", num_features=8, seed=0,
                                 auto_class=BertForSequenceClassification)
    for key, value in loaded.state_dict().items():
        if "skyformer_state" in key:
            assert torch.equal(headed.state_dict()[f"bert.{key}"], value)
    with pytest.raises(ValueError, match="load it with the options it was saved with"):
        shf.from_pretrained(tmp_path, "linformer", num_features=4, seed=0)


@torch.no_grad()
def test_saved_per_layer_parameters_are_read_from_the_files_the_loader_reads(tmp_path):
    """The loader's ``subfolder``, ``variant`` and ``use_safetensors`` choose the weights
    files transformers loads; the per-layer parameters come from those same files, not
    from the folder's top level (another model's, or none) nor from another variant."""
    model = tiny_bert()
    shf.set_attention(model, "linformer", num_features=8, seed=0)
    state = model.encoder.layer[0].attention.self.skyformer_state
    tiny_bert().save_pretrained(tmp_path)  # another model at the top level
    for factor, kwargs in ((3.0, {"subfolder": "encoder"}), (5.0, {"variant": "tuned"}),
                           (7.0, {"use_safetensors": False})):
        _as_trained(model, factor)
        want = state.proj_k.clone()
        if "use_safetensors" in kwargs:  # a .bin next to the top level's safetensors
            torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        else:
            model.save_pretrained(tmp_path / kwargs.get("subfolder", ""),
                                  variant=kwargs.get("variant"))
        loaded = shf.from_pretrained(tmp_path, "linformer", num_features=8, seed=0,
                                     model_kwargs=kwargs)
        got = loaded.encoder.layer[0].attention.self.skyformer_state.proj_k
        assert torch.equal(got, want), kwargs


@torch.no_grad()
def test_load_state_fills_the_layers_of_the_attn_implementation_route(tmp_path):
    """A model loaded with attn_implementation="skyformer:linformer" runs Linformer in
    every layer (describe says so) but makes the per-layer parameters at its first
    forward pass: load_state makes them as that pass would and loads the saved ones."""
    from transformers import AutoModel

    model = tiny_bert()
    shf.set_attention(model, "linformer")
    _as_trained(model, 3.0)
    ids, mask = ids_and_padding()
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    plain = AutoModel.from_pretrained(tmp_path, attn_implementation="skyformer:linformer")
    assert shf.load_state(plain, tmp_path) == 4
    got = plain.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@torch.no_grad()
def test_load_state_takes_the_loader_keywords_of_a_variant(tmp_path):
    """save_pretrained(variant="v1") writes model.v1.safetensors: load_state took no
    variant and refused the folder it was given ("is not a folder holding ..."); it
    takes from_pretrained's keywords, and without them names the variant it found."""
    from transformers import AutoModel

    model = tiny_bert()
    shf.set_attention(model, "linformer")
    _as_trained(model, 3.0)
    model.save_pretrained(tmp_path, variant="v1")
    plain = AutoModel.from_pretrained(tmp_path, variant="v1",
                                      attn_implementation="skyformer:linformer")
    with pytest.raises(ValueError, match=r"holds model\.v1\.safetensors: pass "
                                         r"variant='v1'\)\.$"):
        shf.load_state(plain, tmp_path)
    assert shf.load_state(plain, tmp_path, variant="v1") == 4
    sharded = tmp_path / "sharded"  # model.v2-00001-of-0000n.safetensors and its index
    model.save_pretrained(sharded, variant="v2", max_shard_size="20KB")
    assert len(list(sharded.glob("model.v2-*-of-*.safetensors"))) > 1
    with pytest.raises(ValueError, match=r"pass variant='v2'\)\.$"):
        shf.load_state(plain, sharded)
    assert shf.load_state(plain, sharded, variant="v2") == 4


@torch.no_grad()
def test_load_state_refused_for_one_layer_changes_no_layer(tmp_path):
    """Saved state that fits layer 0 but not layer 1 (other num_features) is refused
    with a sentence naming layer 1's tensor, and layer 0 keeps what it held."""
    model = tiny_bert()
    shf.set_attention(model, "linformer", layers=[0], num_features=8, seed=0)
    shf.set_attention(model, "performer", layers=[1], num_features=8, seed=1)
    _as_trained(model, 3.0)
    model.save_pretrained(tmp_path)
    loaded = shf.from_pretrained(tmp_path, "exact")
    shf.set_attention(loaded, "linformer", layers=[0], num_features=8, seed=0)
    shf.set_attention(loaded, "performer", layers=[1], num_features=16, seed=1)
    before = {k: v.clone() for k, v in loaded.state_dict().items() if "skyformer_state" in k}
    with pytest.raises(ValueError, match=r"layer\.1\.attention\.self\.skyformer_state\."
                                         r"projection.*load it with the options"):
        shf.load_state(loaded, tmp_path)
    for key, value in before.items():
        assert torch.equal(loaded.state_dict()[key], value), key


@torch.no_grad()
def test_per_layer_parameters_never_saved_start_fresh_and_unreadable_folders_are_refused(
        tmp_path):
    """A model saved without per-layer parameters (an original checkpoint) loads with the
    method's initialisation; a local folder without weights this can read is refused when
    the method has such parameters (whether they were saved cannot be told), not when not;
    a Hub name loads with a warning."""
    from skyformer.hf.loading import load_saved_state

    tiny_bert().save_pretrained(tmp_path / "plain")
    fresh = tiny_bert()
    shf.set_attention(fresh, "linformer", num_features=8, seed=0)
    loaded = shf.from_pretrained(tmp_path / "plain", "linformer", num_features=8, seed=0)
    for key, value in fresh.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert load_saved_state(loaded, tmp_path / "plain", "linformer") == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot be read back"):
        load_saved_state(loaded, tmp_path / "empty", "linformer")
    with pytest.warns(UserWarning, match="not a local folder"):  # a Hub name
        assert load_saved_state(loaded, "some-user/some-model", "linformer") == 0
    exact = tiny_bert()
    shf.set_attention(exact, "nystrom_softmax", num_features=8)
    assert load_saved_state(exact, tmp_path / "empty", "nystrom_softmax") == 0


def _import_skyformer_hf_after(prelude: str) -> str:
    """stdout of a fresh interpreter that runs ``prelude``, then imports skyformer.hf and
    prints the ImportError it raises (if any)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = prelude + "try:\n    import skyformer.hf\nexcept ImportError as err:\n    print(err)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_skyformer_never_needs_transformers():
    out = _import_skyformer_hf_after(
        "import sys; sys.modules['transformers'] = None\n"
        "import torch, skyformer, skyformer.cli\n"
        "q = torch.randn(1, 1, 4, 2)\n"
        "assert skyformer.attention(q, q, q, 'softmax').shape == (1, 1, 4, 2)\n"
    )
    assert "skyformer.hf needs transformers: pip install 'skyformer[hf]'" in out


def test_a_transformers_that_fails_to_import_is_not_called_missing():
    """A module of the caller's named like one of transformers' dependencies (or a
    broken dependency) made skyformer.hf advise installing transformers, hiding why."""
    out = _import_skyformer_hf_after("import sys; sys.modules['huggingface_hub'] = None\n")
    assert "skyformer.hf: importing transformers failed (" in out and "huggingface_hub" in out
    assert "pip install" not in out


def test_restore_returns_to_the_implementation_the_model_had():
    model = tiny_bert()
    model.set_attn_implementation("eager")
    shf.restore_exact(model)  # nothing to restore: stays eager
    assert model.config._attn_implementation == "eager"
    shf.set_attention(model, "softmax", layers=[0])
    shf.set_attention(model, "kernelized", layers=[1])
    assert model.config._attn_implementation == "skyformer"
    shf.restore_exact(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    "method", [m for m in registry.list_methods() if registry.get_method(m).state is not None])
def test_seed_fixes_the_per_layer_state(method):
    a, b, c = tiny_bert(), tiny_bert(), tiny_bert()
    has_features = "num_features" in registry.get_method(method).option_names()
    options = {"num_features": 8} if has_features else {}
    shf.set_attention(a, method, seed=3, **options)
    shf.set_attention(b, method, seed=3, **options)
    shf.set_attention(c, method, seed=4, **options)
    sa, sb, sc = (m.encoder.layer[1].attention.self.skyformer_state.state_dict()
                  for m in (a, b, c))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ids, mask = ids_and_padding()
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   b(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   rtol=0, atol=0)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa) or not sa, "the seed must matter"


def test_a_seeded_layer_makes_its_key_once(monkeypatch):
    """The key of a seeded layer is made in its first forward and reused: made from the
    seed on the host, it would be copied to a GPU in every forward of every layer (a
    copy that waits for the queue)."""
    from skyformer.hf import attention as hf_attention

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=8, seed=11)
    ids, mask = ids_and_padding()
    made = []
    monkeypatch.setattr(hf_attention, "random_key",
                        lambda seed, device: made.append(seed) or random_key(seed, device))
    hf_attention._seed_key.cache_clear()
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).last_hidden_state
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert made == [11, 12]  # one per layer, in the first forward only
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert all(torch.equal(hf_attention._seed_key(seed, torch.device("cpu")),
                           random_key(seed)) for seed in made)  # not written into


def test_an_export_of_a_seeded_model_leaves_its_eager_keys_alone():
    """torch.export runs the model's Python on fake tensors: a key made there and kept
    gave later eager calls a fake key (outputs 3.4 off, or NaN)."""
    from skyformer.hf import attention as hf_attention

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=8, seed=3)
    ids, _ = ids_and_padding()
    hf_attention._seed_key.cache_clear()
    with torch.no_grad():
        torch.export.export(model, (), {"input_ids": ids}, strict=False)
        after = model(input_ids=ids).last_hidden_state
        hf_attention._seed_key.cache_clear()
        fresh = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


def test_a_seed_offsets_each_attention_module_by_its_position():
    """seed s: the i-th attention module draws as seed s + i. In an encoder-decoder, the
    encoder's layer 0, the decoder's self-attention 0 and its cross-attention 0 share
    ``layer_idx`` 0 but are three modules, which must not draw alike."""
    import copy

    from transformers import BartConfig, BartModel

    a, b = tiny_bert(), tiny_bert()
    shf.set_attention(a, "performer", seed=3, num_features=8)
    shf.set_attention(b, "performer", seed=4, num_features=8)
    layer_1 = a.encoder.layer[1].attention.self.skyformer_state.state_dict()
    layer_0 = b.encoder.layer[0].attention.self.skyformer_state.state_dict()
    assert layer_1.keys() == layer_0.keys() and layer_1
    assert all(torch.equal(layer_1[k], layer_0[k]) for k in layer_1)

    config = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2)
    config._attn_implementation = "sdpa"
    bart = BartModel(copy.deepcopy(config)).eval()
    shf.set_attention(bart, "performer", seed=3, num_features=8)
    modules = (bart.encoder.layers[0].self_attn, bart.decoder.layers[0].self_attn,
               bart.decoder.layers[0].encoder_attn)
    assert [m.layer_idx for m in modules] == [0, 0, 0]
    states = [m.skyformer_state.state_dict() for m in modules]
    for i, first in enumerate(states):
        for second in states[i + 1:]:
            assert not all(torch.equal(first[k], second[k]) for k in first)


def test_an_old_transformers_gets_a_version_sentence():
    out = _import_skyformer_hf_after("import transformers; transformers.__version__ = '4.57.1'\n")
    assert "needs transformers >= 5.4, found 4.57.1" in out


@torch.no_grad()
def test_bart_cross_attention_loaded_by_name_keeps_every_decoder_query():
    """BART names its cross-attention encoder_attn (no flag, no class of its own): loaded
    with attn_implementation="skyformer:<method>", where the module's name is not known,
    it must still not read the encoder's padding as decoder padding (Nq == Nk)."""
    import copy

    from transformers import BartConfig, BartModel

    config = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = BartModel(copy.deepcopy(config)).double().eval()
    ids, mask = ids_and_padding(b=2, n=12)
    decoder_ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    outputs = []
    for route in ("name", "set_attention"):
        model = copy.deepcopy(base)
        if route == "name":
            model.config = copy.deepcopy(config)
            model.set_attn_implementation("skyformer:linear")
        else:
            shf.set_attention(model, "linear")
        outputs.append(model(input_ids=ids, attention_mask=mask,
                             decoder_input_ids=decoder_ids).last_hidden_state)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-12)


@torch.no_grad()
def test_t5_position_bias_with_padding_in_float64():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100,
                      relative_attention_num_buckets=8, dropout_rate=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T5EncoderModel(config).double().eval()
    ids, mask = ids_and_padding()
    exact = model(input_ids=ids, attention_mask=mask).last_hidden_state
    shf.set_attention(model, "softmax")
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-12)


def test_compile_fullgraph_with_a_padding_mask():
    """The mask builder takes no data-dependent shortcut while traced."""
    model = copy_as(tiny_bert(), "skyformer:softmax")
    ids, mask = ids_and_padding()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   model(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_registering_again_leaves_the_registry_as_it_was():
    """set_attention registers the methods each time; the functions stay the same
    objects (a compiled model guards on what it found in the registry)."""
    from transformers import AttentionInterface

    from skyformer.hf.attention import register_methods

    names = register_methods()
    before = {name: AttentionInterface()[name] for name in names}
    register_methods()
    assert all(AttentionInterface()[name] is fn for name, fn in before.items())


def test_a_method_registered_after_the_import_has_its_name_at_once(monkeypatch):
    """A plugin imported after skyformer.hf: transformers knows its
    attn_implementation name as soon as it is registered, before any set_attention."""
    import dataclasses

    from skyformer import registry
    from skyformer.registry import methods as registry_methods

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        scale: float | None = None

    monkeypatch.delitem(registry_methods._REGISTRY, "late_softmax", raising=False)

    @registry.register("late_softmax", Cfg, registry.Capabilities(target="softmax"))
    def late_softmax(q, k, v, config, *, key_padding_mask=None, generator=None):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setitem(registry_methods._REGISTRY, "late_softmax",
                        registry_methods._REGISTRY["late_softmax"])
    model = tiny_bert()
    model.set_attn_implementation("skyformer:late_softmax")
    ids = torch.randint(1, 64, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state,
                                   tiny_bert()(input_ids=ids).last_hidden_state)


def test_a_model_that_refuses_the_switch_is_left_as_it_was(monkeypatch):
    """A model that does not take a new attn_implementation is refused before any
    layer changes: no setting, and no method state among its parameters (a state_dict
    saved after the error holds the model's keys only)."""
    model = tiny_bert()
    keys, rows = set(model.state_dict()), shf.describe(model)
    monkeypatch.setattr(model, "set_attn_implementation", lambda implementation: None)
    with pytest.raises(ValueError, match="did not accept"):
        shf.set_attention(model, "performer", num_features=8, seed=0)
    assert set(model.state_dict()) == keys
    assert shf.describe(model) == rows


def test_padding_masks_have_transformers_shape_so_a_model_can_join_them():
    """skyformer_mask gave padding masks as [B, 1, 1, Nk]; T5Gemma2's decoder concatenates
    its self- and cross-attention masks along the keys and failed ("Expected size 6 but
    got size 1"), for skyformer:softmax too. They are [B, 1, Nq, Nk] now, stride 0 over
    the queries (no more memory)."""
    from skyformer.hf.attention import skyformer_mask

    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, 7:] = 0
    mask = skyformer_mask(2, 6, 10, attention_mask=padding)
    assert mask.shape == (2, 1, 6, 10) and mask.stride(2) == 0
    assert mask[1, 0, 3].tolist() == [True] * 7 + [False] * 3
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "T5Gemma2Model"):
        pytest.skip("T5Gemma2 needs a newer transformers")
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "vocab_size": 300, "max_position_embeddings": 64, "sliding_window": 4}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 16, "patch_size": 8}
    config = transformers.T5Gemma2Config(
        encoder={"text_config": text, "vision_config": vision, "mm_tokens_per_image": 4,
                 "boi_token_index": 290, "eoi_token_index": 291, "image_token_index": 292},
        decoder={**text, "layer_types": ["full_attention", "full_attention"]},
        image_token_index=292)
    torch.manual_seed(0)
    model = transformers.T5Gemma2Model(config).eval().double()
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(3, 280, (2, 10), generator=g)
    decoder_ids = torch.randint(3, 280, (2, 6), generator=g)
    outputs = {}
    for implementation in ("sdpa", "skyformer:softmax"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model(input_ids=ids, attention_mask=padding,
                                        decoder_input_ids=decoder_ids).last_hidden_state
    torch.testing.assert_close(outputs["skyformer:softmax"], outputs["sdpa"], rtol=0,
                               atol=1e-12)


def test_the_plain_route_warns_when_a_training_forward_creates_parameters(tmp_path):
    """attn_implementation="skyformer:linformer" makes each layer's projections in its
    first forward pass, after an optimizer built at load time: in training that is said
    (they were silently left out of the optimizer), in eval it is not."""
    import warnings

    from transformers import AutoModel

    tiny_bert().save_pretrained(tmp_path)
    ids = torch.ones(1, 8, dtype=torch.long)
    plain = AutoModel.from_pretrained(tmp_path, attn_implementation="skyformer:linformer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.eval()(input_ids=ids)  # eval: nothing to train, nothing said
    plain = AutoModel.from_pretrained(tmp_path, attn_implementation="skyformer:linformer")
    before = sum(p.numel() for p in plain.parameters())
    with pytest.warns(UserWarning, match=r"skyformer\.hf\.set_attention"):
        plain.train()(input_ids=ids)
    assert sum(p.numel() for p in plain.parameters()) > before


def test_from_pretrained_takes_a_variant_name(tmp_path):
    tiny_bert().save_pretrained(tmp_path)
    loaded = shf.from_pretrained(tmp_path, "nystrom_softmax[num_features=8]", seed=0)
    assert {r["method"] for r in shf.describe(loaded)} == {"nystrom_softmax[num_features=8]"}
    ids = torch.ones(1, 12, dtype=torch.long)
    same = shf.set_attention(tiny_bert(), "nystrom_softmax[num_features=8]", seed=0)
    torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state,
                               same(input_ids=ids).last_hidden_state)


@pytest.mark.filterwarnings("ignore:.*makes its trainable parameters")  # linformer: said
@pytest.mark.parametrize("method", ["performer", "linformer"])
def test_state_made_by_a_first_forward_under_inference_mode_trains_later(method):
    """A layer's state made in a first forward under torch.inference_mode() (an
    evaluation before training) is made of ordinary tensors: Performer's features can
    be redrawn in training, Linformer's projections get gradients."""
    model = tiny_bert()
    model.set_attn_implementation(f"skyformer:{method}")
    ids, mask = ids_and_padding()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
    state = model.encoder.layer[0].attention.self.skyformer_state
    assert not any(t.is_inference() for t in [*state.parameters(), *state.buffers()])
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    for parameter in state.parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_exact_with_options_or_a_bad_seed_is_refused_on_every_route(tmp_path):
    """Exact attention takes no options, and a seed only in [0, 2^64): set_attention
    over every layer and from_pretrained refuse the others as a per-layer choice does."""
    tiny_bert().save_pretrained(tmp_path)
    model = shf.set_attention(tiny_bert(), "kernelized")
    for layers in (None, [0]):
        with pytest.raises(ValueError, match="exact attention takes no options, got "
                                             "num_features"):
            shf.set_attention(model, "exact", layers=layers, num_features=8)
        with pytest.raises(ValueError, match="seed must be an integer"):
            shf.set_attention(model, "exact", layers=layers, seed="0")
        with pytest.raises(ValueError, match="exact attention takes no options"):
            shf.from_pretrained(tmp_path, "exact", layers=layers, num_features=8)
        with pytest.raises(ValueError, match="seed must be an integer"):
            shf.from_pretrained(tmp_path, "exact", layers=layers, seed=-1)
    assert {r["method"] for r in shf.describe(model)} == {"kernelized"}, "nothing changed"
    with pytest.raises(ValueError, match=r"layers must be layer numbers of this model"):
        shf.from_pretrained(tmp_path, "exact", layers=[5])
    loaded = shf.from_pretrained(tmp_path, "exact", seed=0)
    assert loaded.config._attn_implementation == "sdpa"


def test_layers_take_integers_of_any_kind_and_refuse_an_empty_choice():
    """NumPy and tensor layer numbers were refused as not layer numbers (np.int64(0)),
    a NumPy scalar raised a bare 'not iterable', and layers=[] switched the model to
    per-layer settings while changing no layer, with nothing said."""
    import numpy as np

    for layers, methods in ((np.arange(2), ["performer"] * 2),
                            (torch.tensor([1]), ["exact", "performer"]),
                            (np.int64(0), ["performer", "exact"]),
                            (torch.tensor(1), ["exact", "performer"])):
        model = shf.set_attention(tiny_bert(), "performer", layers=layers, num_features=4)
        assert [row["method"] for row in shf.describe(model)] == methods, layers
    model = tiny_bert()
    with pytest.raises(ValueError, match=r"layers is empty, so no layer would change; pass "
                                         r"layer numbers of this model \(0..1\), or None"):
        shf.set_attention(model, "performer", layers=[])
    with pytest.raises(TypeError, match=r"layers must be None \(every layer\), a layer "
                                        r"number or a list of .*got str"):
        shf.set_attention(model, "performer", layers="0")
    with pytest.raises(ValueError, match=r"got True"):
        shf.set_attention(model, "performer", layers=[True])
    assert model.config._attn_implementation == "sdpa", "nothing changed"


def test_linformer_without_a_position_limit_says_how_to_give_max_seq_len():
    """A model without max_position_embeddings (ViT) gives Linformer no length: the
    sentence names the option on this route too (not a MultiHeadAttention call)."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = ViTModel(config).eval()
    with pytest.raises(ValueError, match=r"max_seq_len.*set_attention\(model, 'linformer', "
                                         r"max_seq_len="):
        shf.set_attention(model, "linformer", num_features=8)
    shf.set_attention(model, "linformer", num_features=8, max_seq_len=17)
    model(pixel_values=torch.randn(1, 3, 16, 16))  # 16 patches and the class token


def test_from_pretrained_passes_model_kwargs_to_transformers(tmp_path):
    """model_kwargs reach the transformers loader (dtype, device_map, ...); the per-layer
    state follows the loaded model's dtype; attn_implementation is this function's."""
    tiny_bert().save_pretrained(tmp_path)
    loaded = shf.from_pretrained(tmp_path, "linformer", num_features=8, seed=0,
                                 model_kwargs={"dtype": torch.float64})
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert loaded(input_ids=torch.ones(1, 8, dtype=torch.long)).last_hidden_state.dtype \
        == torch.float64
    with pytest.raises(ValueError, match="attn_implementation is chosen by the method"):
        shf.from_pretrained(tmp_path, "linformer", model_kwargs={"attn_implementation": "eager"})
    with pytest.raises(TypeError, match="model_kwargs must be a dict"):
        shf.from_pretrained(tmp_path, "linformer", model_kwargs=[("dtype", torch.float64)])


def test_from_pretrained_names_model_kwargs_for_the_loaders_keywords(tmp_path, monkeypatch):
    """dtype=... given as transformers' from_pretrained takes it is no method option: the
    sentence names model_kwargs, and comes before the model is loaded."""
    from transformers import AutoModel

    tiny_bert().save_pretrained(tmp_path)
    monkeypatch.setattr(AutoModel, "from_pretrained", None)  # a load would fail otherwise
    for method in ("performer", "exact"):
        with pytest.raises(ValueError, match=r"model_kwargs=\{'dtype': \.\.\.\}"):
            shf.from_pretrained(tmp_path, method, dtype=torch.float64)
    # a misspelt option of the method is named as set_attention names it
    with pytest.raises(ValueError, match=r"^performer has no option 'num_feature' \(did you "
                                         r"mean 'num_features'\?\); its options are"):
        shf.from_pretrained(tmp_path, "performer", num_feature=3)
    # arguments of the entry points themselves: model_kwargs was the wrong advice
    for method in ("performer", "exact"):
        with pytest.raises(ValueError, match=r"no argument 'layer' \(did you mean 'layers'"):
            shf.from_pretrained(tmp_path, method, layer=[0])
        with pytest.raises(ValueError, match=r"pass the method instead \(method='exact'"):
            shf.from_pretrained(tmp_path, method, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"^skyformer.hf.set_attention has no argument "
                                         r"'seeds' \(did you mean 'seed'\?\)"):
        shf.set_attention(tiny_bert(), "performer", seeds=0)
    with pytest.raises(ValueError, match=r"no argument 'layer' \(did you mean 'layers'"):
        shf.set_attention(tiny_bert(), "exact", layer=[0])
    with pytest.raises(ValueError, match=r"no argument 'methd' \(did you mean 'method'"):
        shf.from_pretrained(tmp_path, "performer", methd="linear")


@pytest.mark.filterwarnings("ignore:.*makes its trainable parameters")
def test_describe_gives_the_options_a_layer_will_run_before_its_first_forward():
    """On the attn_implementation route a layer is set up at its first forward pass;
    describe gives the same options (a dict) before it, as after."""
    model = tiny_bert()
    model.set_attn_implementation("skyformer:linformer")
    before = shf.describe(model)
    assert before[0]["options"]["max_seq_len"] == 64  # max_position_embeddings
    assert before[0]["options"]["num_features"] == 128
    model(input_ids=torch.ones(1, 8, dtype=torch.long))
    assert shf.describe(model) == before


def test_transformers_own_switch_keeps_the_settings_for_the_way_back():
    """set_attn_implementation("sdpa") runs SDPA in every layer but leaves each layer's
    setting and per-layer state (among the parameters) in place: switching back resumes
    them; restore_exact removes them (docs/hf.md)."""
    model = shf.set_attention(tiny_bert(), "linformer", num_features=8, seed=0)
    state = model.encoder.layer[0].attention.self.skyformer_state
    ids = torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
        model.set_attn_implementation("sdpa")
        assert {r["method"] for r in shf.describe(model)} == {"exact (sdpa)"}
        assert any(p is state.proj_k for p in model.parameters())
        model.set_attn_implementation("skyformer:linformer")
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state, want,
                                   rtol=0, atol=0)
    assert model.encoder.layer[0].attention.self.skyformer_state is state
    shf.restore_exact(model)
    assert not any("skyformer_state" in name for name, _ in model.named_parameters())


@torch.no_grad()
def test_set_attention_on_one_part_of_an_encoder_decoder_leaves_the_other_part():
    """BART's encoder and decoder read one config: set_attention(model.get_encoder(), m)
    runs m in the encoder only, as listing every encoder layer does; the decoder keeps
    SDPA (it ran m with default options, unseeded). restore_exact of the encoder leaves
    a decoder set through a call of its own as it was."""
    import copy

    from transformers import BartConfig, BartModel

    config = BartConfig(d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    base = BartModel(config).eval()
    base.set_attn_implementation("sdpa")
    ids, mask = ids_and_padding(b=2, n=12)
    batch = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6]}
    listed = shf.set_attention(copy.deepcopy(base).get_encoder(), "performer",
                               layers=[0, 1], num_features=8, seed=0)
    whole = copy.deepcopy(base)
    shf.set_attention(whole.get_encoder(), "performer", num_features=8, seed=0)
    assert [r["method"] for r in shf.describe(whole)] == ["performer"] * 2 + ["exact"] * 4
    want = copy.deepcopy(base)
    want.encoder = listed
    with warnings.catch_warnings():  # the decoder's layers run exact attention by choice:
        warnings.simplefilter("error")  # no "this BartAttention has no setting"
        got = whole(**batch).last_hidden_state
    torch.testing.assert_close(got, want(**batch).last_hidden_state, rtol=0, atol=0)
    # a whole model set in some layers leaves another model of its config warning
    first = tiny_bert()
    second = type(first)(first.config).eval()
    shf.set_attention(first, "performer", layers=[0], num_features=8)
    with pytest.warns(UserWarning, match="BertSdpaAttention has no setting|has no setting"):
        second(ids)
    shf.set_attention(whole.get_decoder(), "linear")
    shf.restore_exact(whole.get_encoder())
    assert [r["method"] for r in shf.describe(whole)] == ["exact"] * 2 + ["linear"] * 4


@torch.no_grad()
@pytest.mark.parametrize("route", ["set_attention", "attn_implementation"])
def test_one_part_set_after_the_whole_model_leaves_the_other_part_running_its_method(route):
    """BART's encoder and decoder read one config: after the whole model ran linear
    (set_attention, or "skyformer:linear" by name), set_attention on the encoder
    switched that config to the per-layer name, and the decoder went back to exact
    attention without a word (its settings, made for the other name, were dropped).
    Now the decoder runs linear as before, and so after restore_exact of the encoder."""
    import copy

    from transformers import BartConfig, BartModel

    config = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    base = BartModel(config).eval()
    base.set_attn_implementation("sdpa")
    ids, mask = ids_and_padding(b=2, n=12)
    batch = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6]}
    want = copy.deepcopy(base)
    shf.set_attention(want, "linear")
    shf.set_attention(want, "performer", layers=[0], num_features=8, seed=0)
    shf.set_attention(want.get_decoder(), "linear")  # what the decoder should run
    model = copy.deepcopy(base)
    if route == "set_attention":
        shf.set_attention(model, "linear")
    else:
        model.set_attn_implementation("skyformer:linear")
        model(**batch)  # its layers are set up at their first forward pass
    shf.set_attention(model.get_encoder(), "performer", num_features=8, seed=0)
    assert [r["method"] for r in shf.describe(model)] == ["performer"] + ["linear"] * 2
    torch.testing.assert_close(model(**batch).last_hidden_state,
                               want(**batch).last_hidden_state, rtol=0, atol=0)
    shf.restore_exact(model.get_encoder())
    assert [r["method"] for r in shf.describe(model)] == ["exact"] + ["linear"] * 2
    shf.set_attention(want.get_encoder(), "exact")
    torch.testing.assert_close(model(**batch).last_hidden_state,
                               want(**batch).last_hidden_state, rtol=0, atol=0)


@torch.no_grad()
def test_one_part_of_a_t5_model_is_described_and_kept_as_it_runs():
    """T5's encoder and decoder hold copies of the config: after set_attention(model.
    get_encoder(), "kernelized") describe(model) said every layer ran SDPA while the
    encoder ran kernelized, and set_attention(model, ..., layers=[1]) reset encoder
    layer 0 to exact without a word. Each layer is now read by the config its module
    dispatches on."""
    import copy

    from transformers import T5Config, T5Model

    config = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=99,
                      relative_attention_num_buckets=8)
    torch.manual_seed(0)
    model = T5Model(config).eval()
    model.set_attn_implementation("sdpa")
    ids, mask = ids_and_padding(b=2, n=12)
    batch = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6]}
    first_only = copy.deepcopy(model)
    shf.set_attention(first_only.get_encoder(), "kernelized", layers=[0])
    want = first_only(**batch).last_hidden_state  # softmax below equals SDPA
    shf.set_attention(model.get_encoder(), "kernelized")
    assert [r["method"] for r in shf.describe(model)] == \
        ["kernelized"] * 2 + ["exact (sdpa)"] * 4
    shf.set_attention(model, "softmax", layers=[1])
    assert [r["method"] for r in shf.describe(model)] == \
        ["kernelized", "softmax", "exact", "exact", "softmax", "softmax"]
    torch.testing.assert_close(model(**batch).last_hidden_state, want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_concurrent_first_forwards_make_each_layer_once(monkeypatch):
    """On the attn_implementation route two threads' first forwards (a thread-pool
    server) make each layer's setting and state once: each made its own Performer
    features before, and the later install replaced the earlier one, so the first
    requests were answered with features no later call used."""
    import threading

    from skyformer.hf import attention

    model = copy_as(tiny_bert(), "skyformer:performer")
    ids, mask = ids_and_padding()
    made, arrived = [], threading.Event()
    real_make = attention.make_layer

    def make_layer(module, *args, **kwargs):  # the first maker waits for the other thread
        made.append(module)
        if len(made) == 1:
            assert arrived.wait(timeout=60), "the other thread never arrived"
        else:
            arrived.set()
        return real_make(module, *args, **kwargs)

    class Signalling:  # says when a thread waits for the lock held by the first maker
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                arrived.set()
                self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    monkeypatch.setattr(attention, "make_layer", make_layer)
    monkeypatch.setattr(attention, "_MAKING", Signalling(threading.Lock()), raising=False)
    start, outs = threading.Barrier(2), [None, None]

    def serve(i):
        start.wait()
        outs[i] = model(input_ids=ids, attention_mask=mask).last_hidden_state

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    modules = [m for _, _, m in shf.layers.attention_modules(model)]
    assert sorted(map(id, made)) == sorted(map(id, modules)), "each layer made once"
    later = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(outs[0], later) and torch.equal(outs[1], later)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def test_packed_sequences_without_a_mask_that_keeps_them_apart_are_refused():
    """A packed row (position_ids restarting at 0, no attention_mask, as
    DataCollatorWithFlattening builds it) gets its block mask from transformers only
    without a cache: with one (use_cache's default) or with cu_seq_lens_q alone, no mask
    keeps the sequences apart, and every method attended across their boundaries."""
    model = _tiny_llama()
    lengths = (5, 7, 4)
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    starts = (0, 5, 12)
    alone = torch.cat([model(input_ids=ids[:, s : s + n]).logits
                       for s, n in zip(starts, lengths, strict=True)], dim=1)
    for method in ("softmax", "kernelized", "skyformer"):
        ours = copy_as(model, f"skyformer:{method}")
        if method != "skyformer":  # the block mask, built without a cache, is honoured
            packed = ours(input_ids=ids, position_ids=positions, use_cache=False).logits
            if method == "softmax":
                torch.testing.assert_close(packed, alone, rtol=0, atol=ATOL)
        with pytest.raises(ValueError, match=r"position_ids restart at 0 .* no attention mask "
                                             r"keeps them apart.*use_cache=False"):
            ours(input_ids=ids, position_ids=positions)
        sentence = (r"packed sequences \(cu_seq_lens_q=...\), which skyformer cannot apply"
                    if method == "skyformer" else r"no attention mask keeps them apart")
        with pytest.raises(ValueError, match=sentence):
            ours(input_ids=ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=7, max_length_k=7)
    one_sequence = copy_as(model, "skyformer:skyformer")(
        input_ids=ids, position_ids=torch.arange(16)[None])  # no restart: one sequence
    assert torch.isfinite(one_sequence.logits).all()


@torch.no_grad()
def test_packed_rows_with_an_all_real_mask_are_told_to_drop_the_mask():
    """An all-real attention_mask with position_ids restarting at 0 is dropped by
    transformers' mask builder, which then builds no block mask either (it reads position
    ids only without a mask): the sentence asks for no attention_mask as well as
    use_cache=False, and that call runs the sequences apart."""
    model = copy_as(_tiny_llama(), "skyformer:softmax")
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    for use_cache in (True, False):
        with pytest.raises(ValueError, match=r"use_cache=False and no attention_mask"):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions,
                  use_cache=use_cache)
    apart = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    alone = model(input_ids=ids[:, 3:], use_cache=False).logits
    torch.testing.assert_close(apart[:, 3:], alone, rtol=0, atol=ATOL)


@pytest.mark.parametrize("given", ["path/to/model", Path("path/to/model")], ids=repr)
def test_a_path_given_for_the_model_points_to_from_pretrained(given):
    """set_attention("path/to/model", ...) said only that a PreTrainedModel was expected;
    a newcomer with a saved folder is pointed to the loader that takes one."""
    with pytest.raises(TypeError, match=r"got (str|PosixPath|WindowsPath) .*call "
                                        r"skyformer\.hf\.from_pretrained\(path, method\)"):
        shf.set_attention(given, "skyformer")


def test_describe_shows_a_decoder_layer_as_causal():
    """describe gave 'causal': False for every layer of a decoder, which runs causally
    (each call takes causal from the model's mask)."""
    for decoder in (True, False):
        model = tiny_bert(is_decoder=decoder)
        shf.set_attention(model, "skyformer", num_features=8,
                          **({"landmark_stride": 4} if decoder else {}))
        rows = shf.describe(model)
        assert {row["options"]["causal"] for row in rows} == {decoder}
        # the causal form's options serve the causal calls (an encoder refuses them)
        assert {row["options"]["landmark_stride"] for row in rows} == {4 if decoder else None}


def test_describe_shows_the_scale_of_a_model_that_prescales_its_queries():
    """OPT multiplies its queries by 1/sqrt(head dim) itself and calls with scaling 1.0,
    which every call passes as scale: describe said scale None (1/sqrt(head dim))."""
    from tests.hf.test_hf_architecture_matrix import build

    for route in ("set_attention", "attn_implementation"):
        model = build("opt")
        if route == "set_attention":
            shf.set_attention(model, "performer", num_features=8, seed=0)
        else:
            model.set_attn_implementation("skyformer:performer")
        assert {row["options"]["scale"] for row in shf.describe(model)} == {1.0}, route
    model = build("opt")
    shf.set_attention(model, "performer", num_features=8, scale=0.5)  # the user's wins
    assert {row["options"]["scale"] for row in shf.describe(model)} == {0.5}
    model = tiny_bert()  # 1/sqrt(head dim): the default, None
    shf.set_attention(model, "performer", num_features=8)
    assert {row["options"]["scale"] for row in shf.describe(model)} == {None}


@torch.no_grad()
def test_the_causal_forms_options_serve_the_causal_layers_only():
    """set_attention's options apply to every layer; landmark_stride (which a call that
    is not causal refuses) shapes the layers the model runs causally and is left out of
    the others (an encoder-decoder's encoder and cross-attention). Where no layer set is
    causal (an encoder) it would change nothing, and is refused as every other entry
    point refuses it."""
    with pytest.raises(ValueError, match=r"skyformer: landmark_stride=4 shapes causal "
                                         r"attention only \(causal=True\); no layer set here "
                                         r"is causal"):
        shf.set_attention(tiny_bert(), "skyformer", seed=0, num_features=8, landmark_stride=4)
    # past the exact 64-token chunk, a decoder's landmarks follow the stride
    decoder = [tiny_bert(is_decoder=True, max_position_embeddings=128) for _ in range(2)]
    for model, stride in zip(decoder, (4, 1), strict=True):
        shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=stride)
    ids = torch.randint(1, 64, (1, 120), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(*(m(input_ids=ids).last_hidden_state for m in decoder))


def test_from_pretrained_names_a_path_that_is_no_folder(tmp_path):
    """transformers answered a missing folder with the Hub's rules for repository ids
    ("Repo id must be in the form 'repo_name'...")."""
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass the folder that "
                                                r"save_pretrained wrote"):
        shf.from_pretrained(tmp_path / "no_such_model", "performer")
    from skyformer.hf.loading import _refuse_missing_folder

    for hub_id in ("bert-base-uncased", "sentence-transformers/all-MiniLM-L6-v2"):
        _refuse_missing_folder(hub_id)  # transformers' to load (or to refuse offline)
    for path in ("./no_such_model", "/no/such/model", "runs/2026/model"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            _refuse_missing_folder(path)
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(NotADirectoryError, match=r"weights\.bin is a file; from_pretrained "
                                                 r"takes the folder"):
        shf.from_pretrained(str(tmp_path / "weights.bin"), "performer")
