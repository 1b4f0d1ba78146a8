"""Every method in the PyTorch 2 stack: autocast, torch.compile(fullgraph), torch.func,
torch.export (docs/pytorch2.md holds the table as measured).

Parametrised over ``list_methods()``: a new method is covered as soon as it registers.
Tiny shapes; compile uses the ``eager`` and ``aot_eager`` backends (dynamo's tracing and
AOT autograd, the parts that refuse data-dependent code) and one inductor case per
family (``INDUCTOR_CASES``), whose C++ compile takes seconds per method on CPU. Each
test records its cell; ``tests/pt2/conftest.py`` prints the counts after the run. A
method registered with ``mask=False`` runs unpadded (``mask_for``).
"""

from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch

import skyformer
from skyformer import MultiHeadAttention, get_method, list_methods, random_key
from tests.conftest import make_qkv, mask_for

METHODS = list_methods()
SEQ_LEN = 32  # the length fixed-length methods (Linformer) are bound for
# One method per family whose inductor compile takes seconds on 2 CPU cores: exact,
# Gaussian kernel, feature map, Nystrom. The sampling and LSH methods unroll into graphs
# whose C++ compile takes minutes there (docs/pytorch2.md); they are compiled with the
# aot_eager backend only.
INDUCTOR_CASES = ("softmax", "kernelized", "linear", "nystromformer")


TORCH_BEFORE_2_13 = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)


def call(method, q, k, v, mask=None, *, key=None, **options):
    bound = get_method(method).bind(seq_len=SEQ_LEN, **options)
    return bound(q, k, v, key_padding_mask=mask, generator=key)


def padded(b, n, real):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, real:] = False
    return mask


@pytest.mark.parametrize("method", METHODS)
def test_autocast_bf16_returns_bf16_close_to_float32(method, matrix):
    matrix("autocast", method)
    q, k, v = make_qkv(2, 2, 24, 8, dtype=torch.float32)
    valid, key = padded(2, 24, 19), random_key(0)
    mask = mask_for(method, valid)
    if not get_method(method).capabilities.half_precision:  # autocast would cast to bf16
        with torch.autocast("cpu", torch.bfloat16), pytest.raises(
                skyformer.CapabilityError, match=rf"^{method} cannot take float16/bfloat16"):
            call(method, q, k, v, mask, key=key)
    else:
        with torch.autocast("cpu", torch.bfloat16):
            out = call(method, q, k, v, mask, key=key)
        assert out.dtype == torch.bfloat16  # as SDPA under autocast
        # The same method in float32 on the bf16-rounded inputs: bf16 keeps 8 bits.
        ref = call(method, *(t.bfloat16().float() for t in (q, k, v)), mask, key=key)
        real = valid[:, None, :, None].expand_as(ref)
        error = (out.float() - ref)[real].abs().max() / ref[real].abs().max()
        assert error < 0.05
    # float64 is left as it is by autocast, as torch's SDPA leaves it
    doubles = [t.double() for t in (q, k, v)]
    with torch.autocast("cpu", torch.bfloat16):
        out64 = call(method, *doubles, mask, key=key)
    torch.testing.assert_close(out64, call(method, *doubles, mask, key=key), rtol=0, atol=0)


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.half_precision])
def test_compile_under_autocast_gives_eager_gradients(method, matrix):
    """A call compiled under bf16 autocast, differentiated after the autocast block: the
    methods' Functions ran their backward under the forward's autocast there, and the
    float32 accumulations in it failed to compile (torch's default backward_pass_autocast
    = "same_as_forward"; Skyformer, nystrom_softmax, skyformer_adaptive, the multipole
    methods). Under it the call now compiles with finite gradients, and warns where the
    method's config has float32 steps; with "off" (eager's semantics), and under either
    setting for a method without such steps, the gradients equal eager ones."""
    matrix("autocast + compile (aot_eager), fwd + bwd", method)
    import torch._functorch.config as functorch_config

    bound = get_method(method).bind(seq_len=160)
    q, k, v = make_qkv(2, 2, 160, 8, dtype=torch.float32)
    mask, key = mask_for(method, padded(2, 160, 128)), random_key(1)

    def plain(q, k, v):
        return bound(q, k, v, key_padding_mask=mask, generator=key)

    def with_grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with torch.autocast("cpu", torch.bfloat16):
            out = fn(*leaves)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), *(t.grad for t in leaves)

    torch._dynamo.reset()
    with functorch_config.patch(backward_pass_autocast="same_as_forward"), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cast = with_grads(torch.compile(plain, fullgraph=True, backend="aot_eager"))
    assert all(torch.isfinite(t).all() for t in cast)
    float32_steps = getattr(bound.config, "FLOAT32_STEPS", True)
    assert any("backward_pass_autocast" in str(w.message) for w in caught) == float32_steps
    torch._dynamo.reset()
    with functorch_config.patch(backward_pass_autocast="off"):
        got = with_grads(torch.compile(plain, fullgraph=True, backend="aot_eager"))
    eager = with_grads(plain)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, eager, strict=True):
        torch.testing.assert_close(a, b, msg=lambda text, name=name: f"{name}: {text}")
    if not float32_steps:
        for name, a, b in zip(("output", "dq", "dk", "dv"), cast, eager, strict=True):
            torch.testing.assert_close(a, b, msg=lambda text, name=name: f"{name}: {text}")


def test_compile_under_autocast_warns_where_torch_casts_the_backward():
    """torch's default traces a compiled backward under the forward's autocast, which runs
    the methods' float32 steps' derivatives in bf16: one warning per traced graph names
    the setting, and the call still compiles (Skyformer's Gaussian products had failed
    there: their backward ran under autocast, and its float32 accumulation refused the
    bf16 products)."""
    import torch._functorch.config as functorch_config

    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 40, 8, dtype=torch.float32))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: skyformer.attention(
        q, k, v, "skyformer", num_features=8), fullgraph=True, backend="aot_eager")
    with functorch_config.patch(backward_pass_autocast="same_as_forward"):
        with (pytest.warns(UserWarning, match=r"backward_pass_autocast = 'off' before compiling"),
              torch.autocast("cpu", torch.bfloat16)):
            out = compiled(q, k, v)
        out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("n", [24, 160])  # 160: every method approximates
@pytest.mark.parametrize("method", METHODS)
def test_compile_fullgraph_equals_eager(method, n, matrix):
    """aot_eager: dynamo's graph capture and AOT autograd's functionalisation, without
    inductor's code generation; outputs and gradients (Dynamo 2.11 traced an in-place
    accumulation into a Function's output so that the outputs were right and every
    gradient wrong)."""
    matrix(f"compile (aot_eager, N = {n})", method)
    _assert_compiled_equals_eager(get_method(method).bind(seq_len=n), n)


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.causal])
def test_compile_fullgraph_causal_equals_eager(method, matrix):
    """The causal forms under aot_eager, outputs and gradients, with key padding."""
    matrix("compile causal (aot_eager)", method)
    _assert_compiled_equals_eager(get_method(method).bind(seq_len=24, causal=True), 24)


def _assert_compiled_equals_eager(bound, n: int) -> None:
    """``bound`` compiled (fullgraph, aot_eager) against eager on a padded batch at
    length ``n``: output and the gradients of q, k, v."""
    q, k, v = make_qkv(2, 2, n, 8, dtype=torch.float32)
    mask, key = mask_for(bound.name, padded(2, n, n * 4 // 5)), random_key(1)

    def plain(q, k, v):
        return bound(q, k, v, key_padding_mask=mask, generator=key)

    def with_grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), *(t.grad for t in leaves)

    torch._dynamo.reset()
    got = with_grads(torch.compile(plain, fullgraph=True, backend="aot_eager"))
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, with_grads(plain), strict=True):
        torch.testing.assert_close(a, b, msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.parametrize("method", [m for m in METHODS if get_method(m).capabilities.causal])
def test_compile_causal_backward_after_a_recompile_for_a_new_length(method):
    """A second length below one chunk of 64 tokens makes dynamo recompile with the
    length symbolic; aot_eager's backward graph then recorded k's gradient, which a
    transposed layout reaches in the causal form, as contiguous, and a reshape of it
    as a view, which failed at run time (skyformer and nystrom_softmax)."""
    bound = get_method(method).bind(seq_len=64, causal=True)
    key = random_key(2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: bound(q, k, v, generator=key), fullgraph=True,
                             backend="aot_eager")
    for n in (20, 30):
        q, k, v = make_qkv(2, 1, n, 8, dtype=torch.float32, seed=n)
        grads = []
        for fn in (compiled, lambda q, k, v: bound(q, k, v, generator=key)):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            (fn(*leaves) * torch.linspace(-1, 1, 8)).sum().backward()
            grads.append([t.grad for t in leaves])
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_compile_fullgraph_of_self_attention_on_one_tensor(method, matrix):
    """``attention(x, x, x)`` compiled whole: dynamo traces no autograd Function given
    one tensor twice (the landmark gathers of Q and K took it so), outputs and x's
    gradient as eager."""
    matrix("compile attention(x, x, x) (aot_eager)", method)
    bound = get_method(method).bind(seq_len=24)
    x = make_qkv(2, 2, 24, 8, dtype=torch.float32)[0]
    key = random_key(4)

    def plain(x):  # no padding: a mask made the methods gather q and k apart
        return bound(x, x, x, generator=key)

    def with_grad(fn):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), leaf.grad

    torch._dynamo.reset()
    got = with_grad(torch.compile(plain, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got, with_grad(plain), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method", [
    pytest.param("skyformer", marks=pytest.mark.xfail(
        TORCH_BEFORE_2_13, strict=True,
        reason="its default core below the landmark count (N < 64 here) is Razavi's steps, "
        "whose products into views of their store torch 2.11's dynamo fixes the length "
        "at (docs/gpu-record.md)")),
    "softmax",
])
def test_a_new_length_recompiles_once(method):
    """After one new length dynamo recompiles with N symbolic, and that graph takes the
    lengths after it (forward and backward): the Gaussian products' loop over row
    chunks had fixed N in the graph, so each length compiled again."""
    from torch._dynamo.utils import counters

    key = random_key(6)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: call(method, q, k, v, key=key), fullgraph=True,
                             backend="eager")  # dynamo fixes the lengths, not AOT autograd
    for n in (40, 48, 56):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n, 8, dtype=torch.float32))
        out = compiled(q, k, v)
        out.sum().backward()
        torch.testing.assert_close(out, call(method, q, k, v, key=key))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("method", [
    "skyformer",
    pytest.param("nystromformer", marks=pytest.mark.xfail(
        TORCH_BEFORE_2_13, strict=True,
        reason="torch 2.11's dynamo fixes the length at Razavi's steps' products into "
        "views of their store (linalg/pinv.py), forward and backward: each length "
        "below the landmark count compiles again (docs/gpu-record.md)")),
])
def test_lengths_below_the_landmark_count_recompile_once(method):
    """Below ``num_features`` every token is a landmark, so the m x m core's size follows
    N: after one new length the graph takes N symbolic there too, forward and backward
    (Skyformer with ``kernel="torch"``; Nystromformer's Razavi steps, ``linalg/pinv.py``;
    Skyformer's default core: ``test_a_new_length_recompiles_once``)."""
    from torch._dynamo.utils import counters

    key = random_key(6)
    options = {"kernel": "torch"} if method == "skyformer" else {}
    bound = get_method(method).bind(seq_len=SEQ_LEN, num_features=64, **options)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: bound(q, k, v, generator=key), fullgraph=True,
                             backend="eager")
    for n in (24, 32, 40):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n, 8, dtype=torch.float32))
        out = compiled(q, k, v)
        out.sum().backward()
        torch.testing.assert_close(out, bound(q, k, v, generator=key))
    assert counters["stats"]["unique_graphs"] == 2


def test_informer_recompiles_only_where_its_sample_count_changes():
    """Informer samples c ceil(ln N) keys: lengths with the same ceil(ln N) (149 to 403)
    share one symbolic graph after the first recompilation. ``math.log`` of the length
    specialised it, so every length compiled again until dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    key = random_key(6)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: call("informer", q, k, v, key=key),
                             fullgraph=True, backend="eager")
    for n in (160, 164, 168, 172):
        q, k, v = make_qkv(1, 1, n, 4, dtype=torch.float32)
        torch.testing.assert_close(compiled(q, k, v), call("informer", q, k, v, key=key))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("method", ["skyformer_multipole", "softmax_multipole"])
def test_the_multipole_methods_recompile_once_while_their_near_field_is_one_group(method):
    """The near field's loop over groups of blocks fixed N in the graph (every length
    compiled again until dynamo's recompile limit); one group takes no loop."""
    from torch._dynamo.utils import counters

    key = random_key(6)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: call(method, q, k, v, key=key), fullgraph=True,
                             backend="eager")
    for n in (160, 168, 176):
        q, k, v = make_qkv(1, 1, n, 4, dtype=torch.float32)
        torch.testing.assert_close(compiled(q, k, v), call(method, q, k, v, key=key))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("method", ["softmax", "skyformer", "performer"])
def test_compile_fullgraph_with_dynamic_shapes_forward_and_backward(method):
    """``dynamic=True`` makes even a default float symbolic: the option checks compare
    rather than call ``math.isfinite``, which dynamo cannot trace on one. It made
    log2(e), read from a module global inside the Gaussian products' autograd Function,
    a symbolic input too, which Dynamo failed to carry into the Function when the
    inputs record gradients (``lift_tracked_freevar_to_input``): the Skyformer family
    (skyformer, skyformer_adaptive, nystrom_softmax) now reads it from a literal
    (``kernel_offsets.log2e``)."""
    q, k, v = make_qkv(2, 2, 24, 8, dtype=torch.float32)
    key = random_key(5)
    torch._dynamo.reset()

    def attend(q, k, v):
        return skyformer.scaled_dot_product_attention(q, k, v, method=method, generator=key)

    compiled = torch.compile(attend, fullgraph=True, backend="eager", dynamic=True)
    for n in (24, 20):
        inputs = [t[:, :, :n].detach().requires_grad_() for t in (q, k, v)]
        out, expected = compiled(*inputs), attend(*inputs)
        torch.testing.assert_close(out, expected)
        for got, want in zip(torch.autograd.grad(out.sum(), inputs),
                             torch.autograd.grad(expected.sum(), inputs), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("reformer", "kdeformer")])
def test_jit_trace_replays_other_keys(method, matrix):
    """torch.jit.trace of the default (PyTorch) path, replayed with another key, equals
    eager: the Gaussian products' Functions, whose buffers the tracer could not record,
    give way to plain operators, and the token budgets are capped on the traced lengths
    (TorchScript's sizes are tensors, which the options' checks refused)."""
    import warnings

    matrix("torch.jit.trace", method)
    q, k, v = make_qkv(1, 2, 24, 8, dtype=torch.float32)

    def attend(q, k, v, key):
        return call(method, q, k, v, key=key)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(attend, (q, k, v, random_key(1)), check_trace=False)
    for seed in (1, 2):
        torch.testing.assert_close(traced(q, k, v, random_key(seed)),
                                   attend(q, k, v, random_key(seed)))


@pytest.mark.parametrize("function", [skyformer.softmax_attention,
                                      skyformer.kernelized_attention,
                                      skyformer.skyformer_attention,
                                      skyformer.nystrom_softmax_attention])
def test_compile_fullgraph_of_the_direct_functions(function):
    """The functions called by name (not through ``attention`` or ``bind``) compile too:
    their wrapper once split its keyword arguments with a set operation that Dynamo
    2.11 could not trace."""
    q, k, v = make_qkv(2, 2, 24, 8, dtype=torch.float32)
    mask, key = padded(2, 24, 19), random_key(2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: function(q, k, v, key_padding_mask=mask,
                                                      generator=key),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v),
                               function(q, k, v, key_padding_mask=mask, generator=key))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_compile_inductor_causal_nystrom_softmax_with_padding_equals_eager():
    """Inductor (torch 2.13, CPU) gave the keys of the last, partial causal chunk the
    wrong chunk's shift (an expand then a slice), so one compiled training step with a
    padding mask put NaN into the q and k gradients; eager and aot_eager were right."""
    q, k, v = make_qkv(2, 2, 80, 8, dtype=torch.float32)  # chunks of 64: one partial
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[1, :9] = False
    bound = get_method("nystrom_softmax").bind(seq_len=80, causal=True, num_features=8,
                                               landmark_stride=4)

    def step(q, k, v):
        return bound(q, k, v, key_padding_mask=mask, generator=random_key(0))

    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.autograd.grad(torch.compile(step)(*leaves).sum(), leaves)
    eager = torch.autograd.grad(step(*leaves).sum(), leaves)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize("method", INDUCTOR_CASES)
def test_compile_inductor_equals_eager(method, matrix):
    matrix("compile (inductor)", method)
    q, k, v = make_qkv(1, 2, 16, 8, dtype=torch.float32)
    key = random_key(2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: call(method, *a[:3], key=a[3]), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, key), call(method, q, k, v, key=key),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_func_grad_equals_autograd(method, matrix):
    matrix("func.grad", method)
    q, k, v = make_qkv(2, 2, 16, 8)
    mask, key = mask_for(method, padded(2, 16, 12)), random_key(3)

    def loss(q):
        return call(method, q, k, v, mask, key=key).square().sum()

    grad = torch.func.grad(loss)(q)
    q_leaf = q.clone().requires_grad_(True)
    loss(q_leaf).backward()
    torch.testing.assert_close(grad, q_leaf.grad)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "selective"])
def test_activation_checkpointing_gives_the_gradients_of_the_plain_call(method, mode, matrix):
    """``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing): the forward
    runs again in the backward pass. Non-reentrant checkpointing allows one unpack of
    each saved tensor (the fused backward passes read them once); selective
    checkpointing keeps the outputs of the operators it is told to save."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    matrix(f"checkpoint {mode}", method)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, SEQ_LEN, 8))
    mask, key = mask_for(method, padded(2, SEQ_LEN, 20)), random_key(3)

    def attend(q, k, v):
        return call(method, q, k, v, mask, key=key)

    want = torch.autograd.grad(attend(q, k, v).square().sum(), (q, k, v))
    options = {"use_reentrant": mode == "reentrant"}  # reentrant: .backward() only
    if mode == "selective":  # save the matrix products, recompute the rest
        aten = torch.ops.aten
        products = (aten.mm.default, aten.bmm.default, aten.addmm.default,
                    aten.baddbmm.default)

        def policy(ctx, op, *args, **kwargs):
            return (CheckpointPolicy.MUST_SAVE if op in products
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        options["context_fn"] = lambda: create_selective_checkpoint_contexts(policy)
    checkpoint(attend, q, k, v, **options).square().sum().backward()
    for a, e in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(
    "method", [m for m in METHODS if get_method(m).capabilities.randomized])
def test_activation_checkpointing_refuses_a_torch_generator(method, reentrant):
    """The recomputed forward would take the next draw of a ``torch.Generator`` (the
    checkpoint restores torch's global generator only): other landmarks, the gradient
    of another function. It is refused in a sentence naming the key that replays."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, APPROXIMATE_LEN, 8))
    bound, generator = get_method(method).bind(seq_len=APPROXIMATE_LEN), torch.Generator()

    def attend(q, k, v):
        return bound(q, k, v, generator=generator)

    out = checkpoint(attend, q, k, v, use_reentrant=reentrant)
    with pytest.raises(ValueError, match=r"recomputes the forward.*random_key"):
        out.square().sum().backward()


@pytest.mark.parametrize("method", METHODS)
def test_func_vmap_equals_loop(method, matrix):
    matrix("func.vmap", method)
    q, k, v = make_qkv(2, 2, 16, 8)
    mask, key = mask_for(method, padded(2, 16, 12)), random_key(4)
    qs = torch.stack([q, q.flip(-1)])

    def f(q):
        return call(method, q, k, v, mask, key=key)

    torch.testing.assert_close(torch.func.vmap(f)(qs), torch.stack([f(x) for x in qs]))


@pytest.mark.parametrize("method", ["skyformer", "reformer", "performer"])
def test_func_vmap_randomness_modes_of_a_draw_made_inside(method):
    """A key drawn inside ``vmap`` (``generator`` None or a ``torch.Generator``):
    ``randomness="error"`` (vmap's default) is refused in a sentence naming the key
    drawn outside; ``"same"`` draws once, as the plain call after the same seed;
    ``"different"`` draws a key per mapped element. ``jacfwd`` and ``hessian`` map too."""
    q, k, v = make_qkv(1, 1, 160, 4)  # 160: every method on its approximate path
    qs = torch.stack([q, q])

    def f(q, generator=None):
        return call(method, q, k, v, key=generator)

    for generator in (None, torch.Generator().manual_seed(0)):
        with pytest.raises(RuntimeError, match=rf"^{method}: .*randomness='error'.*"
                           r"generator=skyformer\.random_key\("):
            torch.func.vmap(f, in_dims=(0, None))(qs, generator)
    with pytest.raises(RuntimeError, match=r"vmap \(which jacfwd and hessian run too\)"):
        torch.func.hessian(lambda q: f(q).sum())(q)  # refused at its first draw
    torch.manual_seed(3)
    same = torch.func.vmap(f, randomness="same")(qs)
    torch.manual_seed(3)
    torch.testing.assert_close(same, f(q).expand_as(same))
    different = torch.func.vmap(f, randomness="different")(qs)
    assert not torch.equal(different[0], different[1])


@pytest.mark.parametrize("method", METHODS)
def test_func_ensemble_of_layers_equals_a_loop(method, matrix):
    """``functional_call`` with another layer's parameters and buffers equals that layer,
    and an ensemble (``stack_module_state`` and ``vmap``) equals the loop over its
    members, in training mode (Performer counts its calls in its stacked buffers)."""
    matrix("func.functional_call ensembles of MHA", method)
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    mask, key = mask_for(method, padded(2, 16, 12)), random_key(2)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(MultiHeadAttention(8, 2, method, seq_len=16).double().train())
    loop = [copy.deepcopy(member) for member in members]
    base = copy.deepcopy(members[0]).to("meta")

    def f(params, buffers, x):
        return torch.func.functional_call(base, (params, buffers), (x, mask), {"generator": key})

    one = f(dict(members[1].named_parameters()), dict(members[1].named_buffers()), x)
    torch.testing.assert_close(one, loop[1](x, mask, generator=key))
    params, buffers = torch.func.stack_module_state(members)
    for _ in range(2):
        ensemble = torch.func.vmap(f, in_dims=(0, 0, None))(params, buffers, x)
        torch.testing.assert_close(
            ensemble, torch.stack([member(x, mask, generator=key) for member in loop]))


@pytest.mark.parametrize(
    "method", [m for m in METHODS if get_method(m).capabilities.randomized])
def test_func_vmap_over_random_keys_equals_loop(method, matrix):
    """Several draws of a randomised method in one call: ``vmap`` over a stack of keys
    ``[R, 2]`` (the k-means of the adaptive and multipole methods sums into slots)."""
    matrix("func.vmap keys", method)
    q, k, v = make_qkv(2, 2, 16, 8)
    mask = mask_for(method, padded(2, 16, 12))
    keys = torch.stack([random_key(seed) for seed in range(3)])

    def f(key):
        return call(method, q, k, v, mask, key=key)

    torch.testing.assert_close(torch.func.vmap(f)(keys), torch.stack([f(key) for key in keys]))


@pytest.mark.parametrize("method", METHODS)
def test_func_jvp_agrees_with_reverse_mode(method, matrix):
    """<u, J t> by ``torch.func.jvp`` equals <J^T u, t> by autograd for tangents of q,
    k and v at once: forward mode gives the derivative that reverse mode (tested
    against the naive references) gives, through masks and fixed random draws."""
    matrix("func.jvp", method)
    q, k, v = make_qkv(2, 2, 16, 8)
    mask, key = mask_for(method, padded(2, 16, 12)), random_key(5)
    tangents = make_qkv(2, 2, 16, 8, seed=1)
    u = torch.randn(2, 2, 16, 8, dtype=q.dtype, generator=torch.Generator().manual_seed(2))

    def f(q, k, v):
        return call(method, q, k, v, mask, key=key)

    out, forward = torch.func.jvp(f, (q, k, v), tangents)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reverse = torch.autograd.grad(f(*leaves), leaves, u)
    torch.testing.assert_close(out, f(q, k, v))
    torch.testing.assert_close((u * forward).sum(),
                               sum((g * t).sum() for g, t in zip(reverse, tangents, strict=True)))


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.causal])
def test_func_jvp_agrees_with_reverse_mode_in_causal_calls(method, matrix):
    """The identity above for causal calls over two chunks of 64 with padding: the
    running-maximum shifts of causal nystrom_softmax were computed under no_grad, which
    leaves forward-mode tangents on, and its directional derivatives came out wrong
    (reverse mode was right)."""
    matrix("func.jvp causal", method)
    n = 80
    q, k, v = make_qkv(2, 1, n, 8)
    mask, key = mask_for(method, padded(2, n, 70)), random_key(4)
    bound = get_method(method).bind(seq_len=n, causal=True)
    tangents = make_qkv(2, 1, n, 8, seed=1)
    u = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2))

    _assert_jvp_agrees_with_reverse_mode(
        lambda q, k, v: bound(q, k, v, key_padding_mask=mask, generator=key), (q, k, v),
        tangents, u)


def _assert_jvp_agrees_with_reverse_mode(f, primals: tuple, tangents: tuple,
                                         u: torch.Tensor) -> None:
    """<u, J t> by ``torch.func.jvp`` of ``f`` equals <J^T u, t> by autograd."""
    _, forward = torch.func.jvp(f, primals, tangents)
    leaves = [t.clone().requires_grad_(True) for t in primals]
    reverse = torch.autograd.grad(f(*leaves), leaves, u)
    torch.testing.assert_close((u * forward).sum(),
                               sum((g * t).sum() for g, t in zip(reverse, tangents, strict=True)))


APPROXIMATE_LEN = 160  # every method approximates here (at 16 several are exact)


@pytest.mark.parametrize("method", METHODS)
def test_func_jvp_agrees_with_reverse_mode_on_the_approximate_path(method, matrix):
    """The dot-product identity of the test above at a length where no method falls
    back to exact attention: sampling probabilities, LSH blocks, clusters and
    projections get no forward-mode derivative that reverse mode does not give."""
    matrix("func.jvp (N = 160)", method)
    q, k, v = make_qkv(2, 1, APPROXIMATE_LEN, 8)
    mask, key = mask_for(method, padded(2, APPROXIMATE_LEN, 120)), random_key(8)
    bound = get_method(method).bind(seq_len=APPROXIMATE_LEN)
    tangents = make_qkv(2, 1, APPROXIMATE_LEN, 8, seed=1)
    u = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2))

    _assert_jvp_agrees_with_reverse_mode(
        lambda q, k, v: bound(q, k, v, key_padding_mask=mask, generator=key), (q, k, v),
        tangents, u)


@pytest.mark.parametrize("method", METHODS)
def test_anomaly_detection_passes_and_gives_the_same_gradients(method, matrix):
    """``torch.autograd.set_detect_anomaly(True)`` raises where a backward node returns
    NaN: rows that attend to no key (padding, a query alone in its LSH bucket) must
    not make one, even where a later ``where`` drops it."""
    matrix("detect_anomaly (N = 160)", method)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 1, APPROXIMATE_LEN, 4))
    mask, key = padded(1, APPROXIMATE_LEN, 150), random_key(1)
    bound = get_method(method).bind(seq_len=APPROXIMATE_LEN)

    def gradients():
        out = bound(q, k, v, key_padding_mask=mask, generator=key)
        return torch.autograd.grad(out.sin().sum(), (q, k, v))

    want = gradients()
    with torch.autograd.set_detect_anomaly(True):
        got = gradients()
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("method", ["softmax", "skyformer"])
def test_forward_mode_through_compiled_functions(method):
    """jvp inside a compiled function (fullgraph), and a function compiled outside
    forward mode then called under it (dynamo guards on the open dual level and
    recompiles): both equal eager jvp."""
    q, k, v = make_qkv(1, 2, 16, 8, dtype=torch.float32)
    tangent = make_qkv(1, 2, 16, 8, dtype=torch.float32, seed=1)[0]
    key = random_key(9)

    def f(q):
        return call(method, q, k, v, key=key)

    _, want = torch.func.jvp(f, (q,), (tangent,))
    inside = torch.compile(lambda q, t: torch.func.jvp(f, (q,), (t,))[1],
                           backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(inside(q, tangent), want)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(q)  # first compiled outside forward mode
    with torch.autograd.forward_ad.dual_level():
        out = compiled(torch.autograd.forward_ad.make_dual(q, tangent))
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(out).tangent, want)


@pytest.mark.parametrize("method", METHODS)
def test_func_jacfwd_equals_reverse_jacobian(method, matrix):
    """``torch.func.jacfwd`` (vmap over jvp) equals the Jacobian row by row from
    reverse mode (``torch.autograd.functional.jacobian``)."""
    matrix("func.jacfwd", method)
    q, k, v = make_qkv(1, 1, 8, 4)
    mask, key = mask_for(method, padded(1, 8, 6)), random_key(6)

    def f(q):
        return call(method, q, k, v, mask, key=key)

    torch.testing.assert_close(torch.func.jacfwd(f)(q),
                               torch.autograd.functional.jacobian(f, q))


def _jacobian_case(method, seed):
    """(f, (q, k, v)) on the approximate path, key padding: f gives a few output rows
    (12 rows of the Jacobian, one per entry)."""
    q, k, v = make_qkv(1, 1, APPROXIMATE_LEN, 4)
    mask, key = mask_for(method, padded(1, APPROXIMATE_LEN, 150)), random_key(seed)
    bound = get_method(method).bind(seq_len=APPROXIMATE_LEN)

    def f(q, k, v):
        return bound(q, k, v, key_padding_mask=mask, generator=key)[..., 5:8, :]

    return f, (q, k, v)


@pytest.mark.parametrize("method", METHODS)
def test_func_jacrev_equals_reverse_jacobian(method, matrix):
    """``torch.func.jacrev`` (vmap over vjp: the backward passes run on batched
    cotangents) equals the Jacobian from plain reverse mode, on the approximate path."""
    matrix("func.jacrev (N = 160)", method)
    f, (q, k, v) = _jacobian_case(method, seed=11)
    got = torch.func.jacrev(f, argnums=(0, 1, 2))(q, k, v)
    want = torch.autograd.functional.jacobian(f, (q, k, v))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_vectorized_jacobian_equals_the_jacobian_row_by_row(method, matrix):
    """``torch.autograd.functional.jacobian(..., vectorize=True)`` runs the backward
    passes on gradients batched by the legacy vmap (``autograd.grad(...,
    is_grads_batched=True)``), whose batching has no rule for the fused backward passes'
    ``out=`` and in-place products. Equal to the Jacobian taken row by row."""
    matrix("autograd jacobian(vectorize=True) (N = 160)", method)
    f, (q, k, v) = _jacobian_case(method, seed=13)
    got = torch.autograd.functional.jacobian(f, (q, k, v), vectorize=True)
    want = torch.autograd.functional.jacobian(f, (q, k, v))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_per_sample_gradients_by_vmap_of_grad_equal_a_loop(method, matrix):
    """``vmap(grad(loss))`` over a batch, each sequence with its own padding (per-sample
    gradients, as differentially private training computes them): the backward passes
    run on batched tensors, saved ones included. Equal to one autograd call per sample."""
    matrix("vmap(grad) per sample (N = 160)", method)
    q, k, v = make_qkv(3, 1, APPROXIMATE_LEN, 4)
    mask = torch.ones(3, APPROXIMATE_LEN, dtype=torch.bool)
    mask[1, 130:] = False
    mask[2, :7] = False
    mask = mask_for(method, mask)
    key = random_key(12)
    bound = get_method(method).bind(seq_len=APPROXIMATE_LEN)

    def loss(q, k, v, mask):
        out = bound(q[None], k[None], v[None], generator=key,
                    key_padding_mask=None if mask is None else mask[None])
        return out.square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)),
                                 in_dims=(0, 0, 0, None if mask is None else 0))
    got = per_sample(q, k, v, mask)
    for i in range(3):
        leaves = [t[i].clone().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(loss(*leaves, None if mask is None else mask[i]), leaves)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[i], w)


def test_reverse_over_reverse_in_torch_func_is_refused_in_a_sentence():
    """``jacrev`` of ``jacrev`` would differentiate a fused backward pass."""
    q, k, v = make_qkv(1, 1, 40, 4)
    key = random_key(13)

    def loss(q):
        return call("skyformer", q, k, v, key=key, num_features=8).square().sum()

    with pytest.raises(RuntimeError, match=r"torch\.func\.hessian"):
        torch.func.jacrev(torch.func.jacrev(loss))(q)


@pytest.mark.parametrize("method", METHODS)
def test_func_hessian_equals_differences_of_gradients(method, matrix):
    """``torch.func.hessian`` (jacfwd over jacrev: the method runs under both) applied
    to a direction equals the central difference of autograd's gradient along it."""
    matrix("func.hessian", method)
    q, k, v = make_qkv(1, 1, 6, 3)
    mask, key = mask_for(method, padded(1, 6, 5)), random_key(7)
    direction = make_qkv(1, 1, 6, 3, seed=1)[0]

    def loss(q):
        return call(method, q, k, v, mask, key=key).square().sum()

    def grad(q):
        leaf = q.clone().requires_grad_(True)
        return torch.autograd.grad(loss(leaf), leaf)[0]

    step = 1e-5
    want = (grad(q + step * direction) - grad(q - step * direction)) / (2 * step)
    hessian = torch.func.hessian(loss)(q).reshape(q.numel(), q.numel())
    got = (hessian @ direction.reshape(-1)).reshape(q.shape)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_double_backward_is_right_or_refused_never_silently_wrong(method, matrix):
    """``torch.autograd.functional.hvp`` (reverse over reverse, ``create_graph=True``)
    equals forward over reverse, or raises; a fused backward pass used to return a
    Hessian-vector product that ignored its saved inputs."""
    matrix("autograd hvp (right or refused)", method)
    q, k, v = make_qkv(1, 1, APPROXIMATE_LEN, 4)
    direction = make_qkv(1, 1, APPROXIMATE_LEN, 4, seed=1)[0]
    bound, key = get_method(method).bind(seq_len=APPROXIMATE_LEN), random_key(10)

    def loss(q):
        return bound(q, k, v, generator=key).square().sum()

    want = torch.func.jvp(torch.func.grad(loss), (q,), (direction,))[1]
    try:
        _, got = torch.autograd.functional.hvp(loss, q, direction)
    except RuntimeError as error:
        if "skyformer" in str(error):
            assert "torch.func.hessian" in str(error)
            assert "torch.func.jvp of torch.func.grad" in str(error)
        return
    torch.testing.assert_close(got, want)


class _Layer(torch.nn.Module):
    """A model holding one ``MultiHeadAttention``, its random key an input."""

    def __init__(self, method):
        super().__init__()
        self.attention = MultiHeadAttention(32, 2, method=method, seq_len=SEQ_LEN)

    def forward(self, x, mask, key):
        return self.attention(x, mask, generator=key)


@pytest.mark.parametrize("method", METHODS)
def test_meta_tensors_give_the_shapes_forward_and_backward(method, matrix):
    """Meta tensors (shapes, no values: shape inference, ``FlopCounterMode`` of a model
    built under ``torch.device("meta")``): torch raises when asked for the autocast
    state of the meta device, and values cannot be read there, so the data-independent
    paths run, as under a tracer."""
    from torch.utils.flop_counter import FlopCounterMode

    matrix("meta device", method)
    q, k, v = (torch.empty(2, 2, APPROXIMATE_LEN, 8, device="meta", requires_grad=True)
               for _ in range(3))
    mask = mask_for(method, torch.ones(2, APPROXIMATE_LEN, dtype=torch.bool, device="meta"))
    out = get_method(method).bind(seq_len=APPROXIMATE_LEN)(q, k, v, key_padding_mask=mask)
    out.sum().backward()
    assert (out.shape, out.device.type, q.grad.shape) == (q.shape, "meta", q.shape)
    with torch.device("meta"):
        layer = MultiHeadAttention(16, 2, method, seq_len=APPROXIMATE_LEN)  # training mode
        x = torch.empty(2, APPROXIMATE_LEN, 16)
    with FlopCounterMode(display=False) as flops:
        assert layer(x, key_padding_mask=mask).shape == x.shape
    assert flops.get_total_flops() > 0


@pytest.mark.parametrize("method", METHODS)
def test_export_multihead_attention(method, matrix):
    matrix("export", method)
    torch.manual_seed(0)
    model = _Layer(method).eval()
    x, mask, key = torch.randn(2, 24, 32), mask_for(method, padded(2, 24, 18)), random_key(5)
    program = torch.export.export(model, (x, mask, key))
    out = program.module()(x, mask, key)
    torch.testing.assert_close(out, model(x, mask, key))
    out.sum().backward()  # the exported graph differentiates (no out= writes in it)


class _Functional(torch.nn.Module):
    """``skyformer.attention`` of one method as a module, for ``torch.export``."""

    def __init__(self, method, **options):
        super().__init__()
        self.method, self.options = method, options

    def forward(self, q, k, v, mask, key):
        return skyformer.attention(q, k, v, self.method, key_padding_mask=mask,
                                   generator=key, **self.options)


def _export_symbolic_length(module, masked, n=12):
    """``module`` exported from ``[1, 2, n, 4]`` inputs (float64; with ``masked`` the
    last token padded, else no mask) with the sequence length a ``torch.export.Dim``."""
    length = torch.export.Dim("N", min=2, max=1024)
    q, k, v = make_qkv(1, 2, n, 4, dtype=torch.float64)
    mask = padded(1, n, n - 1) if masked else None
    return torch.export.export(module, (q, k, v, mask, random_key(4)),
                               dynamic_shapes=({2: length}, {2: length}, {2: length},
                                               {1: length} if masked else None, None))


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_export_with_a_symbolic_length_equals_eager(method, masked, matrix):
    """A ``torch.export.Dim`` for N: the program equals eager on both sides of the
    landmark cap (4 per side: more than 3 tokens, fewer than 12): the slots a short
    sequence cannot fill are dead, and the index arithmetic has no size export cannot
    prove."""
    matrix("export, symbolic N", f"{method} ({'padded' if masked else 'unpadded'})")
    module = _Functional(method, num_features=8)
    program = _export_symbolic_length(module, masked).module()
    for n in (3, 12, 21):
        q, k, v = make_qkv(1, 2, n, 4, dtype=torch.float64)
        mask = padded(1, n, n - 1) if masked else None
        torch.testing.assert_close(program(q, k, v, mask, random_key(7)),
                                   module(q, k, v, mask, random_key(7)))


@pytest.mark.parametrize("masked", [True, False])
def test_export_of_learned_linformer_projections_with_a_length_up_to_their_width(masked,
                                                                                 matrix):
    """A Dim reaching max_seq_len: the first N columns of E and F are contiguous only at
    the full width, a case split export refused ("N != max_seq_len"); the program uses
    them whole against keys padded to the width, equal to eager up to it, and trains."""
    matrix("export, symbolic N", f"linformer[max_seq_len] ({'padded' if masked else 'unpadded'})")
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, method="linformer", num_features=4,
                               max_seq_len=16).double().eval()
    length = torch.export.Dim("N", min=2, max=16)
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    mask = padded(2, 12, 9) if masked else None
    program = torch.export.export(layer, (x, mask), dynamic_shapes=(
        {1: length}, {1: length} if masked else None)).module()
    for n in (3, 11, 16):
        x = torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True)
        mask = padded(2, n, n - 1) if masked else None
        got = program(x, mask)
        torch.testing.assert_close(got, layer(x, mask))
        got.sum().backward()
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("method", [m for m in METHODS
                                    if get_method(m).capabilities.fixed_shapes_because])
def test_export_with_a_symbolic_length_is_refused_where_control_flow_follows_it(method,
                                                                              matrix):
    """Block counts and sample sizes that follow N: a sentence naming the fix, not
    export's "Constraints violated" about a guard deep inside torch."""
    matrix("export, symbolic N refused", method)
    with pytest.raises(skyformer.CapabilityError, match=rf"^{method} cannot be exported "
                       r"with a symbolic sequence length .* static length"):
        _export_symbolic_length(_Functional(method), masked=True)


@pytest.mark.parametrize("method", [m for m in METHODS if get_method(m).capabilities.causal
                                    and not get_method(m).capabilities.exact])
def test_export_of_a_causal_form_with_a_symbolic_length_equals_eager(method, matrix):
    """The causal forms run by chunks of 64 positions, whose count and last partial
    chunk follow N ("Constraints violated (N)"): while exporting, the chunks are gathered
    rows with two chunks of padding more. Below one chunk, at one chunk and at two and a
    partial one, a sequence with left padding and a hole beside one without, the
    program equals eager, gradients included."""
    matrix("export, symbolic N", f"{method} causal")
    options = {"num_features": 6} if "num_features" in get_method(method).bind().options() \
        else {}
    module = _Functional(method, causal=True, **options)
    length = torch.export.Dim("N", min=2, max=1024)

    def inputs(n):
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, :2] = False
        if n > 3:
            mask[0, n // 2] = False  # a hole
        return (*make_qkv(2, 2, n, 4, dtype=torch.float64), mask, random_key(4))

    program = torch.export.export(module, inputs(12), dynamic_shapes=(
        {2: length}, {2: length}, {2: length}, {1: length}, None)).module()
    for n in (3, 64, 150):
        q, k, v, mask, key = inputs(n)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        got, want = program(*leaves, mask, key), module(*leaves, mask, key)
        torch.testing.assert_close(got, want)
        weights = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad((got * weights).sum(), leaves),
                        torch.autograd.grad((want * weights).sum(), leaves), strict=True):
            torch.testing.assert_close(a, b)


def test_export_with_a_symbolic_length_names_the_minimum_of_a_capped_budget():
    """Nystromformer's landmarks are capped by N: a Dim that lets N fall below them
    gets the minimum that avoids the cap (the option was refused as 'a positive
    integer, got s0'), and a Dim with that minimum exports and equals eager."""
    module = _Functional("nystromformer", num_features=4)
    with pytest.raises(skyformer.CapabilityError,
                       match=r"num_features=4 .* fall to 2.*Dim\('N', min=4\)"):
        _export_symbolic_length(module, masked=True)
    length = torch.export.Dim("N", min=4, max=1024)
    q, k, v = make_qkv(1, 2, 12, 4, dtype=torch.float64)
    program = torch.export.export(module, (q, k, v, padded(1, 12, 11), random_key(4)),
                                  dynamic_shapes=({2: length}, {2: length}, {2: length},
                                                  {1: length}, None)).module()
    for n in (4, 9):
        q, k, v = make_qkv(1, 2, n, 4, dtype=torch.float64)
        mask, key = padded(1, n, n - 1), random_key(4)
        torch.testing.assert_close(program(q, k, v, mask, key), module(q, k, v, mask, key))


@pytest.mark.parametrize("method", METHODS)
def test_multihead_attention_compiles_fullgraph(method, matrix):
    matrix("MHA compile", method)
    torch.manual_seed(0)
    model = _Layer(method)
    x, mask, key = torch.randn(2, 24, 32), mask_for(method, padded(2, 24, 18)), random_key(6)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, mask, key), model(x, mask, key))


def test_torch_generator_under_compile_gets_a_sentence():
    q, k, v = make_qkv(1, 1, 16, 8, dtype=torch.float32)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, g: skyformer.attention(
        q, k, v, "skyformer", num_features=4, generator=g), fullgraph=True, backend="eager")
    # dynamo wraps the library's TypeError; its sentence is in the message
    with pytest.raises(Exception, match=r"generator=skyformer\.random_key\(g\)"):
        f(q, k, v, torch.Generator().manual_seed(0))


def test_exporting_is_true_under_torch_export_only():
    """The library's fast paths give way only under torch.export. PyTorch before 2.12
    evaluates ``torch.compiler.is_exporting()`` as True inside every torch.compile graph;
    ``exporting()`` reads export's own flag, so compiled code keeps its fast paths.
    (With torch 2.13 the compiled probe would pass with ``is_exporting()`` too: the
    regression shows with ``scripts/check_versions.sh``, torch 2.11.)"""
    from skyformer.linalg.functional_ops import exporting

    def probe(x):
        return x + float(exporting())

    class Probe(torch.nn.Module):
        def forward(self, x):
            return probe(x)

    x = torch.zeros(2)
    assert probe(x).sum() == 0
    assert torch.compile(probe, backend="aot_eager", fullgraph=True)(x).sum() == 0
    exported = torch.export.export(Probe(), (x,))
    assert exported.module()(x).sum() == 2
