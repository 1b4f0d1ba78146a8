"""Transformers architectures built from tiny configs (random weights): ``skyformer:softmax``
equals SDPA in each; an approximate method either runs or is refused at
``set_attention`` with a sentence naming what the layer needs (docs/pytorch2.md holds the
table as measured; the counts are printed after the run)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModel

import skyformer.hf as shf
from skyformer import CapabilityError
from skyformer.hf.layers import current_layer

_C = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
          "vocab_size": 99, "max_position_embeddings": 64}
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_SEQ2SEQ = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "vocab_size": 99}
_IMAGE = dict(_C, image_size=16, patch_size=4)

# model_type -> tiny config. Windows and position biases are shorter than the 12 tokens
# fed, so that they change the result.
ARCHITECTURES = {
    "bert": _C,
    "roberta": _C,
    "xlm-roberta": _C,
    "electra": dict(_C, embedding_size=32),
    "albert": dict(_C, embedding_size=16),
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "vocab_size": 99,
                       "max_position_embeddings": 64},
    "modernbert": dict(_C, global_attn_every_n_layers=2, local_attention=8, cls_token_id=1,
                       sep_token_id=2, **_TOKENS),
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 99, "n_positions": 64,
             "bos_token_id": 1, "eos_token_id": 2},
    "gpt_neox": _C,
    "gptj": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 99, "n_positions": 64,
             "rotary_dim": 4},
    "gpt_bigcode": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 99,
                    "n_positions": 64, "multi_query": True},
    "falcon": dict(_C, new_decoder_architecture=True, num_kv_heads=2),
    "stablelm": dict(_C, num_key_value_heads=2),
    "opt": dict(_C, ffn_dim=64, word_embed_proj_dim=32),
    "llama": dict(_C, num_key_value_heads=2),
    "mistral": dict(_C, num_key_value_heads=2, sliding_window=5),
    "qwen2": dict(_C, num_key_value_heads=2),
    "qwen3": dict(_C, num_key_value_heads=2, head_dim=8),
    "gemma": dict(_C, num_key_value_heads=2, head_dim=8),
    "phi": _C,
    "bart": dict(_SEQ2SEQ, max_position_embeddings=64),
    "marian": dict(_SEQ2SEQ, max_position_embeddings=64, decoder_start_token_id=1,
                   pad_token_id=0),
    "t5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 99,
               "relative_attention_num_buckets": 8},
    "whisper": dict(_SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                    decoder_start_token_id=1, **_TOKENS),
    "clip_text_model": dict(_C, **_TOKENS),
    "clip_vision_model": _IMAGE,
    "siglip_vision_model": _IMAGE,
    "vit": _IMAGE,
}
CAUSAL_LMS = ("llama", "qwen2", "gpt2")

# model_type -> tiny config of architectures whose attention is computed in their own code
# (not through transformers' AttentionInterface): a skyformer attn_implementation would
# be ignored, so it is refused when the model is built.
OWN_ATTENTION = {
    "deberta-v2": dict(_C, relative_attention=True, position_buckets=8),
    "mpnet": _C,
    "gpt_neo": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 99,
                "max_position_embeddings": 64, "attention_types": [[["global", "local"], 1]],
                "window_size": 8},
    "bloom": {"hidden_size": 32, "n_layer": 2, "n_head": 4, "vocab_size": 99},
    "mpt": {"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 99, "max_seq_len": 64},
}


def build(kind):
    config = AutoConfig.for_model(kind, **ARCHITECTURES[kind])
    torch.manual_seed(0)
    return AutoModel.from_config(config, attn_implementation="sdpa").eval()


def inputs(kind):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    if kind in ("vit", "clip_vision_model", "siglip_vision_model"):
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}, None
    if kind == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=g),
                    "decoder_input_ids": ids[:, :6]}, None
    if kind in ("t5", "bart", "marian"):
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6]}, None
    return {"input_ids": ids, "attention_mask": mask}, mask.bool()


def hidden(model, batch):
    with torch.no_grad():
        return model(**batch)[0]


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_softmax_equals_sdpa(kind, matrix):
    matrix("HF skyformer:softmax = SDPA", kind)
    model = build(kind)
    batch, real = inputs(kind)
    expected = hidden(model, batch)
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("skyformer:softmax")
    out = hidden(ours, batch)
    if real is not None:
        out, expected = out[real], expected[real]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_the_layers_run_the_method_the_model_is_built_with(kind, matrix):
    """softmax equal to SDPA would hold as well in a model that ignored the name: with
    kernelized (another function) the output changes, built with the name or switched
    to it, and every attention module has made its setting in that forward pass."""
    matrix("HF layers run the method", kind)
    model = build(kind)
    batch, _ = inputs(kind)
    expected = hidden(model, batch)
    config = AutoConfig.for_model(kind, **ARCHITECTURES[kind])
    torch.manual_seed(0)
    built = AutoModel.from_config(config, attn_implementation="skyformer:kernelized").eval()
    switched = copy.deepcopy(model)
    switched.set_attn_implementation("skyformer:kernelized")
    for ours in (built, switched):
        out = hidden(ours, batch)
        assert torch.isfinite(out).all()
        assert (out - expected).abs().max() > 1e-3
        assert [row["method"] for row in shf.describe(ours)] == \
            ["kernelized"] * len(shf.attention_modules(ours))
        assert all(current_layer(m) is not None for _, _, m in shf.attention_modules(ours))


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_approximate_method_runs_or_is_refused_at_load(kind, matrix):
    """skyformer in every layer: it runs (finite output), or set_attention refuses it with
    a sentence naming what the layer needs (causal masking, a window, a position bias)."""
    model = build(kind)
    batch, _ = inputs(kind)
    try:
        shf.set_attention(model, "skyformer", num_features=8)
    except CapabilityError as err:
        matrix("HF skyformer refused at load", kind)
        assert any(need in str(err) for need in (
            "causal", "sliding window", "position bias", "cross-attention of a causal "
            "decoder")), str(err)
        return
    matrix("HF skyformer runs", kind)
    assert torch.isfinite(hidden(model, batch)).all()


@pytest.mark.parametrize("kind", ["bart", "marian", "whisper"])
def test_a_decoders_cross_attention_takes_methods_with_independent_queries(kind):
    """The decoder's queries are its tokens in order: skyformer (landmarks drawn from the
    queries) is refused in its cross-attention, at set_attention and on the
    attn_implementation route, and runs in the encoder alone; performer (each output
    from its own query) runs everywhere. Either way a decoder position's output does not
    change when a later decoder token does."""
    batch, _ = inputs(kind)
    later = {**batch, "decoder_input_ids": batch["decoder_input_ids"].clone()}
    later["decoder_input_ids"][:, 3:] = (later["decoder_input_ids"][:, 3:] + 7) % 90 + 3
    model = build(kind)
    with pytest.raises(CapabilityError, match=r"is the cross-attention of a causal decoder.*"
                                              r"set_attention\(model\.get_encoder\(\), "
                                              r"'skyformer', \.\.\.\)\)\.$"):
        shf.set_attention(model, "skyformer", num_features=8)
    routed = build(kind)
    routed.set_attn_implementation("skyformer:skyformer")
    with pytest.raises(CapabilityError, match="cross-attention of a causal decoder"):
        hidden(routed, batch)
    exact = hidden(build(kind), batch)
    shf.set_attention(model.get_encoder(), "skyformer", num_features=8, seed=0)
    assert {row["method"] for row in shf.describe(model.get_encoder())} == {"skyformer"}
    everywhere = build(kind)
    shf.set_attention(everywhere, "performer", num_features=8, seed=0)
    for ours in (model, everywhere):
        out = hidden(ours, batch)
        assert (out - exact).abs().max() > 1e-4  # the method runs where it was set
        torch.testing.assert_close(hidden(ours, later)[:, :3], out[:, :3], rtol=0, atol=0)


@pytest.mark.parametrize("kind", CAUSAL_LMS)
def test_static_cache_generation_with_exact_methods(kind, matrix):
    """``cache_implementation="static"``: masks over a fixed-size cache, which the
    methods that take any attn_mask apply as SDPA; greedy tokens equal SDPA's."""
    from transformers import AutoModelForCausalLM

    matrix("HF static cache", kind)
    config = AutoConfig.for_model(kind, **ARCHITECTURES[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    batch, _ = inputs(kind)
    settings = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static",
                    "pad_token_id": 0}
    expected = model.generate(**batch, **settings)
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("skyformer:softmax")
    torch.testing.assert_close(ours.generate(**batch, **settings), expected)
    with pytest.raises(CapabilityError, match="causal"):
        shf.set_attention(copy.deepcopy(model), "nystromformer")


def test_a_models_own_scaling_goes_to_the_scale_option():
    """T5 computes with logit scale 1 (no 1/sqrt(d)) and a position bias: kernelized,
    which takes any mask and has a scale option, runs it with both; linear, which has
    neither, is refused at load with a sentence."""
    model = build("t5")
    batch, _ = inputs("t5")
    shf.set_attention(model, "kernelized")
    assert torch.isfinite(hidden(model, batch)).all()
    encoder = build("t5").encoder
    with pytest.raises(CapabilityError, match="relative position bias"):
        shf.set_attention(encoder, "linear")


def test_a_scale_in_a_variant_name_wins_over_the_models_as_a_keyword_does():
    """``set_attention(t5, "kernelized[scale=0.5]")`` ran with the model's scale 1 (only
    a keyword counted as the user's), while ``describe`` said 0.5."""
    batch, _ = inputs("t5")
    runs = {}
    for label, method, options in (("keyword", "kernelized", {"scale": 0.5}),
                                   ("variant", "kernelized[scale=0.5]", {}),
                                   ("model's", "kernelized", {})):
        model = build("t5")
        shf.set_attention(model, method, **options)
        runs[label] = hidden(model, batch)
    torch.testing.assert_close(runs["variant"], runs["keyword"], rtol=0, atol=0)
    assert (runs["variant"] - runs["model's"]).abs().max() > 1e-3


def test_options_of_the_causal_form_are_refused_where_no_layer_is_causal():
    """``landmark_stride`` on an encoder changed nothing without a word; the other entry
    points refuse it. A decoder takes it."""
    for method, options in (("skyformer", {"landmark_stride": 2}),
                            ("nystrom_softmax[causal_local=False]", {})):
        with pytest.raises(ValueError, match=r"shapes causal attention only \(causal=True\); "
                                             r"no layer set here is causal .*: leave it out\.$"):
            shf.set_attention(build("bert"), method, **options)
    shf.set_attention(build(CAUSAL_LMS[0]), "skyformer", landmark_stride=2)


@pytest.mark.parametrize("kind", CAUSAL_LMS)
def test_causal_linear_attention_in_decoders_does_not_look_ahead(kind):
    """linear has causal masking: decoders run it; changing a later token leaves the
    hidden states of earlier positions unchanged."""
    model = build(kind)
    shf.set_attention(model, "linear")
    batch, _ = inputs(kind)
    ids = batch["input_ids"][:1]
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 7) % 90 + 3
    with torch.no_grad():
        a, b = model(input_ids=ids)[0], model(input_ids=changed)[0]
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("kind", list(OWN_ATTENTION))
@pytest.mark.parametrize("implementation", ["skyformer:kernelized", "skyformer"])
def test_a_model_computing_its_own_attention_refuses_a_skyformer_implementation(
        kind, implementation, matrix):
    """Bloom, MPT, DeBERTa, MPNet and GPT-Neo compute attention in their own code:
    transformers accepted attn_implementation="skyformer:<method>" for them, the config
    named it, and every forward ran the model's own attention (or failed inside
    transformers: MPT's AttributeError, GPT-Neo's KeyError). Building the model now fails
    with a sentence naming it and the fix; eager still builds."""
    matrix("HF own attention refused at load", kind)
    config = AutoConfig.for_model(kind, **OWN_ATTENTION[kind])
    name = AutoModel.from_config(config, attn_implementation="eager").__class__.__name__
    with pytest.raises(ValueError, match=rf"{name} computes attention in its own code.*"
                       r"attn_implementation='eager'"):
        AutoModel.from_config(config, attn_implementation=implementation)


def test_an_alibi_model_refuses_the_methods_without_attn_mask_at_load():
    """Falcon with ALiBi adds its position bias to the mask: set_attention accepted
    skyformer, and the first forward pass refused the mask. It is refused at load now,
    naming the bias; kernelized, which takes any mask, runs it."""
    config = AutoConfig.for_model("falcon", **dict(_C, alibi=True, new_decoder_architecture=False))
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(CapabilityError, match=r"layer 0 \(FalconAttention\) uses an ALiBi "
                       r"position bias.*softmax or kernelized"):
        shf.set_attention(model, "skyformer", num_features=8)
    assert shf.describe(model)[0]["method"] == "exact (sdpa)"
    shf.set_attention(model, "kernelized")
    assert torch.isfinite(hidden(model, inputs("falcon")[0])).all()


@pytest.mark.parametrize("kind", ["opt", "whisper"])
def test_queries_scaled_by_the_module_are_checked_at_load(kind):
    """OPT and Whisper multiply the queries by ``scaling`` themselves and call the
    attention function with ``scaling=1.0``: set_attention read their ``scaling``
    (1/sqrt(d), every method's default) and took linear, which then failed at the first
    forward pass. The scale checked is the call's; methods with a scale option run."""
    model = build(kind)
    batch, _ = inputs(kind)
    with pytest.raises(CapabilityError, match=r"linear cannot use the model's attention logit "
                                              r"scale 1 \(the scale its attention call passes"):
        shf.set_attention(copy.deepcopy(model), "linear")
    shf.set_attention(model, "kernelized")
    assert torch.isfinite(hidden(model, batch)).all()


def test_logit_soft_capping_is_refused_at_load():
    """Gemma-2 caps its attention logits, which no layer here applies (transformers' SDPA
    neither): set_attention took it, softmax included, and the first forward failed."""
    config = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, vocab_size=99)
    model = AutoModel.from_config(config, attn_implementation="eager")
    for method in ("softmax", "skyformer"):
        with pytest.raises(CapabilityError, match=r"caps its attention logits "
                                                  r"\(attn_logit_softcapping=50"):
            shf.set_attention(copy.deepcopy(model), method)


def test_prescaled_queries_are_read_from_the_code_not_its_comments():
    """prescales_queries reads a call's keyword ``scaling=1.0`` from the forward's syntax
    (a comment saying so does not count), per function: a forward replaced later, or
    set on the instance, is read anew."""
    from skyformer.hf.layers import model_scaling

    def attend(**kwargs):
        return kwargs

    class Attention(torch.nn.Module):
        scaling = 0.125

        def forward(self, x):
            # the attention call below passes scaling=1.0 in OPT; here it does not
            return attend(x=x, scaling=self.scaling)

    module = Attention()
    assert model_scaling(module) == 0.125

    def prescaled(self, x):
        return attend(x=x * self.scaling, scaling=1.0)

    Attention.forward = prescaled
    assert model_scaling(module) == 1.0
    other = Attention()
    other.forward = lambda x: attend(x=x, scaling=other.scaling)
    assert model_scaling(other) == 0.125
