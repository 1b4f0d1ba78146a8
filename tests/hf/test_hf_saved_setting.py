"""The attention setting a saved model records in its config.json, and
``skyformer.hf.from_pretrained(path)`` setting every layer up again from it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import skyformer.hf as shf
from skyformer.hf.record import RECORD_KEY, _round_trips
from tests.hf.conftest import tiny_bert
from tests.hf.test_hf_architecture_matrix import build, hidden, inputs
from tests.hf.test_hf_architectures import _as_trained, ids_and_padding


def _record(folder):
    return json.loads((folder / "config.json").read_text()).get(RECORD_KEY)


def _edit_record(folder, record):
    config = json.loads((folder / "config.json").read_text())
    config[RECORD_KEY] = record
    (folder / "config.json").write_text(json.dumps(config))


def _two_methods():
    model = tiny_bert()
    shf.set_attention(model, "performer", layers=[0], num_features=8, seed=1)
    shf.set_attention(model, "linformer", layers=[1], num_features=8, seed=3)
    with torch.no_grad():
        _as_trained(model, 3.0)  # saved parameters differ from a fresh layer's
    return model


@torch.no_grad()
def test_saved_model_comes_back_with_each_layer_as_it_ran(tmp_path):
    """The record holds the options given (the model's own scale and max_seq_len are
    filled in again), and from_pretrained(path) rebuilds both layers' settings, seeds
    and trained parameters: the same outputs, also into a model with a head."""
    from transformers import BertForSequenceClassification

    model = _two_methods()
    model.save_pretrained(tmp_path)
    assert _record(tmp_path) == {"format": 1, "layers": [
        {"layer": 0, "module": "encoder.layer.0.attention.self", "method": "performer",
         "options": {"num_features": 8}, "seed": 1, "seed_offset": 0},
        {"layer": 1, "module": "encoder.layer.1.attention.self", "method": "linformer",
         "options": {"num_features": 8}, "seed": 3, "seed_offset": 1}]}
    assert not hasattr(model.config, RECORD_KEY)  # saving leaves the model's config alone
    loaded = shf.from_pretrained(tmp_path).eval()
    assert shf.describe(loaded) == shf.describe(model)
    assert not hasattr(loaded.config, RECORD_KEY)
    ids, mask = ids_and_padding()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).last_hidden_state,
                               model(input_ids=ids, attention_mask=mask).last_hidden_state,
                               rtol=0, atol=0)
    headed = shf.from_pretrained(tmp_path, auto_class=BertForSequenceClassification)
    assert [row["method"] for row in shf.describe(headed)] == ["performer", "linformer"]
    state = headed.bert.encoder.layer[1].attention.self.skyformer_state
    assert torch.equal(state.proj_k, model.encoder.layer[1].attention.self.skyformer_state.proj_k)


@torch.no_grad()
def test_a_saved_decoder_comes_back_with_its_head_and_generates_the_same(tmp_path):
    """The default class was AutoModel, so a saved LlamaForCausalLM came back as a
    LlamaModel without its language-model head (only transformers' load report told,
    listing lm_head.weight); it is now the class the config's architectures name."""
    from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    shf.set_attention(model, "performer", num_features=8, seed=0)
    model.save_pretrained(tmp_path)
    ids = torch.randint(2, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    for loaded in (shf.from_pretrained(tmp_path).eval(),
                   shf.from_pretrained(tmp_path, "performer", num_features=8, seed=0).eval()):
        assert type(loaded) is LlamaForCausalLM
        assert torch.equal(loaded.generate(ids, cache=shf.DecodingCache(loaded), **settings),
                           model.generate(ids, cache=shf.DecodingCache(model), **settings))
    bare = shf.from_pretrained(tmp_path, auto_class=AutoModel)  # the class asked for
    assert type(bare).__name__ == "LlamaModel"


@torch.no_grad()
def test_a_method_in_every_layer_comes_back_whole(tmp_path):
    """One setting in every layer is rebuilt as one (the model's implementation names
    the method), set by set_attention or by the attn_implementation route, whose layers
    record the method's defaults."""
    from transformers import AutoModel

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=8, seed=0)
    model.save_pretrained(tmp_path / "set")
    loaded = shf.from_pretrained(tmp_path / "set")
    assert loaded.config._attn_implementation == "skyformer:skyformer"
    assert shf.describe(loaded) == shf.describe(model)
    plain = AutoModel.from_pretrained(tmp_path / "set", attn_implementation="skyformer:performer")
    plain.save_pretrained(tmp_path / "unmade")  # its layers make their features when run
    assert [(row["method"], row["options"], row["seed"])
            for row in _record(tmp_path / "unmade")["layers"]] == [("performer", {}, None)] * 2
    with pytest.warns(UserWarning, match=r"records performer in layers 0, 1, but .* in its "
                                         r"first forward pass"):
        shf.from_pretrained(tmp_path / "unmade")
    ids, mask = ids_and_padding()
    want = plain.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    plain.save_pretrained(tmp_path / "route")
    loaded = shf.from_pretrained(tmp_path / "route")
    assert loaded.config._attn_implementation == "skyformer:performer"
    out = loaded.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the saved features are loaded


def test_a_model_running_exact_attention_records_nothing(tmp_path):
    """A recorded folder loaded by transformers alone runs exact attention: saved again,
    it records nothing (no stale setting), and from_pretrained(path) asks for the
    method. What the model's config held before saving is left as it was."""
    from transformers import AutoModel

    _two_methods().save_pretrained(tmp_path / "recorded")
    plain = AutoModel.from_pretrained(tmp_path / "recorded")
    assert getattr(plain.config, RECORD_KEY)["format"] == 1  # transformers keeps the entry
    plain.save_pretrained(tmp_path / "plain")
    assert _record(tmp_path / "plain") is None
    assert getattr(plain.config, RECORD_KEY)["format"] == 1
    with pytest.raises(ValueError, match=r"plain/config\.json records no skyformer attention "
                                         r"setting .*\.from_pretrained\(path, method, \.\.\.\)"):
        shf.from_pretrained(tmp_path / "plain")
    restored = shf.restore_exact(_two_methods())
    restored.save_pretrained(tmp_path / "restored")
    assert _record(tmp_path / "restored") is None


def test_an_explicit_method_overrides_the_record(tmp_path):
    """With a method, its settings are used, not the record's; where the saved
    parameters do not fit them, the sentence names what the config records. Without a
    method, options, layers and a seed are refused (the record sets them)."""
    _two_methods().save_pretrained(tmp_path)
    exact = shf.from_pretrained(tmp_path, "exact")
    assert {row["method"] for row in shf.describe(exact)} == {"exact (sdpa)"}
    with pytest.raises(ValueError, match=r"Its config records performer in layer 0 "
                                         r"\(num_features=8, seed=1\); linformer in layer 1 "
                                         r"\(num_features=8, seed=3\), which skyformer\.hf\."
                                         r"from_pretrained\(path\) sets up\.$"):
        shf.from_pretrained(tmp_path, "linformer", num_features=4)
    with pytest.raises(TypeError, match=r"takes no layers, num_features; to choose them, "
                                        r"pass the method"):
        shf.from_pretrained(tmp_path, layers=[0], num_features=8)


def test_records_this_cannot_read_are_refused_with_the_entry_named(tmp_path):
    """A record of another format, a damaged row, an option JSON could not hold, or a
    layer this model lacks: each refused, naming config.json's entry and the way out."""
    _two_methods().save_pretrained(tmp_path)
    good = _record(tmp_path)
    row = good["layers"][0]
    for record, words in (
            ({**good, "format": 2}, r"entry is not of format 1"),
            ({"format": 1, "layers": []}, r"entry lists no layers"),
            ({"format": 1, "layers": [{**row, "seed": -1}]}, r"has a row without"),
            ({"format": 1, "layers": [{**row, "unrecorded_options": ["window"]}]},
             r"could not hold the option window of performer in layer 0 \(not JSON\)"),
            ({"format": 1, "layers": [{**row, "layer": 7}]},
             r"records a setting for layer 7, and this model's layers are 0\.\.1")):
        _edit_record(tmp_path, record)
        with pytest.raises(ValueError, match=rf"config\.json.*{words}"):
            shf.from_pretrained(tmp_path)
    assert _round_trips(0.1) and _round_trips({"a": [1, None]})
    assert not _round_trips((1, 2)) and not _round_trips(torch.float16)


def test_numpy_options_are_recorded_as_the_numbers_they_hold(tmp_path):
    """scale=np.float64(0.1) (a sweep over np.linspace) was written as an unrecorded
    option, which made the folder unloadable by its record."""
    import numpy as np

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=np.int64(8), scale=np.float64(0.1),
                      seed=0)
    model.save_pretrained(tmp_path)
    assert _record(tmp_path)["layers"][0]["options"] == {"num_features": 8, "scale": 0.1}
    assert shf.describe(shf.from_pretrained(tmp_path)) == shf.describe(model)


def test_a_record_without_saved_parameters_warns(tmp_path):
    """A config recording Linformer beside weights without its parameters (written by a
    model that did not run it): they start from the initialisation, with a warning."""
    tiny_bert().save_pretrained(tmp_path)
    _edit_record(tmp_path, {"format": 1, "layers": [
        {"layer": 0, "method": "linformer", "options": {"num_features": 8}, "seed": 0}]})
    with pytest.warns(UserWarning, match=r"records linformer in layer 0 \(num_features=8, "
                                         r"seed=0\), but the weights hold no per-layer"):
        loaded = shf.from_pretrained(tmp_path)
    assert [row["method"] for row in shf.describe(loaded)] == ["linformer", "exact"]


def test_encoder_decoder_round_trip_and_one_part_set_alone(tmp_path):
    """T5 and BART (an encoder layer and a decoder block share each layer number): a
    method in every layer comes back; so does one part set alone, by set_attention on
    that part, as the refusal of skyformer in a decoder's cross-attention advises (the
    record's module names say which part each row is of). A row in neither part is
    refused."""
    model = build("t5")
    shf.set_attention(model, "softmax")
    model.save_pretrained(tmp_path / "whole")
    assert len(_record(tmp_path / "whole")["layers"]) == 6
    loaded = shf.from_pretrained(tmp_path / "whole").eval()
    batch, _ = inputs("t5")
    torch.testing.assert_close(hidden(loaded, batch), hidden(model, batch), rtol=0, atol=0)
    shf.restore_exact(model.get_encoder())
    model.save_pretrained(tmp_path / "decoder")
    assert len(_record(tmp_path / "decoder")["layers"]) == 4
    loaded = shf.from_pretrained(tmp_path / "decoder").eval()
    # the encoder restored alone holds exact settings under the name the decoder runs
    # ("exact"); loaded, it runs the model's own ("exact (sdpa)"): the same attention
    assert [{**r, "method": r["method"].removesuffix(" (sdpa)")} for r in shf.describe(loaded)
            ] == shf.describe(model)
    torch.testing.assert_close(hidden(loaded, batch), hidden(model, batch), rtol=0, atol=0)
    bart = build("bart")
    shf.set_attention(bart.get_encoder(), "skyformer", num_features=8, seed=0)
    bart.save_pretrained(tmp_path / "encoder")
    loaded = shf.from_pretrained(tmp_path / "encoder").eval()
    assert shf.describe(loaded) == shf.describe(bart)
    batch, _ = inputs("bart")
    torch.testing.assert_close(hidden(loaded, batch), hidden(bart, batch), rtol=0, atol=0)
    record = _record(tmp_path / "encoder")
    record["layers"][0]["module"] = "elsewhere.self_attn"
    _edit_record(tmp_path / "encoder", record)
    with pytest.raises(ValueError, match=r"records attention modules that are in neither "
                                         r"part of this model"):
        shf.from_pretrained(tmp_path / "encoder")


@torch.no_grad()
def test_a_seeded_tower_set_alone_comes_back_with_its_draws(tmp_path):
    """CLIP's vision tower set alone with a seed counts its layers' seed offsets from
    its own first layer (0, 1); rebuilt on the whole model by layer number (2, 3) it drew
    otherwise, with nothing said. The record keeps each layer's offset."""
    from transformers import CLIPConfig, CLIPModel

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64}
    config = CLIPConfig(text_config=dict(sizes, vocab_size=99, max_position_embeddings=64),
                        vision_config=dict(sizes, image_size=32, patch_size=4),
                        projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel._from_config(config, attn_implementation="sdpa").eval()
    shf.set_attention(model.vision_model, "reformer", seed=0, num_features=8)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    want = model.get_image_features(pixel_values=pixels)
    model.save_pretrained(tmp_path)
    assert [(row["layer"], row["seed_offset"]) for row in _record(tmp_path)["layers"]] \
        == [(2, 0), (3, 1)]
    loaded = shf.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.get_image_features(pixel_values=pixels), want,
                               rtol=0, atol=0)


def test_a_record_that_cannot_be_made_never_stops_a_save(tmp_path, monkeypatch):
    """Saving (a Trainer checkpoint) goes on without the record, with a warning that
    says how to load the folder, where making the record fails."""
    import skyformer.hf.record as record

    def broken(model):
        raise RuntimeError("no record today")

    monkeypatch.setattr(record, "setting_record", broken)
    model = _two_methods()
    with pytest.warns(UserWarning, match=r"could not record the attention setting of "
                                         r"BertModel \(RuntimeError: no record today\); it "
                                         r"is saved without one"):
        model.save_pretrained(tmp_path)
    assert _record(tmp_path) is None
    assert (tmp_path / "model.safetensors").exists()
