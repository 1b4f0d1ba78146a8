"""The one-launch Triton landmark draws give the PyTorch path's numbers bit for bit:
the selection keys of uniform landmarks and the causal landmark slots.

On the CPU the kernel runs under Triton's interpreter (``tests/conftest.py``), on CUDA
with ``SKYFORMER_TEST_CUDA=1``.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

import skyformer
from skyformer.linalg.kernel_backend import interpreter_on
from skyformer.ops.shared.causal_nystrom import slot_ranks
from skyformer.sketch import landmarks as lm
from skyformer.sketch.rng import random_key
from tests.devices import devices, needs_interpreter
from tests.dispatch import Recorder

pytest.importorskip("triton")

KEYS = [
    random_key(torch.Generator().manual_seed(3)),
    torch.tensor([2**32 - 1, 2**31 + 11]),  # words at the 32-bit edge
    torch.tensor([2**40 + 5, -7]),  # not a key random_key makes: still the same bits
]


@pytest.fixture(autouse=True)
def _interpreter_for_cpu(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "cpu" and not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernel runs on CUDA")


def _valid(kind: str, batch: int, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    valid = torch.rand(batch, n, generator=torch.Generator().manual_seed(1)) > 0.3
    if kind == "with an empty row":
        valid[1] = False
    return valid


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("key", KEYS, ids=["drawn", "edge", "wide"])
@pytest.mark.parametrize("valid_kind", ["none", "random", "with an empty row"])
@pytest.mark.parametrize("n", [1, 37, 1024, 1500])
def test_selection_keys_equal_the_pytorch_path(device, key, valid_kind, n):
    valid = _valid(valid_kind, 3, n)
    key = key.to(device)
    valid = None if valid is None else valid.to(device)
    for before, rows_before in ((None, 0), (torch.tensor([0, 5, 17], device=device), 9)):
        args = (key, lm.QUERY_STREAM, valid, 3, n)
        options = {"valid_before": before, "rows_before": rows_before}
        want = lm.stream_selection_keys(*args, **options, draw="torch")
        got = lm.stream_selection_keys(*args, **options, draw="triton")
        assert got.dtype == torch.long and torch.equal(got, want)


@pytest.mark.parametrize("device", devices())
def test_landmarks_are_the_same_whichever_path_draws_them(device):
    valid = _valid("random", 2, 300)
    options = {"batch": 2, "query_len": 300, "key_len": 200,
               "query_valid": valid.to(device), "key_valid": None,
               "device": torch.device(device), "generator": KEYS[0].to(device)}
    want = lm.uniform_landmarks(64, **options, draw="torch")
    got = lm.uniform_landmarks(64, **options, draw="triton")
    for name in ("query_index", "query_live", "key_index", "key_live"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("key", KEYS, ids=["drawn", "edge", "wide"])
@pytest.mark.parametrize("n", [1, 37, 1500])
def test_paired_selection_keys_are_both_streams_keys(device, key, n):
    from skyformer.sketch import triton_draws

    key = key.to(device)
    got = triton_draws.paired_selection_keys(key, (lm.QUERY_STREAM, lm.KEY_STREAM), 3, n)
    want = [lm.stream_selection_keys(key, name, None, 3, n, draw="torch")
            for name in (lm.QUERY_STREAM, lm.KEY_STREAM)]
    assert torch.equal(got, torch.cat(want))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("m", "n"), [(64, 300), (63, 300), (1, 300), (9, 4), (600, 300)])
def test_an_unpadded_call_draws_both_sides_in_one_launch_and_one_top_k(device, m, n):
    """Queries and keys of one length without padding: one draw of both streams and one
    top-k (the key side's landmarks lead the query side's sorted row), the landmarks of
    two draws."""
    from skyformer.sketch import triton_draws

    options = {"batch": 2, "query_len": n, "key_len": n, "query_valid": None,
               "key_valid": None, "device": torch.device(device),
               "generator": KEYS[0].to(device)}
    want = lm.uniform_landmarks(m, **options, draw="torch")
    paired = mock.Mock(wraps=triton_draws.paired_selection_keys)
    top_k = mock.Mock(wraps=lm.smallest_keys)
    with mock.patch.object(triton_draws, "paired_selection_keys", paired), \
            mock.patch.object(lm, "smallest_keys", top_k):
        got = lm.uniform_landmarks(m, **options, draw="triton")
    assert paired.call_count == 1 and top_k.call_count == 1 and got.every_slot_live
    for name in ("query_index", "query_live", "key_index", "key_live"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.query_index.shape == (2, min((m + 1) // 2, n))
    assert got.key_index.shape == (2, min(m // 2, n))


def test_sides_without_padding_compute_no_live_mask():
    """A side without padding fills every slot: its live mask is not computed (no lt
    launch), and reads as all true."""
    options = {"batch": 2, "query_len": 50, "key_len": 40, "query_valid": None,
               "key_valid": torch.arange(40) < torch.tensor([[40], [7]]),
               "device": torch.device("cpu"), "generator": KEYS[0]}
    with Recorder(lambda func, args, out: func.overloadpacket.__name__) as names:
        drawn = lm.uniform_landmarks(32, **options, draw="torch")
    assert names.items.count("lt") == 1  # the key side's
    assert drawn.query_live_mask is None and drawn.query_live.all()
    assert drawn.key_live.sum(dim=1).tolist() == [16, 7] and not drawn.every_slot_live


def test_a_failed_paired_draw_under_auto_falls_back_to_the_same_landmarks(monkeypatch):
    from skyformer.sketch import triton_draws

    options = {"batch": 2, "query_len": 50, "key_len": 50, "query_valid": None,
               "key_valid": None, "device": torch.device("cpu"), "generator": KEYS[0]}
    want = lm.uniform_landmarks(16, **options, draw="torch")

    def broken(*args):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(lm.DRAW_FALLBACK, "failures", set())
    monkeypatch.setattr(lm, "use_triton_draw", lambda *_: True)
    monkeypatch.setattr(triton_draws, "paired_selection_keys", broken)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        got = lm.uniform_landmarks(16, **options, draw="auto")
    assert torch.equal(got.query_index, want.query_index)
    assert torch.equal(got.key_index, want.key_index)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("key", KEYS, ids=["drawn", "edge", "wide"])
@pytest.mark.parametrize(("m", "stride"), [(1, 1), (128, 1), (128, 7), (1500, 3), (37, 2**20)])
def test_causal_slot_ranks_equal_the_pytorch_path(device, key, m, stride):
    options = {"batch": 3, "device": torch.device(device), "key": key.to(device)}
    want = slot_ranks(m, stride, **options, draw="torch")
    got = slot_ranks(m, stride, **options, draw="triton")
    assert torch.equal(got, want)
    steps = got - torch.arange(m, device=device) * stride
    assert (steps >= 0).all() and (steps < stride).all()  # one slot per stride window


@pytest.mark.parametrize("device", devices())
def test_causal_slot_ranks_with_a_stride_per_batch_element(device):
    """A ``[B]`` stride (each sequence's own default) gives each element the ranks of
    its stride alone, on both paths."""
    strides = torch.tensor([1, 7, 2**20], device=device)
    options = {"batch": 3, "device": torch.device(device), "key": KEYS[0].to(device)}
    want = slot_ranks(37, strides, **options, draw="torch")
    assert torch.equal(slot_ranks(37, strides, **options, draw="triton"), want)
    for b, stride in enumerate(strides.tolist()):
        assert torch.equal(want[b], slot_ranks(37, stride, **options, draw="torch")[b])
    with pytest.raises(ValueError, match=r"one stride per batch element, shape \(3,\)"):
        slot_ranks(37, strides[0], **options, draw="triton")


def test_a_key_per_batch_element_takes_the_pytorch_path():
    """The kernels read one key [2]; keys [B, 2] fold per batch element in PyTorch."""
    keys = torch.stack([random_key(i) for i in range(3)])  # [3, 2]
    assert not lm.use_triton_draw("triton", keys)
    want = lm.stream_selection_keys(keys, lm.KEY_STREAM, None, 3, 40, draw="torch")
    got = lm.stream_selection_keys(keys, lm.KEY_STREAM, None, 3, 40, draw="triton")
    assert torch.equal(got, want)


def test_a_failed_launch_under_auto_warns_once_and_draws_the_same_keys(monkeypatch):
    monkeypatch.setattr(lm.DRAW_FALLBACK, "failures", set())

    def broken():
        raise RuntimeError("no C compiler")

    want = lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, None, 2, 30, draw="torch")
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        got = lm.launch_or_fall_back(
            "auto", broken,
            lambda: lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, None, 2, 30, draw="torch"),
            on=KEYS[0])
    assert torch.equal(got, want) and lm.DRAW_FALLBACK.failed_on(KEYS[0])
    with pytest.raises(RuntimeError, match="no C compiler"):  # "triton" insists
        lm.launch_or_fall_back("triton", broken, lambda: want, on=KEYS[0])


@needs_interpreter
def test_an_empty_batch_or_sequence_draws_nothing():
    for batch, n in ((0, 5), (2, 0)):
        keys = lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, None, batch, n, draw="triton")
        assert keys.shape == (batch, n)


@needs_interpreter
def test_under_vmap_the_pytorch_path_draws_the_same_keys():
    valid = _valid("random", 4, 50)

    def keys(one_valid):
        return lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, one_valid[None], 1, 50,
                                        draw="triton")[0]

    mapped = torch.func.vmap(keys)(valid)
    for i in range(4):
        assert torch.equal(mapped[i], keys(valid[i]))


def test_bad_choices_are_named(monkeypatch):
    with pytest.raises(ValueError, match="draw must be one of 'auto', 'torch', 'triton'"):
        lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, None, 1, 4, draw="cuda")
    monkeypatch.setattr("skyformer.linalg.kernel_backend.interpreter_on", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        lm.stream_selection_keys(KEYS[0], lm.KEY_STREAM, None, 1, 4, draw="triton")
    assert not lm.use_triton_draw("auto", KEYS[0])  # a CPU key: the PyTorch path


@pytest.mark.parametrize("tracer", ["make_fx", "jit.trace"])
def test_tracers_record_the_draw(tracer):
    """A traced graph replayed with another key gives that key's landmarks: under a
    tracer the draw takes its PyTorch operators (a raw launch would not be recorded)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if not interpreter_on():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=0): the kernel runs on CUDA")
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))

    def attend(q, k, v, key):
        return skyformer.attention(q, k, v, "skyformer", num_features=8, kernel="triton",
                                   generator=key)

    first, second = random_key(1), random_key(2)
    traced = make_fx(attend)(q, k, v, first) if tracer == "make_fx" \
        else torch.jit.trace(attend, (q, k, v, first), check_trace=False)
    for key in (first, second):
        torch.testing.assert_close(traced(q, k, v, key), attend(q, k, v, key))


@pytest.mark.parametrize("paired", [False, True])
def test_a_sequence_longer_than_a_cuda_grid_row_launches_within_cudas_limits(monkeypatch,
                                                                              paired):
    """CUDA launches at most 65535 blocks along a grid's second and third dimensions: a
    draw over N > 65535 * 1024 rows (67M tokens, one block of 1024 rows a program) keeps
    every program on the first (the launch is recorded, not run: no kernel reads the
    512 MiB that ``torch.empty`` reserves)."""
    from skyformer.sketch import triton_draws

    grids = []

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **options: None

    monkeypatch.setattr(triton_draws, "_selection_keys_kernel", Recording())
    n = 65535 * triton_draws.BLOCK + 1
    if paired:
        triton_draws.paired_selection_keys(KEYS[0], (lm.QUERY_STREAM, lm.KEY_STREAM), 1, n)
    else:
        triton_draws.selection_keys(KEYS[0], lm.KEY_STREAM, None, 1, n, rank=None,
                                    valid_before=None, rows_before=0, padded_key=lm.PADDED_KEY)
    (grid,) = grids
    assert all(size <= 65535 for size in grid[1:]), grid
    assert math.prod(grid) == (2 if paired else 1) * 65536  # every block of every row
