"""Every tensor a call makes lives on the inputs' device.

A tensor made without ``device=`` lands on torch's default device: the CPU, so that on a
GPU the call copies it over (a copy that waits for the GPU's queue to drain) or fails
on mixed devices. The CUDA cases cannot show this on a CPU-only machine; here the
default device is set to ``meta`` while the inputs stay on the CPU, so that such a
tensor has no data and the first operation mixing it with the inputs fails, naming the
line. Forward and backward of every method (plain, key padding, causal where the
method can, grouped keys, Triton kernels under the interpreter where a method takes
``kernel``), the layer, and the decoding caches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import skyformer
from skyformer import MultiHeadAttention
from tests.conftest import lacks, make_qkv

METHODS = skyformer.list_methods()


@contextmanager
def default_device_meta() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def run_on_meta_default(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()`` and the backward of its output's sum, the default device ``meta``."""
    with default_device_meta():
        out = call()
        if out.requires_grad:
            out.float().sum().backward()
    return out


def _inputs(n: int = 24, kv_heads: int = 2):
    q, k, v = make_qkv(2, 2, n, 16, dtype=torch.float32, seed=3)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    return [t.clone().requires_grad_() for t in (q, k, v)]


def _forms(name: str) -> list[str]:
    method = skyformer.get_method(name)
    forms = ["plain", "key_padding", "grouped"]
    if method.capabilities.has("causal"):
        forms.append("causal")
    if "kernel" in method.option_names():
        forms.append("triton")
    return forms


@pytest.mark.parametrize(("name", "form"),
                         [(name, form) for name in METHODS for form in _forms(name)])
def test_a_call_makes_no_tensor_on_the_default_device(name, form, request):
    if form == "triton":
        request.getfixturevalue("triton_interpreter")
    q, k, v = _inputs(kv_heads=1 if form == "grouped" else 2)
    key = skyformer.random_key(1)
    options = {"generator": key}
    if form == "key_padding":
        mask = torch.ones(2, 24, dtype=torch.bool)
        mask[0, -5:] = False
        options["key_padding_mask"] = mask
        if lacks(name, "mask", lambda: skyformer.attention(q, k, v, name, **options)):
            return
    if form == "causal":
        options["causal"] = True
    if form == "triton":
        options["kernel"] = "triton"

    def call() -> torch.Tensor:
        if form == "grouped":
            return skyformer.scaled_dot_product_attention(q, k, v, method=name,
                                                          enable_gqa=True, **options)
        return skyformer.attention(q, k, v, name, **options)

    out = run_on_meta_default(call)
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    assert all(t.grad is not None and t.grad.device.type == "cpu" for t in (q, k, v))


@pytest.mark.parametrize("name", METHODS)
def test_the_layer_and_its_decoding_cache_make_no_tensor_on_the_default_device(name):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, method=name, seq_len=24)
    x = torch.randn(2, 24, 32, requires_grad=True)
    out = run_on_meta_default(lambda: layer(x))
    assert out.device.type == "cpu" and x.grad is not None
    if not skyformer.get_method(name).capabilities.has("causal"):
        return
    layer = MultiHeadAttention(32, 2, method=name, seq_len=24, causal=True)
    cache = layer.new_cache(generator=skyformer.random_key(2))

    def decode() -> torch.Tensor:
        steps = [layer(x[:, :5], cache=cache)]
        steps += [layer(x[:, t:t + 1], cache=cache) for t in range(5, 8)]
        return torch.cat(steps, dim=1)

    out = run_on_meta_default(decode)
    assert out.shape == (2, 8, 32) and out.device.type == "cpu"


def test_an_int_seed_makes_its_key_on_the_cpu_whatever_the_default_device():
    with default_device_meta():
        key = skyformer.random_key(2**40 + 7)
    assert key.device.type == "cpu"
    assert torch.equal(key, skyformer.random_key(2**40 + 7))


def test_a_seeded_hugging_face_layer_runs_on_a_meta_default_device():
    pytest.importorskip("transformers")
    import skyformer.hf as shf
    from skyformer.hf import attention
    from tests.hf.conftest import tiny_bert

    model = tiny_bert()
    shf.set_attention(model, "skyformer", num_features=8, seed=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).last_hidden_state
    attention._seed_key.cache_clear()  # the key is made under the meta default again
    with default_device_meta():
        out = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_an_empty_input_is_refused_in_the_librarys_sentence_on_a_meta_default_device():
    q = torch.randn(1, 1, 0, 8)
    with default_device_meta(), pytest.raises(ValueError, match="nystrom_softmax: empty"):
        skyformer.attention(q, q, q, "nystrom_softmax")


def test_a_generator_beside_meta_inputs_is_told_to_pass_a_key():
    q = torch.randn(1, 2, 16, 8, device="meta")
    with pytest.raises(ValueError, match=r"random_key\(generator\)\.to\('meta'\)"):
        skyformer.attention(q, q, q, "skyformer", num_features=4,
                            generator=torch.Generator().manual_seed(0))
    key = skyformer.random_key(torch.Generator().manual_seed(0)).to("meta")
    assert skyformer.attention(q, q, q, "skyformer", num_features=4,
                               generator=key).shape == q.shape
