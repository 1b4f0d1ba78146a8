"""Decoding states (``skyformer.decoding``): step by step, outputs equal the full causal
forward with the same random key; memory constant where promised; clear errors."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from skyformer import MultiHeadAttention
from skyformer.decoding import CONSTANT_MEMORY, new_decoding_state
from skyformer.registry import CapabilityError, get_method
from skyformer.sketch.rng import random_key
from tests.conftest import make_qkv

CASES = [
    ("linear", {}),
    ("performer", {"num_features": 16}),
    ("skyformer", {"num_features": 10, "landmark_stride": 7}),
    ("skyformer", {"num_features": 10, "landmark_stride": 7, "causal_local": False}),
    ("nystrom_softmax", {"num_features": 10, "landmark_stride": 7}),
    ("nystrom_softmax", {"num_features": 10, "landmark_stride": 7, "causal_local": False}),
    ("softmax", {}),
    ("kernelized", {}),
]
# Chunk sizes of the steps after a 20-token prompt: single tokens, a block crossing the
# 64-position chunk boundary and several landmark slots, a whole chunk.
STEPS = [1, 1, 3, 40, 1, 64, 1, 7]


def _padding(b: int, n: int) -> torch.Tensor:
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded prompt
    return valid


def _decode(state, q, k, v, valid, prompt, steps):
    outs = [state.step(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt],
                       None if valid is None else valid[:, :prompt])]
    t = prompt
    for n in steps:
        sl = slice(t, t + n)
        outs.append(state.step(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                               None if valid is None else valid[:, sl]))
        t += n
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
def test_steps_equal_full_causal_forward(method, options, padded):
    n = 20 + sum(STEPS)
    q, k, v = make_qkv(2, 2, n, 8, seed=1)
    valid = _padding(2, n) if padded else None
    bound = get_method(method).bind(**options)
    key = random_key(3)
    full = bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    decoded = _decode(new_decoding_state(bound, generator=key), q, k, v, valid, 20, STEPS)
    torch.testing.assert_close(decoded, full, rtol=1e-10, atol=1e-10)


def test_performer_after_a_prompt_of_a_large_key_decodes_as_the_forward():
    """A one-token prompt whose key has a large norm (as a first token's key in some
    language models), then ordinary keys: their log-scales lie about 1000 apart, beyond
    float64's exp range; the state's sums came out NaN at the second step, and every row
    after it."""
    q, k, v = make_qkv(2, 2, 30, 8, seed=4)
    k[:, :, :1] *= 30
    bound = get_method("performer").bind(num_features=16)
    key = random_key(3)
    full = bound.replace(causal=True)(q, k, v, generator=key)
    decoded = _decode(new_decoding_state(bound, generator=key), q, k, v, None, 1, [1, 3, 25])
    torch.testing.assert_close(decoded, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_without_the_local_part_left_padding_decodes_as_the_forward(method):
    """causal_local=False: the chunks still set nystrom_softmax's bound of unreliable
    rows (and the order of the sums). The decoding state ends them at 64 real tokens,
    so the forward must too: here row 136 (rank 126) fell back to the prefix mean in the
    forward chunked by positions and not in decoding, or the other way round."""
    n, prompt = 140, 70
    q, k, v = make_qkv(1, 2, n, 4, seed=1, scale=3.0)
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, :10] = False  # left padding
    bound = get_method(method).bind(num_features=6, landmark_stride=3, causal_local=False)
    key = random_key(3)
    full = bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    decoded = _decode(new_decoding_state(bound, generator=key), q, k, v, valid, prompt,
                      [1] * (n - prompt))
    torch.testing.assert_close(decoded, full, rtol=1e-10, atol=1e-10)


def test_skyformer_without_stride_keeps_the_prompts():
    """Without landmark_stride the state takes ceil(prompt / m): the prompt's outputs
    are the default forward's, the rest the forward with that stride fixed."""
    m, prompt, n = 6, 40, 100
    q, k, v = make_qkv(1, 2, n, 8, seed=2)
    bound = get_method("skyformer").bind(num_features=m)
    key = random_key(5)
    decoded = _decode(new_decoding_state(bound, generator=key), q, k, v, None, prompt,
                      [1] * (n - prompt))
    fixed = bound.replace(causal=True, landmark_stride=math.ceil(prompt / m))
    torch.testing.assert_close(decoded, fixed(q, k, v, generator=key), rtol=1e-10, atol=1e-10)
    prompt_only = bound.replace(causal=True)(q[:, :, :prompt], k[:, :, :prompt],
                                             v[:, :, :prompt], generator=key)
    torch.testing.assert_close(decoded[:, :, :prompt], prompt_only, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_without_stride_each_padded_prompt_keeps_its_own(method):
    """Prompts of 30 and 50 real tokens in one left- and right-padded batch: each takes
    ceil(its real tokens / m) (the forward's default for it), so the prompt's outputs
    are the default forward's and the rest the forward with that element's stride."""
    m, prompt, n = 6, 50, 110
    q, k, v = make_qkv(2, 2, n, 8, seed=7)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[0, 20:40] = False  # a hole in the prompt: 30 real tokens
    bound = get_method(method).bind(num_features=m)
    key = random_key(4)
    decoded = _decode(new_decoding_state(bound, generator=key), q, k, v, valid, prompt,
                      [1] * 20 + [40])
    for b, real in enumerate((30, 50)):
        fixed = bound.replace(causal=True, landmark_stride=math.ceil(real / m))
        full = fixed(q, k, v, key_padding_mask=valid, generator=key)
        torch.testing.assert_close(decoded[b], full[b], rtol=1e-10, atol=1e-10)
    default = bound.replace(causal=True)(q[:, :, :prompt], k[:, :, :prompt],
                                         v[:, :, :prompt], key_padding_mask=valid[:, :prompt],
                                         generator=key)
    torch.testing.assert_close(decoded[:, :, :prompt], default, rtol=0, atol=0)


@pytest.mark.parametrize("method", CONSTANT_MEMORY)
def test_memory_stops_growing(method):
    """After every landmark slot is revealed (m R positions) the state's size is the same
    at every later length."""
    nystrom = method in ("skyformer", "nystrom_softmax")
    options = {"num_features": 8, "landmark_stride": 4} if nystrom else {}
    q, k, v = make_qkv(1, 2, 400, 8, seed=3)
    state = new_decoding_state(get_method(method).bind(**options), generator=random_key(0))
    sizes = {}
    for t in range(400):
        state.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t + 1 in (128, 192, 400):  # chunk boundaries and a position inside a chunk
            sizes[t + 1] = state.nbytes()
    assert sizes[128] == sizes[192], sizes
    assert sizes[400] <= sizes[192] + 63 * 2 * (8 + 1 + 8) * 8, sizes  # + one partial chunk


@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
def test_a_state_holds_no_view_of_a_steps_tensors(method, options):
    """After a prompt and after a step of many positions the state's tensors own their
    storage: a slice of a step's [B, H, n, .] prefix sums (or of its [B, H, n] marks)
    kept alive the whole step's tensor, O(n) bytes beyond what ``nbytes`` counts,
    in a state promised constant."""
    q, k, v = make_qkv(2, 2, 300, 8, seed=3)
    state = new_decoding_state(get_method(method).bind(**options), generator=random_key(0))
    for sl in (slice(0, 150), slice(150, 151), slice(151, 300)):
        state.step(*(t[:, :, sl].clone() for t in (q, k, v)))  # each step's own tensors
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in vars(state).values() if isinstance(t, torch.Tensor)}
        assert sum(storages.values()) <= state.nbytes(), (sl, {
            name: (t.untyped_storage().nbytes(), t.numel() * t.element_size())
            for name, t in vars(state).items() if isinstance(t, torch.Tensor)})


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
@pytest.mark.parametrize("stride", [4, 8], ids=["all-revealed", "slot-unrevealed"])
def test_memory_stops_growing_with_a_finished_sequence(method, stride):
    """A sequence padded from some step on (finished after 40 tokens, kept in the
    batch) leaves its last partial chunk in the buffers, not every position since (the
    chunks end at each element's own 64th real token); with stride 8 its last landmark
    slot (up to rank 63) is never revealed, and the earlier keys are kept only for the
    elements with a slot to come, not the others' later chunks. The state stops
    growing and the outputs stay the forward's."""
    q, k, v = make_qkv(2, 2, 400, 8, seed=3)
    valid = torch.ones(2, 400, dtype=torch.bool)
    valid[0, 40:] = False
    bound = get_method(method).bind(num_features=8, landmark_stride=stride)
    key = random_key(0)
    state = new_decoding_state(bound, generator=key)
    outs = [state.step(q[:, :, :30], k[:, :, :30], v[:, :, :30], valid[:, :30])]
    sizes = {}
    for t in range(30, 400):
        sl = slice(t, t + 1)
        outs.append(state.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], valid[:, sl]))
        if t + 1 in (192, 384):  # the same position in sequence 1's chunk
            sizes[t + 1] = state.nbytes()
    assert sizes[192] == sizes[384], sizes
    assert state.chunk_k.shape[2] <= 40 + 63
    assert bool(state.revealed[0].all()) == (stride == 4)
    full = bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", CONSTANT_MEMORY)
def test_a_variant_decodes_as_its_method(method):
    """A variant name (``"linear[eps=1e-5]"``) gets its method's constant-size state,
    not the kept keys a method without one gets."""
    variant = get_method(f"{method}[scale=0.5]" if method != "linear" else "linear[eps=1e-5]")
    assert type(new_decoding_state(variant.bind())) is \
        type(new_decoding_state(get_method(method).bind()))


def test_keys_state_grows():
    q, k, v = make_qkv(1, 2, 80, 8, seed=4)
    state = new_decoding_state(get_method("softmax").bind(), generator=random_key(0))
    state.step(q[:, :, :40], k[:, :, :40], v[:, :, :40])
    small = state.nbytes()
    state.step(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:])
    assert state.nbytes() > small


@pytest.mark.parametrize(("method", "options"), CASES[:3], ids=lambda c: str(c))
def test_reorder_follows_the_selected_sequences(method, options):
    q, k, v = make_qkv(2, 2, 90, 8, seed=5)
    bound = get_method(method).bind(**options)
    key = random_key(1)
    state = new_decoding_state(bound, generator=key)
    state.step(q[:, :, :30], k[:, :, :30], v[:, :, :30])
    index = torch.tensor([1, 1, 0])  # beam search: keep sequence 1 twice, then 0
    state.reorder(index)
    q2, k2, v2 = (t[index] for t in (q, k, v))
    out = torch.cat([state.step(q2[:, :, t:t + 1], k2[:, :, t:t + 1], v2[:, :, t:t + 1])
                     for t in range(30, 90)], dim=2)
    # each kept sequence goes on as it was (its landmark draw included)
    full = bound.replace(causal=True)(q, k, v, generator=key)[index][:, :, 30:]
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)


def test_refusals_name_the_problem():
    with pytest.raises(CapabilityError, match="nystromformer cannot decode"):
        new_decoding_state(get_method("nystromformer").bind())
    state = new_decoding_state(get_method("linear").bind())
    q, k, v = make_qkv(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"\[B, H, n, D\]"):
        state.step(q[0], k, v)
    with pytest.raises(ValueError, match="key_valid must be a \\[B, n\\]"):
        state.step(q, k, v, torch.ones(2, 5, dtype=torch.bool))
    state.step(q, k, v)
    with pytest.raises(ValueError, match="holds 2 sequences, the step has 1"):
        state.step(q[:1], k[:1], v[:1])
    for index, message in ((torch.tensor([True, False]), r"\[B'\] int64 tensor"),
                           (torch.tensor([[0, 1]]), r"\[B'\] int64 tensor"),
                           (torch.tensor([0, 2]), r"holds 2 sequences \(0 to 1\), got 2"),
                           (torch.tensor([-1]), r"holds 2 sequences \(0 to 1\), got -1")):
        with pytest.raises(ValueError, match=message):
            state.reorder(index)
    assert state.batch_size() == 2  # a refused reorder changes nothing


@pytest.mark.parametrize("given", ["skyformer", get_method("skyformer")])
def test_a_name_or_an_unbound_method_is_refused_with_the_call_that_binds_it(given):
    with pytest.raises(TypeError, match=r"takes a bound method, get_method\('skyformer'\)"
                       r"\.bind\(\.\.\.\)"):
        new_decoding_state(given)
    state = new_decoding_state(get_method("skyformer").bind())  # the call it names
    q, k, v = make_qkv(1, 2, 4, 8)
    assert state.step(q, k, v).shape == v.shape


@pytest.mark.parametrize("method", ["softmax", "linear", "skyformer", "performer[num_features=8]"])
def test_a_layer_built_without_causal_refuses_a_cache(method):
    """A cache decodes causally; a layer built without causal=True attends to every
    position in its forward, so its cached steps would silently differ from it (a
    model trained that way sees the future and generates from what it never saw)."""
    layer = MultiHeadAttention(16, 2, method)
    with pytest.raises(ValueError, match=r"built without causal=True.*"
                                         r"MultiHeadAttention\(16, 2, .*causal=True"):
        layer.new_cache()
    assert MultiHeadAttention(16, 2, method, causal=True).new_cache().length == 0


def test_a_layer_steps_only_its_own_cache():
    """A cache holds one layer's keys and state. Another layer's cache (of another
    method: a linear cache stepped by a Skyformer layer gave linear attention, with no
    error), a cache passed to a layer built without causal=True, or no cache at all
    (a list of them) used to run or to fail with an AttributeError."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 16)
    linear = MultiHeadAttention(16, 2, "linear", causal=True)
    sky = MultiHeadAttention(16, 2, "skyformer", causal=True, num_features=8)
    twin = MultiHeadAttention(16, 2, "skyformer", causal=True, num_features=8)
    for other in (linear, twin):
        with pytest.raises(ValueError, match=r"made by another layer's new_cache\(\).*"
                                             r"each layer needs its own"):
            sky(x, cache=other.new_cache())
    with pytest.raises(TypeError, match=r"cache must be this layer's decoding cache "
                                        r"\(cache = layer.new_cache\(\)\), got list"):
        sky(x, cache=[sky.new_cache()])
    with pytest.raises(ValueError, match="built without causal=True"):
        MultiHeadAttention(16, 2, "skyformer")(x, cache=sky.new_cache())
    # a state made directly for the method runs; for another method it is refused
    assert sky(x, cache=new_decoding_state(sky.bound)).shape == x.shape
    with pytest.raises(ValueError, match=r"this cache decodes 'skyformer', the layer runs "
                                         r"'linear'"):
        linear(x, cache=new_decoding_state(sky.bound))
    with torch.no_grad():  # a copy of a cache (to continue a prompt twice) is the layer's
        cache = sky.new_cache(generator=random_key(0))
        sky(x, cache=cache)
        assert sky(x[:, :1], cache=copy.deepcopy(cache)).shape == (2, 1, 16)
        for copied_layer, copied_cache in (copy.deepcopy((sky, cache)),  # either order
                                           copy.deepcopy((cache, sky))[::-1]):
            assert copied_layer(x[:, :1], cache=copied_cache).shape == (2, 1, 16)
        # a pickled cache (torch.save) knows its method, not its layer
        assert sky(x[:, :1], cache=pickle.loads(pickle.dumps(cache))).shape == (2, 1, 16)
        with pytest.raises(ValueError, match="this cache decodes 'skyformer'"):
            linear(x[:, :1], cache=pickle.loads(pickle.dumps(cache)))
        unpickled = pickle.loads(pickle.dumps(sky))  # a new token of its own
        with pytest.raises(ValueError, match="made by another layer's new_cache"):
            sky(x, cache=unpickled.new_cache())
        # two clones of one layer (nn.TransformerEncoder's copies) are two layers
        first, second = copy.deepcopy(sky), copy.deepcopy(sky)
        with pytest.raises(ValueError, match="made by another layer's new_cache"):
            second(x, cache=first.new_cache())
        # nor does the original step its copy's caches (an EMA copy's weights move apart)
        with pytest.raises(ValueError, match="made by another layer's new_cache"):
            sky(x, cache=first.new_cache())


def test_a_cache_no_layer_made_must_have_the_layers_options_and_state():
    """A state of new_decoding_state (or unpickled) was checked by its method's name
    alone: other options (num_features=2 beside the layer's 16) or Performer features
    drawn from the key instead of the layer's ran, 2.45 and 0.15 off its forward."""
    x = torch.randn(2, 10, 16)
    sky = MultiHeadAttention(16, 2, "skyformer", causal=True, num_features=16)
    with pytest.raises(ValueError, match=r"this cache decodes skyformer with num_features=2, "
                                         r"the layer with num_features=16; make it with"):
        sky(x, cache=new_decoding_state(get_method("skyformer").bind(num_features=2)))
    assert sky(x, cache=new_decoding_state(sky.bound.replace(causal=False))).shape == x.shape
    performer = MultiHeadAttention(16, 2, "performer", causal=True, num_features=8).eval()
    with pytest.raises(ValueError, match=r"made without the layer's own performer features, .* "
                                         r"pass state=layer.method_state"):
        performer(x, cache=new_decoding_state(performer.bound))
    with torch.no_grad():
        own = new_decoding_state(performer.bound, state=performer.method_state)
        expected = performer(x)
        torch.testing.assert_close(performer(x, cache=own), expected)
        other = MultiHeadAttention(16, 2, "performer", causal=True, num_features=8)
        with pytest.raises(ValueError, match="made without the layer's own performer features"):
            other(x, cache=pickle.loads(pickle.dumps(performer.new_cache())))
        cache = performer.new_cache()
        performer(x[:, :4], cache=cache)
        performer.train()(x)  # its redraw counter moves; the features stay
        performer.eval()
        unpickled = pickle.loads(pickle.dumps(cache))  # its features a copy, equal
        torch.testing.assert_close(performer(x[:, 4:], cache=unpickled), expected[:, 4:])
        # a variant's state on a layer of its options is the layer's method
        variant = new_decoding_state(get_method("skyformer[num_features=16]").bind())
        assert sky(x, cache=variant).shape == x.shape


@pytest.mark.parametrize(("method", "options"), [
    ("skyformer", {"num_features": 6, "landmark_stride": 5}),
    ("performer", {"num_features": 8}),
    ("performer[num_features=8]", {}),  # a variant decodes with the layer's features too
])
def test_layer_cache_equals_the_causal_layer(method, options):
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, method, causal=True, **options).double().eval()
    x = torch.randn(2, 70, 16, dtype=torch.float64)
    key = random_key(9)
    full = layer(x, generator=key)
    cache = layer.new_cache(generator=key)
    parts = [layer(x[:, :25], cache=cache)] + [layer(x[:, t:t + 1], cache=cache)
                                               for t in range(25, 70)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="takes no context"):
        layer(x[:, :1], context=x, cache=cache)
    with pytest.raises(ValueError, match=r"pass the generator to new_cache\(generator=...\)"):
        layer(x[:, :1], generator=key, cache=layer.new_cache())  # it would be left out


def _decode_single_after(state, q, k, v, valid, prompt, block=(20, 25)):
    """The prompt, then single positions, with positions ``block`` in one step."""
    steps, t = [], prompt
    while t < q.shape[2]:
        n = block[1] - t if t == block[0] else 1
        steps.append(n)
        t += n
    return _decode(state, q, k, v, valid, prompt, steps)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300])
@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
def test_padded_positions_never_matter_step_by_step(method, options, bad):
    """As in the forward (``registry/guard.py``), whatever padded positions hold leaves
    every real output as it is: here the local keys of the Nystrom states and the key
    cache of the exact methods carried a NaN key or value of a padded position into
    the real rows (0 weight x NaN), and nystrom_softmax turned it into its fallback
    mean."""
    n = 30
    q, k, v = make_qkv(2, 2, n, 4, seed=1)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :4] = False  # left padding of the prompt
    valid[0, 12:14] = valid[1, 21:23] = False  # holes in single steps and in a block
    bound = get_method(method).bind(**options)
    key = random_key(0)
    clean = bound.replace(causal=True)(q, k, v, key_padding_mask=valid, generator=key)
    padded = ~valid[:, None, :, None]
    dirty = [torch.where(padded, bad, t) for t in (q, k, v)]
    decoded = _decode_single_after(new_decoding_state(bound, generator=key), *dirty, valid,
                                   prompt=10)
    torch.testing.assert_close(decoded, clean, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("prompt", [10, 25])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
def test_a_non_finite_real_input_is_never_hidden_step_by_step(method, options, where, prompt):
    """A NaN at real position 20 gives the rows of the full causal forward: its own row
    (a query), or every row from 20 on (a key or value; a value also spoils the rows
    before it in one call, as SDPA's 0 x NaN, which rows decoded earlier cannot know).
    Here performer and nystrom_softmax returned finite rows (the fallback mean) after
    the prompt, and the key cache of the exact methods marked the prompt's rows before
    the bad key."""
    n = 30
    q, k, v = make_qkv(2, 2, n, 4, seed=2)
    {"q": q, "k": k, "v": v}[where][0, 1, 20, 1] = float("nan")
    bound = get_method(method).bind(**options)
    key = random_key(0)
    full = bound.replace(causal=True)(q, k, v, generator=key)
    decoded = _decode_single_after(new_decoding_state(bound, generator=key), q, k, v, None,
                                   prompt)
    seen = slice(20 if where == "v" else 0, n)  # before 20: see the docstring
    torch.testing.assert_close(decoded[:, :, seen], full[:, :, seen], rtol=1e-10, atol=1e-10,
                               equal_nan=True)
    assert torch.isnan(decoded[0, 1, 20]).all()
    assert torch.isfinite(decoded[1]).all() and torch.isfinite(decoded[0, 0, :20]).all()


@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
def test_a_step_that_changes_the_layout_is_refused_and_the_state_goes_on(method, options):
    """Heads, head dims, dtype and device are those of the first step; a step with others
    is refused with a sentence (linear once summed H=1 into both heads' sums), and the
    state is as before it: the right step given next decodes as the forward."""
    n = 30
    q, k, v = make_qkv(2, 2, n, 8, seed=2)
    bound = get_method(method).bind(**options)
    key = random_key(5)
    full = bound.replace(causal=True)(q, k, v, generator=key)
    state = new_decoding_state(bound, generator=key)
    outs = [state.step(q[:, :, :20], k[:, :, :20], v[:, :, :20])]
    sl = slice(20, 21)
    for bad in ((q[:, :1, sl], k[:, :1, sl], v[:, :1, sl]),  # one head
                (q[:, :, sl, :4], k[:, :, sl, :4], v[:, :, sl]),  # another head dim
                (q[:, :, sl], k[:, :, sl], v[:, :, sl, :5]),  # another value dim
                tuple(t[:, :, sl].float() for t in (q, k, v))):  # another dtype
        with pytest.raises(ValueError, match=r"the state holds H=2 heads of D=8, Dv=8 in "
                                             r"torch\.float64"):
            state.step(*bad)
    with pytest.raises(TypeError, match="must share dtype and device"):
        state.step(q[:, :, sl], k[:, :, sl].float(), v[:, :, sl])
    for t in range(20, n):
        sl = slice(t, t + 1)
        outs.append(state.step(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
    assert state.length == n
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("method", "options"), CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("first", [False, True], ids=["later-step", "first-step"])
def test_a_step_that_fails_inside_leaves_the_state_as_it_was(method, options, first,
                                                             monkeypatch):
    """A failure at the end of a step (after the state took every position of it) undoes
    the step: given again, it decodes as the forward, with the random key the failed
    first step drew."""
    n = 90  # past the first 64-position chunk
    q, k, v = make_qkv(2, 2, n, 8, seed=3)
    bound = get_method(method).bind(**options)
    generator = torch.Generator().manual_seed(7)
    full = bound.replace(causal=True)(q, k, v, generator=torch.Generator().manual_seed(7))
    state = new_decoding_state(bound, generator=generator)
    outs = [] if first else [state.step(q[:, :, :60], k[:, :, :60], v[:, :, :60])]
    start = 0 if first else 60
    sl = slice(start, n)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(state, "_show_nonfinite", fail)
        with pytest.raises(RuntimeError, match="simulated"):
            state.step(q[:, :, sl], k[:, :, sl], v[:, :, sl])
    assert state.length == start
    outs.append(state.step(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("late", [False, True], ids=["prompt", "later-token"])
def test_nystrom_softmax_decoding_follows_the_forward_into_float64(late):
    """On a CPU a float32 nystrom_softmax forward beyond float32's reach computes in
    float64 (docs/reliability.md); its decoding state does too from the first position
    that needs it (here the prompt, or a later token), and decodes as the forward."""
    n, d = 80, 64
    g = torch.Generator().manual_seed(0)
    rows = [torch.nn.functional.normalize(torch.randn(1, 2, n, d, generator=g), dim=-1)
            for _ in range(2)]
    norms = torch.full((1, 1, n, 1), 23.0)
    if late:
        norms[:, :, :40] = 2.0  # within reach until position 40
    q, k = (r * norms for r in rows)
    v = torch.randn(1, 2, n, d, generator=g)
    bound = get_method("nystrom_softmax").bind(num_features=32, landmark_stride=2)
    full = bound.replace(causal=True)(q, k, v, generator=random_key(1))
    state = new_decoding_state(bound, generator=random_key(1))
    decoded = _decode(state, q, k, v, None, 10, [1] * (n - 10))
    assert decoded.dtype == torch.float32 and state.wide
    torch.testing.assert_close(decoded, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("method", "options"), CASES[:2], ids=lambda c: str(c))
def test_a_one_token_step_costs_a_row_not_a_chunk(method, options):
    """A step of one token is one chunk of one row: it was padded to a 64-row chunk, as
    much work as a step of 64 tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = make_qkv(1, 2, 100, 8, seed=0)
    state = new_decoding_state(get_method(method).bind(**options), generator=random_key(0))
    state.step(q[:, :, :20], k[:, :, :20], v[:, :, :20])

    def flops(n):
        with FlopCounterMode(display=False) as counter:
            state.step(q[:, :, 20:20 + n], k[:, :, 20:20 + n], v[:, :, 20:20 + n])
        return counter.get_total_flops()

    one, chunk = flops(1), flops(64)
    assert 0 < one * 16 < chunk, (one, chunk)


@pytest.mark.parametrize(("method", "where", "spoils_before"), [
    ("linear", "v", True), ("performer", "v", True), ("softmax", "k", True),
    ("softmax", "v", True), ("skyformer", "v", False), ("nystrom_softmax", "v", False),
    ("linear", "k", False), ("performer", "k", False)])
def test_which_earlier_rows_of_a_step_a_non_finite_input_spoils(method, where,
                                                                 spoils_before):
    """docs/reliability.md: in a step of several tokens a NaN value at step row 15 also
    spoils the step's earlier rows where the step runs the chunked sums (linear,
    performer) or a masked product (the exact methods, a key too); the Nystrom states
    step token by token. The prompt's rows stay finite."""
    q, k, v = make_qkv(1, 1, 30, 4, seed=5)
    {"q": q, "k": k, "v": v}[where][0, 0, 25, 1] = float("nan")
    options = {} if method in ("linear", "softmax") else {"num_features": 8}
    state = new_decoding_state(get_method(method).bind(**options), generator=random_key(0))
    prompt = state.step(q[:, :, :10], k[:, :, :10], v[:, :, :10])
    out = state.step(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:])
    assert torch.isfinite(prompt).all()
    assert torch.isnan(out[0, 0, 15:]).all()
    spoiled = torch.isnan(out[0, 0, :15]).any(-1)  # a NaN entry (its column, 0 x NaN)
    assert spoiled.all() if spoils_before else not spoiled.any()


def test_a_state_decoded_with_autograd_on_refuses_a_copy_in_a_sentence():
    """torch's own error named weight_norm; the state says why and what to do."""
    layer = MultiHeadAttention(16, 2, "performer", causal=True)
    x = torch.randn(2, 5, 16)
    cache = layer.new_cache(generator=random_key(0))
    layer(x, cache=cache)
    with pytest.raises(RuntimeError, match=r"performer decoding state cannot be copied: its "
                                           r"steps ran with autograd on.*inference_mode"):
        copy.deepcopy(cache)
    with torch.no_grad():
        cache = layer.new_cache(generator=random_key(0))
        layer(x, cache=cache)
        twin = copy.deepcopy(cache)
        torch.testing.assert_close(layer(x[:, :1], cache=twin), layer(x[:, :1], cache=cache),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("method", ["softmax", "linear", "skyformer"])
def test_a_step_of_no_new_token_gives_zero_rows_and_leaves_the_cache(method):
    """A step of zero tokens was refused as 'empty input ... skip the call for an empty
    batch', though the batch is not empty; the layer's forward promises zeros for N = 0
    and gives them without a cache."""
    torch.manual_seed(0)
    options = {"num_features": 4} if method == "skyformer" else {}
    layer = MultiHeadAttention(8, 2, method, causal=True, **options).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        whole = layer(x, generator=random_key(0))
        cache = layer.new_cache(generator=random_key(0))
        first = layer(x[:, :3], cache=cache)
        none = layer(x[:, :0], cache=cache)
        last = layer(x[:, 3:], cache=cache)
    assert none.shape == (2, 0, 8) and cache.length == 4
    torch.testing.assert_close(torch.cat([first, last], dim=1), whole)
    with pytest.raises(ValueError, match=r"the state holds 2 sequences, the step has 3"):
        layer(torch.randn(3, 0, 8), cache=cache)


def test_a_decoding_steps_mask_covers_its_new_positions_alone():
    """A step given the mask of the whole sequence failed with the method's shape
    sentence ([B, Nk] = [2, 1]) and no word of the rule; a step where every sequence
    has finished warned that every key is padding and advised ~mask, though the cache
    holds real keys."""
    import warnings

    layer = MultiHeadAttention(16, 2, "linear", causal=True).eval()
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    with torch.no_grad():
        cache = layer.new_cache()
        layer(x[:, :5], mask[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"with a cache, key_padding_mask covers the "
                                             r"step's 1 new position alone \(\[B, 1\]; the "
                                             r"cache keeps the 5 earlier ones'\), got \(2, 6\)"
                                             r".* mask\[:, -1:\]"):
            layer(x[:, 5:6], mask[:, :6], cache=cache)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = layer(x[:, 5:6], torch.zeros(2, 1, dtype=torch.bool), cache=cache)
        assert out.shape == (2, 1, 16)
        with pytest.warns(UserWarning, match="every key is padding"):  # a first step: said
            layer(x[:, :2], torch.zeros(2, 2, dtype=torch.bool), cache=layer.new_cache())


def test_a_layers_cache_stepped_in_another_dtype_names_autocast_and_new_cache():
    """The sentence said "start a new state otherwise": a layer's user has no state to
    start but layer.new_cache(), and the dtype most often changed with autocast."""
    layer = MultiHeadAttention(16, 2, "linear", causal=True).eval()
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        cache = layer.new_cache()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"in torch\.bfloat16 on cpu; this step has .* in "
                                             r"torch\.float32 .* most often autocast on for "
                                             r"some steps .* \(layer\.new_cache\(\)\)"):
            layer(x[:, 5:], cache=cache)
    state = new_decoding_state(get_method("linear").bind())
    state.step(*(t[None, None] for t in (x[0], x[0], x[0])))
    with pytest.raises(ValueError, match=r"start a new one \(new_decoding_state\(\.\.\.\)\)"):
        state.step(*(t[None, None, :, :8] for t in (x[0], x[0], x[0])))
