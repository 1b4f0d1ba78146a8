"""``skyformer.hf.DecodingCache``: ``generate`` on GPT-2 and Llama decoders built from
configs gives the tokens of the full causal forward (``use_cache=False``), with states
whose size stops growing."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import skyformer.hf as shf
from skyformer.hf.decoding import DecodingLayer


def _gpt2(implementation="skyformer"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=512,
                        bos_token_id=0, eos_token_id=1)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def _llama(implementation="skyformer", layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as batched generation pads
    return ids, mask


def _generate(model, cache, new=70, **kwargs):
    ids, mask = _prompt()
    cached = {"cache": cache} if cache is not None else {"use_cache": False}
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **cached, **kwargs)


SETTINGS = [
    ("skyformer", {"num_features": 8, "landmark_stride": 4}),
    ("performer", {"num_features": 16}),
    ("linear", {}),
    ("nystrom_softmax", {"num_features": 8, "landmark_stride": 4}),
    ("softmax", {}),
]


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("method", "options"), SETTINGS, ids=[s[0] for s in SETTINGS])
def test_generate_equals_the_full_causal_forward(build, method, options):
    model = build()
    shf.set_attention(model, method, seed=0, **options)
    expected = _generate(model, None)
    cache = shf.DecodingCache(model)
    assert torch.equal(_generate(model, cache), expected)
    assert all(isinstance(layer, DecodingLayer) for layer in cache.layers)


@torch.no_grad()
def test_a_static_cache_is_refused_without_a_warning_about_decoding_steps():
    """At prefill the slots of a static cache are more keys than queries: the method
    warned that it decodes over transformers' cache (not so: it had not begun) before
    the mask's refusal, which says what the slots are."""
    import warnings

    from skyformer.masks import UnsupportedMaskError

    model = _llama()
    shf.set_attention(model, "skyformer", seed=0, num_features=8)
    ids, mask = _prompt()
    with warnings.catch_warnings(record=True) as said, \
            pytest.raises(UnsupportedMaskError, match="the slots of a static cache"):
        warnings.simplefilter("always")
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       pad_token_id=0, cache_implementation="static")
    assert not [w for w in said if "own key/value cache" in str(w.message)]


@torch.no_grad()
def test_attention_maps_of_a_decoders_forward_and_none_over_a_decoding_cache():
    """GPT-2 drops output_attentions before its attention call (transformers' recorder
    reads the maps): a forward still gives Skyformer's causal maps, which applied to
    nothing later than their query; generate over a DecodingCache says it gives none."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    ids, mask = _prompt()
    maps = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert [m.shape for m in maps] == [(2, 2, 30, 30)] * 2
    for m in maps:
        assert torch.all(m.triu(1) == 0) and torch.all(m[1, :, :, :4] == 0)
        assert m[0].abs().sum() > 0
    with pytest.warns(UserWarning, match="no attention weights in a step over a DecodingCache"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                             pad_token_id=0, cache=shf.DecodingCache(model),
                             output_attentions=True, return_dict_in_generate=True)
    assert out.attentions == ((),)


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_cache_with_use_cache_false_is_refused_and_goes_on_untouched(build):
    """generate(..., cache=DecodingCache(model), use_cache=False) fed the whole sequence
    at every step into the cache, which added those positions after the ones it held:
    other tokens than the forward's, in silence. The first step is now refused, before
    the cache takes anything, and the same cache then decodes as a new one."""
    model = build()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    expected = _generate(model, None, new=8)
    cache = shf.DecodingCache(model)
    with pytest.raises(ValueError, match=r"use_cache=False.*feeds the whole sequence again "
                       r"at every step.*Leave use_cache=False out"):
        _generate(model, cache, new=8, use_cache=False)
    assert cache.get_seq_length() == 0
    assert torch.equal(_generate(model, cache, new=8), expected)


@torch.no_grad()
def test_mixed_layers_and_beams():
    """Layer 0 exact (keys kept), layer 1 skyformer (a state); beam search reorders both."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", layers=[1], seed=0, num_features=8,
                      landmark_stride=4)
    expected = _generate(model, None, new=20, num_beams=2)
    cache = shf.DecodingCache(model)
    assert torch.equal(_generate(model, cache, new=20, num_beams=2), expected)
    assert cache.layers[0].keys is not None and cache.layers[0].state is None
    assert cache.layers[1].keys is None and cache.layers[1].state is not None


@torch.no_grad()
@pytest.mark.parametrize("method", ["performer", "linear"])
def test_beams_past_the_first_chunk_with_deterministic_draws(method):
    """Beyond the first 64-token chunk beams of a deterministic method equal the forward
    without a cache (a randomized one keeps each sequence's draws: docs/causal.md)."""
    model = _llama()
    shf.set_attention(model, method, seed=0)
    expected = _generate(model, None, new=50, num_beams=2)  # 30 + 50 positions
    assert torch.equal(_generate(model, shf.DecodingCache(model), new=50, num_beams=2),
                       expected)


@torch.no_grad()
def test_cache_size_stops_growing():
    model = _gpt2()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=2)
    sizes = []
    for new in (66, 130):  # same position within a 64-token chunk: 30 + new = 96, 160
        cache = shf.DecodingCache(model)
        _generate(model, cache, new=new)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


def test_refusals():
    with pytest.raises(ValueError, match="runs through skyformer"):
        shf.DecodingCache(_gpt2("sdpa"))
    small, large = _gpt2(), _llama(layers=3)
    shf.set_attention(small, "linear", seed=0)
    shf.set_attention(large, "linear", seed=0)
    with pytest.raises(ValueError, match="made for another model"), torch.no_grad():
        large(_prompt()[0], cache=shf.DecodingCache(small))
    model = _gpt2("skyformer:nystromformer")
    ids, mask = _prompt()
    with pytest.raises(Exception, match="nystromformer"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                       cache=shf.DecodingCache(model))


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("method", "options"), [SETTINGS[0], SETTINGS[1], SETTINGS[3],
                                                  SETTINGS[4]],
                         ids=["skyformer", "performer", "nystrom_softmax", "softmax"])
def test_assisted_generation_equals_the_full_causal_forward(build, method, options,
                                                            monkeypatch):
    """An exact-attention copy of the model drafts tokens (assistant_model) and prompt
    lookup drafts from the prompt: the rejected drafts are cropped from the states, and
    the tokens are those of the full causal forward. Some crops keep part of their step
    (the state is stepped again), the first step (the prompt) included."""
    model = build()
    shf.set_attention(model, method, seed=0, **options)
    ids, mask = _prompt()
    ids, mask = ids[:1], mask[:1]  # transformers drafts for one sequence at a time
    # 30 + 40 positions: past the first 64-position chunk the Nystrom states absorb
    settings = {"attention_mask": mask, "max_new_tokens": 40, "min_new_tokens": 40,
                "do_sample": False, "pad_token_id": 0}
    expected = model.generate(ids, use_cache=False, **settings)
    crops = []
    original_crop = DecodingLayer.crop

    def spy(layer, tokens_to_remove):
        if layer.rollback is not None and tokens_to_remove:
            crops.append((-tokens_to_remove, layer.rollback[1].shape[2]))
        original_crop(layer, tokens_to_remove)

    monkeypatch.setattr(DecodingLayer, "crop", spy)
    assistant = build("sdpa")  # same weights, exact attention: most drafts accepted
    drafted = model.generate(ids, cache=shf.DecodingCache(model), assistant_model=assistant,
                             **settings)
    assert torch.equal(drafted, expected)
    looked_up = model.generate(ids, cache=shf.DecodingCache(model),
                               prompt_lookup_num_tokens=3, **settings)
    assert torch.equal(looked_up, expected)
    if method != "softmax":  # exact layers keep keys and values: no state to step again
        assert any(removed < last for removed, last in crops), crops


@torch.no_grad()
def test_a_cropped_first_step_keeps_the_key_it_drew():
    """Without a layer seed the first step draws its key from torch's generator; a crop
    that steps the prompt again must keep that key, as the full forward over the kept
    positions with the same draw would have it."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", num_features=8, landmark_stride=4)
    ids = torch.randint(2, 64, (1, 141), generator=torch.Generator().manual_seed(1))
    # beyond the exact local window (64), so the landmarks, hence the key, matter
    torch.manual_seed(7)
    direct = shf.DecodingCache(model)
    model(ids[:, :136], cache=direct)
    want = model(ids[:, 136:137], cache=direct).logits
    torch.manual_seed(7)
    cropped = shf.DecodingCache(model)
    cropped.activate_past_recording()
    model(ids[:, :140], cache=cropped)
    cropped.crop(-4)
    assert cropped.get_seq_length() == 136
    torch.testing.assert_close(model(ids[:, 136:137], cache=cropped).logits, want)


@torch.no_grad()
def test_a_refused_crop_changes_nothing_and_crops_follow_reorders():
    """Layer 0 exact (keys kept), layer 1 a state: a crop beyond the last step is refused
    before any layer changes, and the same cache then crops as asked; after a reorder
    (beam search) the kept state follows the sequences."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", layers=[1], seed=0, num_features=8,
                      landmark_stride=4)
    ids = _prompt()[0][:, 4:]  # no padding: both rows real
    cache = shf.DecodingCache(model)
    cache.activate_past_recording()
    model(ids[:, :20], cache=cache)
    model(ids[:, 20:24], cache=cache)
    with pytest.raises(ValueError, match="at most the 4 positions"):
        cache.crop(-6)
    assert [layer.seen for layer in cache.layers] == [24, 24]
    assert cache.layers[0].keys.shape[-2] == 24
    order = torch.tensor([1, 0])
    cache.batch_select_indices(order)
    cache.crop(-3)
    got = model(ids[order, 21:22], cache=cache).logits
    direct = shf.DecodingCache(model)
    model(ids[order, :21], cache=direct)
    torch.testing.assert_close(got, model(ids[order, 21:22], cache=direct).logits)
    DecodingLayer().crop(-1)  # a layer never given positions (a gap in the indices)


@torch.no_grad()
def test_crop_refusals_name_the_fix():
    model = _gpt2()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    ids = _prompt()[0][:1]
    cache = shf.DecodingCache(model)
    assert not cache.is_croppable
    model(ids[:, :10], cache=cache)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)
    cache = shf.DecodingCache(model)
    cache.activate_past_recording()
    assert cache.is_croppable
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:13], cache=cache)
    with pytest.raises(ValueError, match="at most the 3 positions of its last step"):
        cache.crop(-4)
    with pytest.raises(ValueError, match="minus the number of positions"):
        cache.crop(5)


@torch.no_grad()
def test_every_live_cache_decodes_a_copy_too():
    """Two caches alive for one model (the older one continued after the newer was made)
    and a copy of a prompt's cache continued apart (transformers' prompt reuse) each
    decode as the full forward: a step is found from the keys its own cache handed back."""
    import copy

    model = _gpt2()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    ids = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits[:, -3:]
    older, newer = shf.DecodingCache(model), shf.DecodingCache(model)
    model(ids[:, :21], cache=older)
    model(ids[:, :20], cache=newer)
    prompt = copy.deepcopy(newer)
    torch.testing.assert_close(model(ids[:, 21:], cache=older).logits, want)
    torch.testing.assert_close(model(ids[:, 20:], cache=newer).logits[:, 1:], want)
    torch.testing.assert_close(model(ids[:, 20:], cache=prompt).logits[:, 1:], want)
    for cache in (older, newer, prompt):
        assert [layer.seen for layer in cache.layers] == [24, 24]


def test_a_cache_does_not_skip_the_refusal_of_soft_capping():
    """Gemma 2 asks for logit soft-capping, which no approximate method applies: refused
    with a cache as without one (the step must not quietly leave it out)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from skyformer.registry import CapabilityError

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=256,
                          sliding_window=4096, layer_types=["full_attention"] * 2,
                          attn_logit_softcapping=50.0, final_logit_softcapping=None)
    config._attn_implementation = "skyformer"
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    with pytest.raises(CapabilityError, match=r"caps its attention logits"):
        shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    model.set_attn_implementation("skyformer:skyformer")  # no check until the forward
    ids = torch.randint(2, 64, (1, 12))
    for cache in ({}, {"cache": shf.DecodingCache(model)}):
        with torch.no_grad(), pytest.raises(CapabilityError,
                                            match=r"soft-capping|caps its attention logits"):
            model(ids, **cache)


@pytest.mark.parametrize(("method", "options"), [SETTINGS[0], SETTINGS[2]],
                         ids=["skyformer", "linear"])
def test_dropout_in_training_with_a_cache_as_without(method, options):
    """In training mode the decoding step drops entries of its output as the call without
    a cache does: with the same random draws, the prompt's step equals the full forward."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=512,
                        attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "skyformer"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    shf.set_attention(model, method, seed=0, **options)
    ids = torch.randint(2, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.manual_seed(5)
        plain = model(ids).logits
        torch.manual_seed(5)
        cached = model(ids, cache=shf.DecodingCache(model)).logits
        evaluated = model.eval()(ids).logits
    torch.testing.assert_close(cached, plain)
    assert (cached - evaluated).abs().max() > 1e-2


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_decoder_compiles_whole_with_a_left_padded_mask(build):
    """``torch.compile(fullgraph=True)`` of a decoder with a padding mask: the causal
    mask with key padding is taken from the model's causal flag (no branch on its
    values) and gives the eager outputs."""
    model = build()
    shf.set_attention(model, "skyformer", seed=0, num_features=8)
    ids = torch.randint(2, 64, (2, 80), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits)


@torch.no_grad()
@pytest.mark.parametrize(("method", "options"), [SETTINGS[0], SETTINGS[3]],
                         ids=["skyformer", "nystrom_softmax"])
def test_a_one_token_prompt_decodes_as_its_full_forward(method, options):
    """A one-token forward without a cache takes the causal form (one query, one key:
    the mask hides nothing, but Skyformer's causal and non-causal forms differ), as the
    first step of a ``DecodingCache`` does."""
    model = _gpt2()
    shf.set_attention(model, method, seed=0, **options)
    ids = torch.randint(2, 64, (2, 1), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    torch.testing.assert_close(model(ids, cache=shf.DecodingCache(model)).logits, want,
                               atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_a_step_the_attention_never_took_stops_the_cache(monkeypatch):
    """Where no skyformer function takes the cache's keys (a model that copies them
    after cache.update, a compiled forward) that step attends to its own positions only.
    The next step is refused instead of going on wrong."""
    from skyformer.hf import attention as hf_attention

    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    monkeypatch.setattr(hf_attention, "claimed_step", lambda key: None)
    model(ids[:, :10], cache=cache)  # a first step: its own positions are all there are
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="never reached skyformer's attention function"):
        model(ids[:, 10:11], cache=cache)
    with pytest.raises(RuntimeError, match="start a new cache"):  # and every step after
        model(ids[:, 10:11], cache=cache)
    cache.reset()
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:11], cache=cache)


@torch.no_grad()
@pytest.mark.parametrize("change", ["restore_exact", "sdpa", "other method", "other seed",
                                    "exact layer", "to softmax"])
def test_a_cache_refuses_steps_once_the_attention_changed(change):
    """A cache's states and kept keys hold the positions taken under the attention the
    layers ran then: after restore_exact, another implementation, another method, seed
    or per-layer choice the next step is refused (it went on with the old states, or
    attended to its own positions only); a new cache decodes."""
    model = _llama()
    shf.set_attention(model, "linear", layers=[1] if change == "exact layer" else None,
                      seed=0)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:11], cache=cache)
    if change == "restore_exact":
        shf.restore_exact(model)
    elif change == "sdpa":
        model.set_attn_implementation("sdpa")
    elif change == "other method":
        shf.set_attention(model, "performer", seed=0, num_features=8)
    elif change == "other seed":
        shf.set_attention(model, "linear", seed=1)
    elif change == "exact layer":
        shf.set_attention(model, "linear", layers=[0], seed=0)
    else:
        shf.set_attention(model, "softmax", layers=[0])
    if change in ("restore_exact", "sdpa"):
        match = "runs attn_implementation='sdpa' now, not skyformer"
    else:
        match = "attention layer 0 runs .* now, not the .* this cache took its first step"
    with pytest.raises(ValueError, match=match + ".* start a new cache"):
        model(ids[:, 11:12], cache=cache)
    if change in ("restore_exact", "sdpa"):
        shf.set_attention(model, "linear", seed=0)
    fresh = shf.DecodingCache(model)
    model(ids[:, :10], cache=fresh)
    model(ids[:, 10:11], cache=fresh)


@torch.no_grad()
def test_a_cache_refuses_a_model_it_was_not_made_for():
    """A cache continued by another model of the same shape would mix the two models'
    states; one whose model is gone is refused too."""
    import gc

    model, other = _llama(), _llama()
    for m in (model, other):
        shf.set_attention(m, "linear", seed=0)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    with pytest.raises(ValueError, match="made for another model"):
        other(ids[:, :10], cache=cache)
    orphan = shf.DecodingCache(_llama("skyformer:linear"))
    gc.collect()
    with pytest.raises(ValueError, match="the model this cache was made for no longer exists"):
        other(ids[:, :10], cache=orphan)


@torch.no_grad()
def test_a_step_that_fails_in_one_layer_stops_the_cache(monkeypatch):
    """Layer 0 took the step's positions, layer 1 failed: the layers disagree, so the
    cache refuses the next step rather than decode with a layer missing positions."""
    from skyformer.decoding.state import DecodingState

    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    model(ids[:, :10], cache=cache)
    calls = {"n": 0}
    real = DecodingState.step

    def second_layer_fails(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DecodingState, "step", second_layer_fails)
    with pytest.raises(RuntimeError, match="simulated"):
        model(ids[:, 10:11], cache=cache)
    monkeypatch.setattr(DecodingState, "step", real)
    assert cache.layers[0].state.length == 11 and cache.layers[1].state.length == 10
    for _ in range(2):  # named at the next step and every one after, before any change
        with pytest.raises(RuntimeError, match=r"an earlier step failed in layer 1 "
                           r"\(LlamaAttention\) \(RuntimeError: out of memory \(simulated\)\)"
                           r".* start a new cache"):
            model(ids[:, 10:11], cache=cache)
    assert cache.layers[0].state.length == 11
    cache.reset()
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:11], cache=cache)


@torch.no_grad()
def test_a_step_refused_before_any_layer_took_it_is_undone():
    """A step refused in the first layer (its attention changed since the first step)
    changes nothing: with the attention set back, the cache decodes as one that never
    saw the refused step."""
    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, _ = _prompt()
    cache, control = shf.DecodingCache(model), shf.DecodingCache(model)
    for c in (cache, control):
        model(ids[:, :10], cache=c)
    shf.set_attention(model, "linear", seed=1)
    with pytest.raises(ValueError, match="attention layer 0 runs linear with other options"):
        model(ids[:, 10:11], cache=cache)
    assert [layer.seen for layer in cache.layers] == [10, 10]
    shf.set_attention(model, "linear", seed=0)
    for step in range(10, 13):
        torch.testing.assert_close(model(ids[:, step:step + 1], cache=cache).logits,
                                   model(ids[:, step:step + 1], cache=control).logits,
                                   rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize(("method", "options"), [("performer", {"num_features": 16}),
                                                 ("skyformer", {"num_features": 8,
                                                                "landmark_stride": 4})])
def test_a_llama_decodes_under_autocast_as_its_forward(method, options):
    """Llama's rotary embedding hands the attention float32 q and k beside autocast's
    bfloat16 v: the forward casts them, and a decoding step refused them at the
    prompt. Each step's logits are the full forward's under autocast."""
    model = _llama()
    shf.set_attention(model, method, seed=0, **options)
    ids, _ = _prompt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids[:, :13]).logits
        cache = shf.DecodingCache(model)
        prompt = model(ids[:, :10], cache=cache).logits
        steps = [model(ids[:, i:i + 1], cache=cache).logits for i in range(10, 13)]
    torch.testing.assert_close(torch.cat([prompt, *steps], dim=1), full, rtol=0.05, atol=0.05)


@torch.no_grad()
def test_a_crop_outside_autocast_steps_again_what_the_state_took_inside():
    """The rollback kept Llama's float32 q and k beside bfloat16 v: a crop made after the
    autocast block stepped them again without it, the state refused the mix, and layer 0
    could neither crop nor crop again."""
    model = _llama()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids[:, :12]).logits
        model(ids[:, :10], cache=cache)
        for layer in cache.layers:
            layer.activate_past_recording()
        model(ids[:, 10:13], cache=cache)
    cache.crop(-2)
    assert [layer.seen for layer in cache.layers] == [11, 11]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = model(ids[:, 11:12], cache=cache).logits
    torch.testing.assert_close(step, full[:, 11:], rtol=0.05, atol=0.05)


@torch.no_grad()
def test_a_crop_whose_step_fails_can_be_made_again(monkeypatch):
    """The layer gave up its rollback before stepping the kept positions again: a
    failure there (out of memory) left a layer that could not crop any more."""
    model = _gpt2()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids, _ = _prompt()
    cache, control = shf.DecodingCache(model), shf.DecodingCache(model)
    for c in (cache, control):
        model(ids[:, :10], cache=c)
        for layer in c.layers:
            layer.activate_past_recording()
        model(ids[:, 10:13], cache=c)
    state_class = type(cache.layers[0].state)
    step = state_class.step

    def fails_once(self, *args, **kwargs):
        monkeypatch.setattr(state_class, "step", step)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(state_class, "step", fails_once)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.crop(-2)
    assert [layer.seen for layer in cache.layers] == [13, 13]
    for c in (cache, control):
        c.crop(-2)
    torch.testing.assert_close(model(ids[:, 11:12], cache=cache).logits,
                               model(ids[:, 11:12], cache=control).logits, rtol=0, atol=0)


@torch.no_grad()
def test_a_step_the_state_refuses_in_the_first_layer_is_undone():
    """A step whose dtype the first layer's state refuses (autocast on after a float32
    prompt) changes nothing, as the state promises: the cache took the step as
    failed after some layers had taken it, refused every later one and named
    new_decoding_state, which a model's caller never calls."""
    model = _gpt2()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    full = model(ids[:, :11]).logits
    model(ids[:, :10], cache=cache)
    refused = pytest.raises(ValueError, match=r"torch.bfloat16.*start a new one "
                                              r"\(DecodingCache\(model\), or cache.reset\(\)\)")
    with refused, torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids[:, 10:11], cache=cache)
    assert [layer.seen for layer in cache.layers] == [10, 10]
    torch.testing.assert_close(model(ids[:, 10:11], cache=cache).logits, full[:, 10:],
                               rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_step_that_stopped_between_layers_stops_the_cache(monkeypatch):
    """An error in the model after layer 0's attention took the step (here in its MLP)
    leaves layer 1 a step behind: the next step is refused instead of decoding layer 1
    without those positions."""
    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, _ = _prompt()
    cache = shf.DecodingCache(model)
    model(ids[:, :10], cache=cache)

    def fails(*args):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(model.model.layers[0].mlp, "forward", fails)
    with pytest.raises(RuntimeError, match="simulated"):
        model(ids[:, 10:11], cache=cache)
    monkeypatch.undo()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"stopped between attention layers .* one "
                                               r"layer holds 10 positions, another 1[12]"):
            model(ids[:, 11:12], cache=cache)


@torch.no_grad()
@pytest.mark.parametrize("hide", ["cached keys", "padding shown", "one head"])
def test_a_step_mask_the_state_cannot_follow_is_refused(hide):
    """A step's mask that hides a cached real token (a window), shows a padded one as
    real, or differs between heads is refused as without a cache, not left out: a state
    attends to every real position it took."""
    from skyformer.masks import UnsupportedMaskError

    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, mask = _prompt()
    cache = shf.DecodingCache(model)
    model(ids[:, :20], attention_mask=mask[:, :20], cache=cache)
    step = mask[:, :21].bool()[:, None, None, :].expand(2, 4, 1, 21).clone()
    if hide == "cached keys":
        step[..., :10] = False
    elif hide == "padding shown":
        step[1, ..., :4] = True
    else:
        step[:, 1, :, 5] = False
    with pytest.raises(UnsupportedMaskError, match="heads" if hide == "one head"
                       else "over the positions the cache took"):
        model(ids[:, 20:21], attention_mask=step, cache=cache)
    past = cache.layers[0].past_valid()
    assert past.shape == (2, 20) and past[1, :4].eq(False).all() and past[:, 4:].all()
    assert cache.layers[0].valid.shape == (2, 4)  # kept up to the last padded position
    # the refused step was undone: with the right mask the cache decodes as a fresh one
    fresh = shf.DecodingCache(model)
    model(ids[:, :20], attention_mask=mask[:, :20], cache=fresh)
    torch.testing.assert_close(
        model(ids[:, 20:21], attention_mask=mask[:, :21], cache=cache).logits,
        model(ids[:, 20:21], attention_mask=mask[:, :21], cache=fresh).logits, rtol=0, atol=0)


@torch.no_grad()
def test_the_positions_a_state_took_follow_reorders_and_crops():
    """The record of real positions is reordered with the sequences (beam search) and
    cropped with the positions (assisted generation): the next step's mask, which
    transformers builds from the reordered padding, is taken and decodes as a fresh
    cache."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", seed=0, num_features=8, landmark_stride=4)
    ids, mask = _prompt()
    cache = shf.DecodingCache(model)
    cache.activate_past_recording()
    model(ids[:, :20], attention_mask=mask[:, :20], cache=cache)
    model(ids[:, 20:24], attention_mask=mask[:, :24], cache=cache)
    order = torch.tensor([1, 0])
    cache.batch_select_indices(order)
    cache.crop(-3)
    assert [layer.past_valid().shape for layer in cache.layers] == [(2, 21), (2, 21)]
    got = model(ids[order, 21:22], attention_mask=mask[order, :22], cache=cache).logits
    direct = shf.DecodingCache(model)
    model(ids[order, :21], attention_mask=mask[order, :21], cache=direct)
    want = model(ids[order, 21:22], attention_mask=mask[order, :22], cache=direct).logits
    torch.testing.assert_close(got, want)


@torch.no_grad()
def test_a_step_the_cache_cannot_check_gets_a_sentence():
    """A step without a mask over a cache holding padding (exact attention would attend
    to it, the state does not) and a step of another batch size than the cache's are
    refused in sentences."""
    from skyformer.masks import UnsupportedMaskError

    model = _gpt2()
    shf.set_attention(model, "linear", seed=0)
    ids, mask = _prompt()
    cache = shf.DecodingCache(model)
    model(ids[:, :20], attention_mask=mask[:, :20], cache=cache)
    with pytest.raises(UnsupportedMaskError, match="without an attention mask over a cache "
                                                   "that holds padding"):
        model(ids[:, 20:21], cache=copy.deepcopy(cache))
    with pytest.raises(ValueError, match="this step has 4 sequences, the cache holds 2"):
        model(ids.repeat(2, 1)[:, 20:21], attention_mask=mask.repeat(2, 1)[:, :21],
              cache=copy.deepcopy(cache))
    unpadded = shf.DecodingCache(model)
    model(ids[:1, :20], cache=unpadded)
    model(ids[:1, 20:21], cache=unpadded)  # no padding anywhere: no mask needed


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_step_of_several_tokens_over_transformers_cache_names_the_decoding_cache(build):
    """transformers' own cache hands a step every cached key; several new tokens over
    them (assisted generation, a prompt fed in parts) are refused, and the sentence names
    the cache that decodes them (DecodingCache), with a mask and without one."""
    from transformers import DynamicCache

    from skyformer.masks import UnsupportedMaskError

    model = build()
    shf.set_attention(model, "linear", seed=0)
    ids, mask = _prompt()
    for step_mask in (mask[:, :13], None):
        cache = DynamicCache(config=model.config)
        model(ids[:, :10], attention_mask=None if step_mask is None else mask[:, :10],
              cache=cache)
        with pytest.raises(UnsupportedMaskError, match=r"cached prefix.*skyformer\.hf\."
                                                       r"DecodingCache\(model\)"):
            model(ids[:, 10:13], attention_mask=step_mask, cache=cache)
    cache = shf.DecodingCache(model)  # what the sentence names: it decodes the step
    model(ids[:, :10], attention_mask=mask[:, :10], cache=cache)
    model(ids[:, 10:13], attention_mask=mask[:, :13], cache=cache)


@torch.no_grad()
def test_generate_over_transformers_cache_says_it_is_not_the_causal_forward():
    """generate() without a cache argument decodes over transformers' DynamicCache: each
    step runs the method's non-causal form over the cached keys, which for skyformer
    (its landmarks drawn from the step's queries and keys) is not the causal forward,
    and it did so without a word. A one-query step of a method whose queries are
    independent (linear, performer) is its causal output: no warning there, and the
    tokens of the forward without a cache."""
    import warnings

    model = _llama()
    shf.set_attention(model, "skyformer", seed=0, num_features=8)
    ids = _prompt()[0][:1, :8]
    with pytest.warns(UserWarning, match=r"skyformer decodes over transformers' own "
                                         r"key/value cache.*DecodingCache\(model\)"):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*decodes over transformers")
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       cache=shf.DecodingCache(model))
        shf.set_attention(model, "performer", seed=0, num_features=16)
        cached = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    whole = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           use_cache=False)
    assert torch.equal(cached, whole)


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("method", "options"), [SETTINGS[1], SETTINGS[4]],
                         ids=["performer", "softmax"])
def test_generate_over_a_used_cache_with_other_sequences_names_the_fix(build, method,
                                                                       options):
    """A second generate with a cache that holds another batch (a state layer and an exact
    one alike) is refused in a sentence naming a new cache, before any layer changes:
    a state said 'reorder the state (reorder(index))', exact layers torch's cat error."""
    model = build()
    shf.set_attention(model, method, seed=0, **options)
    ids = _prompt()[0]
    cache = shf.DecodingCache(model)
    first = model.generate(ids[:, 4:], max_new_tokens=3, do_sample=False, pad_token_id=0,
                           cache=cache)
    longer = torch.randint(2, 64, (1, 50), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"step has 1 sequences, the cache holds 2.*"
                                         r"DecodingCache\(model\).*cache\.reset\(\)"):
        model.generate(longer, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache=cache)
    assert [layer.seen for layer in cache.layers] == [first.shape[1] - 1] * 2
    cache.reset()
    assert torch.equal(model.generate(ids[:, 4:], max_new_tokens=3, do_sample=False,
                                      pad_token_id=0, cache=cache), first)


@torch.no_grad()
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("method", "options"), [SETTINGS[1], SETTINGS[4]],
                         ids=["performer", "softmax"])
def test_generate_of_a_new_prompt_over_a_used_cache_names_the_fix(build, method, options):
    """generate feeds the input's positions past the cache's length and pads the mask to
    them with padding: a new padded prompt no longer than the cache becomes a step whose
    every position is padding. Refused in a sentence naming a new cache; the tokens were
    garbage in silence (and a cache reset decodes the prompt as a fresh one). An unpadded
    prompt reaches the model without a mask, as a continuation would: documented only."""
    model = build()
    shf.set_attention(model, method, seed=0, **options)
    ids, mask = _prompt()
    settings = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False,
                "pad_token_id": 0}
    cache = shf.DecodingCache(model)
    first = model.generate(ids, cache=cache, **settings)
    for prompt, prompt_mask in ((ids, mask), (ids[:, 2:], mask[:, 2:])):
        with pytest.raises(ValueError, match=r"none of this step's \d+ positions is a real "
                                             r"token.*DecodingCache\(model\).*reset\(\)"):
            model.generate(prompt, cache=cache, **{**settings, "attention_mask": prompt_mask})
        cache.reset()
        assert torch.equal(model.generate(ids, cache=cache, **settings), first)


@torch.no_grad()
@pytest.mark.parametrize(("method", "options"), [SETTINGS[1], SETTINGS[4]],
                         ids=["performer", "softmax"])
def test_a_prompt_padded_to_a_fixed_width_decodes_in_parts(method, options):
    """Left padding to a fixed width (every sequence padded first) fed in parts: a part
    of padding alone over cached padding is no new prompt over a used cache; the parts
    give the full forward's real rows."""
    model = _llama()
    shf.set_attention(model, method, seed=0, **options)
    ids, mask = _prompt()
    mask[:, :8] = 0
    want = model(ids, attention_mask=mask).logits
    cache = shf.DecodingCache(model)
    got = torch.cat([model(ids[:, a:b], attention_mask=mask[:, :b], cache=cache).logits
                     for a, b in ((0, 4), (4, 8), (8, 30))], dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real])


@torch.no_grad()
def test_generate_of_a_prompt_shorter_than_a_used_cache_names_the_fix():
    """A new prompt at most as long as a used cache less the prompt itself: generate feeds
    none of its positions, and Llama asked the cache for the mask of no positions before
    failing in its reshape ('cannot reshape tensor of 0 elements'); the cache says why."""
    model = _llama()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids = _prompt()[0]
    cache = shf.DecodingCache(model)
    model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache=cache)
    with pytest.raises(ValueError, match=r"no positions after the 37 the cache holds.*"
                                         r"DecodingCache\(model\).*reset\(\)"):
        model.generate(ids[:, 20:], max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache=cache)


@torch.no_grad()
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_generate_of_a_longer_prompt_over_a_used_padded_cache_names_the_fix(padded):
    """A longer new prompt over a cache that holds padding reaches a layer as a step
    whose mask does not show the cached padding (none at all when the prompt is unpadded:
    generate drops an all-ones mask): the sentences name a new cache besides what they
    said ('pass the step's attention mask', which generate would not, or another
    implementation)."""
    from skyformer.masks import UnsupportedMaskError

    model = _llama()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids, mask = _prompt()
    cache = shf.DecodingCache(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                   pad_token_id=0, cache=cache)
    longer = torch.randint(2, 64, (2, 50), generator=torch.Generator().manual_seed(2))
    longer_mask = torch.ones_like(longer)
    longer_mask[0, :3] = 0
    with pytest.raises(UnsupportedMaskError, match=r"new prompt over a used cache.*"
                                                   r"DecodingCache\(model\).*reset\(\)"):
        model.generate(longer, attention_mask=longer_mask if padded else None,
                       max_new_tokens=3, do_sample=False, pad_token_id=0, cache=cache)


@torch.no_grad()
def test_the_mask_checks_read_the_mask_once_per_step_not_once_per_layer(monkeypatch):
    """Every layer of a step gets the same mask and holds the same positions: the checks
    that wait for its values on the host (a stall of the device's queue on a GPU) run at
    the step's first layer only, and the tokens stay those of the full forward."""
    import skyformer.hf.attention as attention
    import skyformer.hf.decoding as decoding

    model = _llama(layers=3)
    shf.set_attention(model, "performer", seed=0, num_features=16)
    expected = _generate(model, None, new=6)
    calls = {"key_valid": 0, "reaches": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(attention, "decoding_key_valid",
                        counted("key_valid", attention.decoding_key_valid))
    monkeypatch.setattr(decoding, "allowed_entries",
                        counted("reaches", decoding.allowed_entries))
    assert torch.equal(_generate(model, shf.DecodingCache(model), new=6), expected)
    assert calls == {"key_valid": 6, "reaches": 5}  # the prompt has no cached positions


def test_step_readings_keep_one_reading_per_mask_of_a_step():
    """Layers of two kinds (sliding-window and full) alternate their masks within a step:
    each mask is read once; a step at other positions reads again."""
    from skyformer.hf.decoding import StepReadings

    readings, reads = StepReadings(), []
    full, window = torch.ones(1, 1, 1, 5, dtype=torch.bool), torch.ones(1, 1, 1, 5,
                                                                          dtype=torch.bool)
    for mask in (full, window, full, window):
        readings.once("key_valid", mask, (5, 1), lambda m=mask: reads.append(m) or len(reads))
    assert len(reads) == 2
    assert readings.once("key_valid", full, (5, 1), lambda: 99) == 1
    assert readings.once("key_valid", full, (6, 1), lambda: 99) == 99
    assert readings.once("other", None, (6, 1), lambda: 7) == 7


@torch.no_grad()
def test_batch_size_reads_the_sequences_held_as_transformers_caches():
    """``cache.batch_size`` (transformers' Cache property) is -1 before the first step and
    then the number of sequences held, following selections and repeats; it raised
    'not consistent across layers' over the layers' methods."""
    model = _gpt2()
    shf.set_attention(model, "skyformer", layers=[1], seed=0, num_features=8,
                      landmark_stride=4)  # layer 0 exact (keys kept), layer 1 a state
    cache = shf.DecodingCache(model)
    assert cache.batch_size == -1
    model(_prompt()[0][:, 4:10], cache=cache)
    assert cache.batch_size == 2
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 6
    cache.batch_select_indices(torch.tensor([5]))
    assert cache.batch_size == 1
    cache.reset()
    assert cache.batch_size == -1


@torch.no_grad()
def test_assisted_generation_over_a_used_padded_cache_is_refused_before_any_token():
    """transformers' assisted generation feeds the whole input again at its first step,
    over the positions a used cache holds (a second turn): with a padded conversation
    its mask then ends before the step does, so the state would take the input's first
    tokens as the next positions and the rest as padding, and the step's last logits
    (all a short generation reads) come from a padded row. Refused at that step, naming
    the fix; a reset cache given the whole conversation decodes it."""
    model = _gpt2()
    shf.set_attention(model, "performer", seed=0, num_features=16)
    ids, mask = _prompt()
    ids, mask = ids[1:], mask[1:]  # left padding
    settings = {"max_new_tokens": 1, "do_sample": False, "pad_token_id": 0}
    cache = shf.DecodingCache(model)
    first = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    turn = torch.cat([first, ids[:, 10:15]], dim=1)
    turn_mask = torch.cat([mask, torch.ones(1, 8, dtype=mask.dtype)], dim=1)
    with pytest.raises(ValueError, match=r"assisted generation.*whole input again.*"
                                         r"DecodingCache\(model\).*reset\(\)"):
        model.generate(turn, attention_mask=turn_mask, cache=cache,
                       prompt_lookup_num_tokens=3, **settings)
    expected = model.generate(turn, attention_mask=turn_mask, use_cache=False, **settings)
    cache.reset()
    assert torch.equal(model.generate(turn, attention_mask=turn_mask, cache=cache,
                                      prompt_lookup_num_tokens=3, **settings), expected)


@torch.no_grad()
def test_a_prompt_prefilled_whole_by_hand_is_named_with_the_prefill_that_works():
    """A cache that holds the whole prompt, then generate given that prompt: generate
    feeds it all again, and the refusal spoke only of a new prompt over a used cache.
    It now names this case and its fix, all but the last token prefilled, which gives
    the tokens of generate over a new cache."""
    model = _llama()
    shf.set_attention(model, "linear", seed=0)
    ids, mask = _prompt()
    call = {"attention_mask": mask, "max_new_tokens": 3, "do_sample": False,
            "pad_token_id": 0}
    cache = shf.DecodingCache(model)
    model(ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match=r"held this whole input already \(30 positions.*"
                                         r"prefill all but its last token"):
        model.generate(ids, cache=cache, **call)
    cache = shf.DecodingCache(model)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate numbers a padded prompt
    model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
          cache=cache)
    expected = model.generate(ids, cache=shf.DecodingCache(model), **call)
    assert torch.equal(model.generate(ids, cache=cache, **call), expected)
