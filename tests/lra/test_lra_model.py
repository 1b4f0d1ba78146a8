"""The LRA model with every registered method, padding, the dual encoder and capabilities."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from skyformer import list_methods, registry
from skyformer.lra.model import LRAClassifier, ModelConfig, resolve_attention_options
from skyformer.ops.softmax import softmax_attention


def _model(method="softmax", segments=1, max_len=12, dropout=0.0, **options):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, num_classes=3, max_len=max_len, segments=segments,
                      dim=16, hidden=32, heads=2, dropout=dropout, attention=method,
                      attention_options=options)
    return LRAClassifier(cfg)


def _batch(b=3, s=1, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 20, (b, s, n), generator=g)
    lengths = torch.randint(3, n + 1, (b, s), generator=g)
    lengths[0] = n
    return tokens, lengths


@pytest.mark.parametrize("method", list_methods())
def test_forward_backward_with_every_method(method):
    model = _model(method, dropout=0.1, **({"num_features": 8}
                   if "num_features" in registry.get_method(method).option_names() else {}))
    tokens, lengths = _batch()
    logits = model(tokens, lengths, generator=torch.Generator().manual_seed(0))
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    logits.logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.encoder.layers[0].attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("method", [m for m in list_methods()
                                    if registry.get_method(m).capabilities.mask])
def test_padding_does_not_change_the_prediction(method):
    """A document padded to the model length gives the logits of the unpadded document
    (masked attention, masked mean pooling; same attention draws for a batch of one)."""
    model = _model(method).eval()
    tokens, _ = _batch(1)
    real = 7
    padded_tokens = tokens.clone()
    padded_tokens[..., real:] = 0
    with torch.no_grad():
        padded = model(padded_tokens, torch.tensor([[real]]),
                       generator=torch.Generator().manual_seed(1))
        short = model(tokens[..., :real], torch.tensor([[real]]),
                      generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(padded, short, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
def test_the_model_compiles_whole_in_a_training_loop(method):
    """``torch.compile(model, fullgraph=True)`` traces the padding mask without reading
    the lengths (a batch with nothing padded takes the mask too, which gives what no mask
    gives), and a new padding is no new graph; reading them failed at the first call."""
    from torch._dynamo.utils import counters

    from skyformer import random_key

    model = _model(method, num_features=8) if method == "skyformer" else _model(method)
    tokens, lengths = _batch()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for step, real in enumerate((5, 9, 12)):
        lengths[-1] = real
        out = compiled(tokens, lengths, random_key(step))
        torch.testing.assert_close(out, model(tokens, lengths, random_key(step)))
        out.sum().backward()
    lengths[:] = 12  # nothing padded
    torch.testing.assert_close(compiled(tokens, lengths, random_key(0)),
                               model(tokens, lengths, random_key(0)))
    assert counters["stats"]["unique_graphs"] == 1


def test_dual_encoder_classifies_u_v_products_and_differences():
    model = _model("softmax", segments=2).eval()
    tokens, lengths = _batch(2, s=2)
    with torch.no_grad():
        logits = model(tokens, lengths)
        enc = model.encoder
        u = torch.stack([enc(tokens[i:i + 1, 0], _mask(lengths[i, 0], 12))[0] for i in range(2)])
        v = torch.stack([enc(tokens[i:i + 1, 1], _mask(lengths[i, 1], 12))[0] for i in range(2)])
        expected = model.head(torch.cat([u, v, u * v, u - v], dim=-1))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert model.head[0].in_features == 64


def _mask(length, n):
    return None if length == n else (torch.arange(n) < length)[None]


def test_mean_pooling_ignores_padding_and_embed_zeroes_it():
    model = _model("softmax").eval()
    tokens, lengths = _batch(3)
    with torch.no_grad():
        for normed in (True, False):
            hidden = model.embed(tokens, lengths, normed=normed)
            assert hidden.shape == (3, 12, 16)
            for i in range(3):
                assert torch.all(hidden[i, lengths[i, 0]:] == 0)
                assert torch.all(hidden[i, :lengths[i, 0]].abs().sum(-1) > 0)
        normed = model.embed(tokens, lengths)
        pooled = model.encoder(tokens[:, 0], (torch.arange(12) < lengths)[:, :])
    torch.testing.assert_close(pooled, normed.sum(1) / lengths.float(), rtol=1e-5, atol=1e-6)


def test_shape_and_length_errors_are_sentences():
    model = _model("softmax", max_len=12)
    with pytest.raises(ValueError, match=r"expected tokens \[B, 1, N\]"):
        model(torch.zeros(2, 12, dtype=torch.long), torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="built for at most 12"):
        model(torch.zeros(1, 1, 13, dtype=torch.long), torch.tensor([[13]]))
    with pytest.raises(ValueError, match="skyformer has no option 'bogus'"):
        _model("skyformer", bogus=1)


@dataclass(frozen=True)
class _FixedConfig:
    max_seq_len: int | None = None
    num_features: int = 4


@pytest.fixture
def fake_methods(monkeypatch):
    """Temporarily registered methods with unusual capabilities; they record their calls."""
    calls: list[dict] = []

    def fixed(q, k, v, *, key_padding_mask=None, generator=None, max_seq_len=None,
              num_features=4):
        calls.append({"max_seq_len": max_seq_len, "mask": key_padding_mask, "dtype": q.dtype})
        if max_seq_len is None or q.shape[2] > max_seq_len:
            raise ValueError("needs max_seq_len >= N")
        return softmax_attention(q, k, v, key_padding_mask=key_padding_mask)

    def unmasked(q, k, v, *, key_padding_mask=None, generator=None):
        calls.append({"mask": key_padding_mask, "q": q.detach().clone(), "dtype": q.dtype})
        return softmax_attention(q, k, v)

    @dataclass(frozen=True)
    class _NoOptions:
        pass

    monkeypatch.setitem(registry._REGISTRY, "_fixed", registry.Method(
        "_fixed", fixed, _FixedConfig,
        registry.Capabilities(target="softmax", fixed_length=True, half_precision=False), "test"))
    monkeypatch.setitem(registry._REGISTRY, "_unmasked", registry.Method(
        "_unmasked", unmasked, _NoOptions, registry.Capabilities(target="softmax", mask=False),
        "test"))
    return calls


def test_fixed_length_methods_get_the_task_length(fake_methods):
    assert resolve_attention_options("_fixed", {}, 12) == {"max_seq_len": 12}
    assert resolve_attention_options("_fixed", {"max_seq_len": 40}, 12) == {"max_seq_len": 40}
    model = _model("_fixed")
    assert model.cfg.attention_options == {"max_seq_len": 12}
    model(*_batch())
    assert {c["max_seq_len"] for c in fake_methods} == {12}


def test_methods_without_mask_support_see_zeroed_padding(fake_methods):
    model = _model("_unmasked").eval()
    tokens, lengths = _batch(2)
    lengths[1] = 5
    with torch.no_grad():
        model(tokens, lengths)
    first = fake_methods[0]
    assert first["mask"] is None
    # q of padded positions is the projection bias only (inputs zeroed before attention)
    bias = model.encoder.layers[0].attn.q_proj.bias.view(2, 8)
    torch.testing.assert_close(first["q"][1, :, 5:], bias[:, None, :].expand(2, 7, 8))


def test_methods_without_half_precision_run_in_float32_under_autocast(fake_methods):
    model = _model("_fixed")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(*_batch())
    assert logits.dtype == torch.bfloat16
    assert {c["dtype"] for c in fake_methods} == {torch.float32}


def test_informer_takes_the_papers_128_features_unless_told_otherwise():
    """Skyformer section 5: "128 features in all methods (except Big Bird)"; Informer's own
    default would let 5 ceil(ln 2000) = 40 queries attend on ListOps."""
    assert resolve_attention_options("informer", {}, 2000)["num_features"] == 128
    assert resolve_attention_options("informer", {"num_features": 16}, 2000)["num_features"] == 16
    assert "num_features" not in resolve_attention_options("softmax", {}, 2000)
    model = LRAClassifier(ModelConfig(vocab_size=10, num_classes=2, max_len=16,
                                      attention="informer"))
    assert model.cfg.attention_options == {"num_features": 128}


@pytest.mark.parametrize(("method", "options", "features"), [
    ("informer[scale=0.1]", {}, 128),  # a variant of another option: the paper's 128 too
    ("informer[num_features=64]", {}, 64),  # the variant's own features stay
    ("informer[num_features=64]", {"num_features": 16}, 16),
])
def test_an_informer_variant_takes_the_papers_features_unless_it_sets_them(
        method, options, features):
    """A variant ran with Informer's own default (40 attending queries at 2000 tokens)
    where its method and --option ran with the paper's 128."""
    resolved = resolve_attention_options(method, options, 2000)
    bound = registry.get_method(method).bind(seq_len=2000, **resolved)
    assert bound.options()["num_features"] == features


@pytest.mark.parametrize("method", ["skyformer", "nystromformer", "linformer", "informer",
                                    "performer", "reformer"])
def test_every_method_of_table_one_but_bigbird_runs_with_128_features(method):
    """Skyformer section 5: "the number of features to be 128 used in all methods (except
    Big Bird)", at each task's length."""
    for length in (1024, 2000, 4000):
        assert resolve_attention_options(method, {}, length).get(
            "num_features", registry.get_method(method).bind().options()["num_features"]) == 128


@pytest.mark.parametrize(("method", "options"), [
    ("reformer", {"shared_qk": True}),
    ("performer", {"scale": 0.03125, "feature_redraw_interval": None, "eps": 1e-4}),
    ("linformer", {"share_kv": True}),
    ("informer", {"factor": 17}),
])
def test_the_reference_settings_docs_name_are_options_of_the_methods(method, options):
    """docs/lra.md names these to bring a baseline closer to the reference code's."""
    resolved = resolve_attention_options(method, options, 2000)
    assert {k: resolved[k] for k in options} == options
    model = _model(method, **options)
    tokens, lengths = _batch()
    assert torch.isfinite(model(tokens, lengths)).all()


@pytest.mark.parametrize("method", ["softmax", "performer"])
def test_a_model_built_on_meta_is_initialised_by_reset_parameters(method):
    """Built under ``torch.device("meta")``, then ``to_empty`` and ``reset_parameters()``
    of every module that has one, the model equals one built normally under the same
    seed: the embedding tables too (N(0, 0.02^2) as the reference LRA code draws them,
    not nn.Embedding's N(0, 1))."""
    options = {"num_features": 8} if method == "performer" else {}
    built = _model(method, **options)
    with torch.device("meta"):
        model = _model(method, **options)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    want = built.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert built.encoder.tokens.weight.std() < 0.05
