"""The paths beside the plain call, on CUDA: causal attention for every method that has
it, decoding step by step, packed variable-length batches, ``torch.compile`` and
``skyformer lra train`` with bf16 autocast.

Each check runs on the CPU in float32 too (``devices.py``'s tolerances, against float64
on the CPU with the same random key), so the check itself is exercised in CI; the CUDA
cases are skipped unless ``SKYFORMER_TEST_CUDA=1``.
"""

from __future__ import annotations

import json

import pytest
import torch

import skyformer
from skyformer import get_method, random_key
from skyformer.decoding import new_decoding_state
from tests.conftest import gen, make_qkv
from tests.decoding.test_decoding_states import CASES as DECODING_CASES
from tests.decoding.test_decoding_states import STEPS, _decode
from tests.devices import (
    TOLERANCES,
    assert_matches_reference,
    backward_with_weights,
    cuda_only,
    device_leaves,
    relative_error,
)
from tests.gpu.test_cuda_methods import _call
from tests.reliability.test_host_reads import CAUSAL

# (device, dtype): float32 on the CPU checks the checks; the GPU in float32 and bfloat16
TARGETS = [("cpu", torch.float32),
           pytest.param("cuda", torch.float32, marks=cuda_only),
           pytest.param("cuda", torch.bfloat16, marks=cuda_only)]
IDS = ["cpu-float32", "cuda-float32", "cuda-bfloat16"]


@pytest.mark.parametrize(("device", "dtype"), TARGETS, ids=IDS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("method", CAUSAL)
def test_causal_equals_cpu_float64(method, masked, device, dtype):
    q, k, v = make_qkv(2, 2, 70, 16, seed=12)
    mask = None
    if masked:  # one right-padded and one left-padded sequence
        mask = torch.ones(2, 70, dtype=torch.bool)
        mask[0, 51:] = False
        mask[1, :9] = False
    ref, ref_grads = _call(method, q, k, v, mask, "cpu", torch.float64, causal=True)
    out, grads = _call(method, q, k, v, mask, device, dtype, causal=True)
    assert out.device.type == device
    if mask is not None:  # rows of padded queries are not compared (no keys before them)
        keep = mask[:, None, :, None].to(out.device)
        out, ref = out * keep, ref * keep.cpu()
    assert_matches_reference(out, grads, ref, ref_grads, dtype)


@pytest.mark.parametrize(("device", "dtype"), TARGETS, ids=IDS)
@pytest.mark.parametrize(("method", "options"), DECODING_CASES, ids=lambda c: str(c))
def test_decoding_steps_equal_the_causal_forward_in_float64(method, options, device, dtype):
    """A prompt then steps of 1 to 64 tokens on the device, against the full causal
    forward in float64 on the CPU: the states live on the device and keep its dtype."""
    n = 20 + sum(STEPS)
    q, k, v = make_qkv(2, 2, n, 8, seed=1)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded prompt
    bound = get_method(method).bind(**options)
    key = random_key(3)
    full = bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    state = new_decoding_state(bound, generator=key)
    steps = [t.to(device, dtype) for t in (q, k, v)]
    decoded = _decode(state, *steps, valid.to(device), 20, STEPS)
    assert decoded.device.type == device and decoded.dtype == dtype
    real = valid[:, None, :, None]
    assert relative_error(decoded.cpu() * real, full * real) < TOLERANCES[dtype]


@pytest.mark.parametrize(("device", "dtype"), TARGETS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", ["softmax", "kernelized", "skyformer", "performer",
                                    "nystromformer"])
def test_packed_sequences_equal_cpu_float64(method, causal, device, dtype):
    """Three sequences (17, 40 and 5 tokens) packed as FlashAttention's varlen API takes
    them; lengths on the device, as transformers' packed batches hold them."""
    if causal and not get_method(method).capabilities.causal:
        pytest.skip(f"{method} has no causal variant")
    q, k, v = make_qkv(1, 2, 62, 16, seed=13)
    lengths = torch.tensor([0, 17, 57, 62], dtype=torch.int32)

    def call(on, as_dtype):
        leaves = device_leaves((q, k, v), on, as_dtype)
        out = skyformer.scaled_dot_product_attention(
            *leaves, is_causal=causal, method=method, cu_seqlens=lengths.to(on),
            max_seqlen=40, generator=random_key(gen(6)))
        backward_with_weights(out)
        return out, [t.grad for t in leaves]

    ref, ref_grads = call("cpu", torch.float64)
    out, grads = call(device, dtype)
    assert out.device.type == device and out.shape == ref.shape
    assert_matches_reference(out, grads, ref, ref_grads, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_a_generators_key_draws_as_the_generator(device):
    """``skyformer.random_key(g)``, which the sentences for torch.compile and activation
    checkpointing ask for, drew on the CPU and failed for a CUDA generator."""
    key = random_key(torch.Generator(device).manual_seed(0))
    assert key.device.type == device
    q, k, v = (t.to(device) for t in make_qkv(1, 2, 16, 8, seed=0, dtype=torch.float32))
    out = skyformer.attention(q, k, v, method="skyformer", num_features=4, generator=key)
    again = skyformer.attention(q, k, v, method="skyformer", num_features=4,
                                generator=torch.Generator(device).manual_seed(0))
    assert torch.equal(out, again)


@cuda_only
@pytest.mark.parametrize("method", ["kernelized", "skyformer", "performer"])
def test_compiled_layer_equals_the_eager_layer(method):
    """``torch.compile(fullgraph=True)`` of a layer (inductor writes Triton kernels around
    the library's own), forward and backward, padded, float32. The CPU's inductor cases
    are ``tests/pt2``'s (their C++ compile takes a minute there)."""
    device = "cuda"
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(dim=32, num_heads=2, method=method).to(device)
    x = torch.randn(2, 48, 32, device=device)
    mask = torch.ones(2, 48, dtype=torch.bool, device=device)
    mask[1, 40:] = False
    key = random_key(5, device=device)

    def run(module):
        layer.zero_grad()
        xs = x.clone().requires_grad_(True)
        out = module(xs, key_padding_mask=mask, generator=key)
        backward_with_weights(out * mask[..., None])
        return out, [xs.grad, *(p.grad for p in layer.parameters())]

    eager, eager_grads = run(layer)
    torch._dynamo.reset()
    compiled, compiled_grads = run(torch.compile(layer, fullgraph=True))
    tol = TOLERANCES[torch.float32]
    assert relative_error(compiled * mask[..., None], eager * mask[..., None]) < tol
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        assert relative_error(got, want) < 5 * tol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_lra_train_runs_with_bf16_autocast(device, tmp_path, capsys):
    """``skyformer lra train`` as a user runs it, generated ListOps, bf16 autocast."""
    from skyformer.cli import main

    src, cache, out = tmp_path / "src", tmp_path / "cache", tmp_path / "run"
    assert main(["lra", "generate", "listops", "--out", str(src), "--train", "64",
                 "--dev", "16", "--test", "16", "--max-depth", "2", "--max-args", "4",
                 "--min-length", "3", "--max-length", "7"]) == 0
    assert main(["lra", "prepare", "listops", "--src", str(src), "--cache", str(cache),
                 "--max-len", "8"]) == 0
    assert main(["lra", "train", "listops", "--attn", "skyformer", "--option",
                 "num_features=4", "--steps", "4", "--eval-every", "2", "--batch-size", "16",
                 "--precision", "bf16", "--device", device, "--cache", str(cache),
                 "--out", str(out), "--no-tensorboard", "--quiet"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 4 and result["config"]["precision"] == "bf16"
    assert result["environment"]["device"].startswith(device)
    assert result["peak_memory_kind"] in (
        ("cuda max_memory_allocated",) if device == "cuda"
        else ("peak RSS of the training steps", "max RSS"))
    assert torch.isfinite(torch.tensor(result["test_loss"]))
    assert 0 <= result["test_accuracy"] <= 1
    capsys.readouterr()
