"""Which calls read tensor values on the host: on a GPU each read waits for the queue.

A value read (``.item()``, ``bool(t)``, a data-dependent shape: ``nonzero``, boolean
indexing, ``unique``) makes the host wait until the GPU has run everything queued
before it, so the next launches start late; so does a tensor made from Python data on
the GPU (``torch.tensor(x, device=...)``: a blocking copy from the host). Every method's
eager forward + backward is watched here by a dispatch mode, with and without key
padding; only the methods that read a value on purpose to skip work (and whose
``may_read_values`` path gives the same result without the read) may do so. The
non-finite check runs as it does on CUDA (on the CPU it first asks whether the inputs
are finite at all, a read that costs nothing there). ``tests/gpu`` checks the same on
CUDA with PyTorch's sync debug mode.
"""

from __future__ import annotations

import collections
import traceback
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import skyformer
from skyformer.registry import guard
from tests.conftest import lacks, make_qkv

# Operators whose result the host must see: a scalar read, or an output whose shape
# depends on the values.
READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
         "unique_consecutive", "repeat_interleave", "is_nonzero", "equal",
         # solvers whose status PyTorch checks on the host (their ``_ex`` forms do not)
         "_linalg_check_errors", "_linalg_eigh", "_linalg_svd"}
# A tensor made from Python data (on a GPU a blocking copy from the host) when our code
# asks for one (``torch.tensor``, ``as_tensor``, ``new_tensor``); PyTorch also wraps a
# number assigned by indexing this way, which is no copy of ours.
FROM_DATA = {"lift_fresh", "lift_fresh_copy"}

# Methods that read one value on purpose (and why); every other method reads none.
READS_ON_PURPOSE = {
    "linformer": "whether every projected slot holds a real key (SDPA without a mask)",
    "nystrom_softmax": "on a CPU only, whether float32 keeps the Gaussian entries the sums "
                       "need (else float64)",
    "performer": "causal, on a CPU only, whether the keys' log-scales span little enough "
                 "for one cumulative sum (else the log-depth scan)",
    "skyformer_multipole": "the number of cluster blocks the fullest head needs",
    "softmax_multipole": "the number of cluster blocks the fullest head needs",
}
# ... and, beside that read, in causal calls on a CPU: whether the running maxima of
# the keys' exponents span little enough for one cumulative sum (else the log-depth scan)
CAUSAL_SPAN_READS = {"nystrom_softmax"}
# ... and, beside that read, an eigen-solver whose status PyTorch checks on the host
SOLVER_CHECKS_ON_PURPOSE = {
    "skyformer_multipole": "eigh of the values' covariance (the far field's basis)",
    "softmax_multipole": "eigh of the values' covariance (the far field's basis)",
}


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS or name in FROM_DATA or (name in ("index", "index_put", "index_put_")
                                                  and _boolean_index(args[1])):
            frames = [f for f in traceback.extract_stack() if "/skyformer/" in f.filename]
            if name not in FROM_DATA or (frames and "tensor(" in (frames[-1].line or "")):
                self.where[f"{frames[-1].filename}:{frames[-1].lineno}" if frames
                           else func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _boolean_index(indices) -> bool:
    """Whether an ``index`` / ``index_put`` takes a boolean mask (its nonzero entries
    decide the shape)."""
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def host_reads(call) -> collections.Counter[str]:
    """The places (file:line) where ``call()`` and its backward read values."""
    with mock.patch.object(guard, "may_read_values", lambda *_: False), \
            _HostReads() as reads:
        out = call()
        out.float().sum().backward()
    return reads.where


CAUSAL = [name for name in skyformer.list_methods()
          if skyformer.get_method(name).capabilities.causal]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name, causal", [(name, False) for name in skyformer.list_methods()]
                         + [(name, True) for name in CAUSAL])
def test_only_the_methods_that_say_why_read_values(name, causal, masked):
    q, k, v = (t.float().requires_grad_() for t in make_qkv(2, 2, 48, 16, seed=5))
    options = {"generator": skyformer.random_key(4)}
    if causal:
        options["causal"] = True
    if masked:
        mask = torch.ones(2, 48, dtype=torch.bool)
        mask[0, -7:] = False
        options["key_padding_mask"] = mask
        if lacks(name, "mask", lambda: skyformer.attention(q, k, v, name, **options)):
            return
    reads = host_reads(lambda: skyformer.attention(q, k, v, name, **options))
    if name in READS_ON_PURPOSE:
        allowed = 1 + (name in SOLVER_CHECKS_ON_PURPOSE) + (causal and name in CAUSAL_SPAN_READS)
        assert sum(reads.values()) <= allowed, dict(reads)
    else:
        assert not reads, f"{name} reads values on the host at {dict(reads)}"


def test_the_watch_sees_a_read():
    """The dispatch mode catches ``bool(t)`` and data-dependent shapes, and not an
    index by positions or a fill (a tensor made from Python data is caught in our
    code alone: ``test_the_watch_sees_a_tensor_made_from_python_data``)."""
    positions = torch.tensor([0, 2])
    with _HostReads() as reads:
        t = torch.ones(3)
        bool(t.sum() > 0)
        t[t > 0].sum()
        t[positions] = 2.0
        t[t > 1] = 3.0
        torch.masked_select(t, t > 2)
        torch.where(t > 2, t, torch.full((), float("inf")))
    assert sum(reads.where.values()) == 4


def test_the_watch_sees_a_tensor_made_from_python_data():
    """``torch.tensor(x)`` in the library (``random_key`` of an int seed: the words of
    the seed, outside any call) is caught; an int folded into a key and a number
    assigned by indexing are not."""
    from skyformer.sketch import rng

    key = rng.random_key(1)
    with _HostReads() as reads:
        key[0] = 5
        rng.fold_in(key, 3)
        rng.fold_in(key, torch.arange(2))
    assert not reads.where
    with _HostReads() as reads:
        rng.random_key(7)
    assert reads.where and all(where.startswith(f"{rng.__file__}:") for where in reads.where)


def decoding_reads(method: str, n: int, revealed: set[int] | None = None) -> dict[int, int]:
    """The values each single-token decoding step t = 20 ... n - 1 reads, after a
    20-token prompt (10 landmark slots, stride 7); the steps that reveal a slot go in
    ``revealed``."""
    from skyformer.decoding import new_decoding_state

    q, k, v = make_qkv(2, 2, n, 8, seed=1)
    bound = skyformer.get_method(method).bind(num_features=10, landmark_stride=7)
    state = new_decoding_state(bound, generator=skyformer.random_key(3))
    state.step(q[:, :, :20], k[:, :, :20], v[:, :, :20], None)
    reads = {}
    for t in range(20, n):
        before = int(state.revealed.sum())
        with _HostReads() as watch:
            state.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], None)
        reads[t] = sum(watch.where.values())
        if revealed is not None and int(state.revealed.sum()) > before:
            revealed.add(t)
    return reads


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_a_decoding_step_reads_one_value_where_it_reveals_no_landmark(method):
    # whether a token reveals a landmark slot and whether it completes a chunk are read
    # together; most tokens do neither, and then that is the step's only read
    reads = decoding_reads(method, 90)  # across the chunk boundary at 64
    assert collections.Counter(reads.values()).most_common(1)[0][0] == 1  # was 2


@pytest.mark.parametrize("method", ["skyformer", "nystrom_softmax"])
def test_a_decoding_step_that_reveals_a_landmark_reads_two_values(method):
    # the step's flags (whether every slot is then revealed among them) and which
    # earlier keys are still held (5 before: the revealed slot's one-hot read its
    # index's range, twice, and every-slot-revealed was a read of its own); a step that
    # completes a chunk (once per 64 tokens) reads three at most: the flags, the earlier
    # keys still held and the open chunk's (4 before: the completed chunk's own), one
    # more where it reveals a slot too (the earlier keys then held, read once for each)
    revealed: set[int] = set()
    reads = decoding_reads(method, 140, revealed)
    completes_chunk = {t for t in reads if (t + 1) % 64 == 0}  # no padding: rank t
    revealing = [n for t, n in reads.items() if n > 1 and t not in completes_chunk]
    assert len(revealing) >= 8  # the landmark slots revealed after the prompt
    assert max(revealing) <= 2
    assert all(reads[t] <= 3 + (t in revealed) for t in completes_chunk), \
        {t: (reads[t], t in revealed) for t in completes_chunk}


def _padding_as_attn_mask(b: int, n: int, padded: bool) -> torch.Tensor:
    """``[B, 1, N, N]`` bool, padding as ``skyformer.hf`` passes it: one row over the
    keys repeated over the queries by stride 0 (every key real where not ``padded``)."""
    row = torch.ones(b, n, dtype=torch.bool)
    if padded:
        row[0, -7:] = False
    return row[:, None, None, :].expand(b, 1, n, n)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["skyformer", "nystromformer", "performer"])
def test_a_padding_attn_mask_is_turned_into_key_padding_without_a_read(name, padded):
    """``scaled_dot_product_attention`` gives an approximate method a padding
    ``attn_mask`` as key padding without reading it: whether every key is real was a
    read (on a GPU a wait for the queue, once a layer) to pass None instead, which a
    method that takes key padding does not need; with every key real the result is the
    call's without a mask."""
    q, k, v = (t.float().requires_grad_() for t in make_qkv(2, 2, 48, 16, seed=5))
    mask = _padding_as_attn_mask(2, 48, padded)
    key = skyformer.random_key(4)  # made from Python data: outside the watch

    def call(attn_mask):
        return skyformer.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, method=name, num_features=16, generator=key)

    assert not host_reads(lambda: call(mask)), name
    if not padded:
        torch.testing.assert_close(call(mask), call(None), rtol=0, atol=0)


def _model_reads(decoder: bool) -> collections.Counter[str]:
    """The reads of a forward pass of a 2-layer BERT (a decoder: causal) with Skyformer
    layers on a padded batch, by place."""
    pytest.importorskip("transformers")
    from skyformer.hf import set_attention
    from tests.hf.conftest import tiny_bert

    model = set_attention(tiny_bert(is_decoder=decoder), "skyformer", num_features=8)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, 17:] = 0
    with mock.patch.object(guard, "may_read_values", lambda *_: False), torch.no_grad(), \
            _HostReads() as reads:  # the non-finite check as on CUDA (module docstring)
        model(input_ids=ids, attention_mask=attention_mask)
    return reads.where


def test_a_models_padding_is_read_once_a_forward_not_once_a_layer():
    """An encoder: the mask builder reads whether there is padding once a forward (to
    pass no mask without it); the layers take the padding row without a read."""
    reads = _model_reads(decoder=False)
    assert sum(reads.values()) <= 1, dict(reads)
    assert not any("/skyformer/masks.py:" in where for where in reads), dict(reads)


def test_a_decoders_causal_padding_is_checked_by_one_read_a_layer():
    """A decoder: transformers materialises causal with padding, which each layer checks
    (a mask ignored is a wrong answer); the pattern the model declares first, so one
    read a layer where it holds (the key padding check came first, and failed, before)."""
    reads = _model_reads(decoder=True)
    checks = sum(n for where, n in reads.items() if "/skyformer/masks.py:" in where)
    assert checks == 2, dict(reads)  # one for each of the 2 layers
