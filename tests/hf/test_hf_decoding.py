"""``skyformer.hf.DecodingCache``: ``generate`` on GPT-2 and Llama decoders built from
configs gives the tokens of the full causal forward (``use_cache=False``), with states
whose size stops growing."""

from __future__ import annotations

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


def _llama(implementation="skyformer"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
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
    model = _gpt2("skyformer:nystromformer")
    ids, mask = _prompt()
    with pytest.raises(Exception, match="nystromformer"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                       cache=shf.DecodingCache(model))
