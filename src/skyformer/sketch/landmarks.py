"""Uniform landmark sampling from the rows of [Q; K] (Skyformer eq. (5), Definition 1).

Skyformer sub-samples d rows of the lifted 2n-row matrix [Q; K]. As the reference
implementation does, half of the landmarks come from Q and half from K, drawn per
batch element and shared by the heads. Unlike the reference we

- draw without replacement (a repeated landmark adds nothing to the Nystrom span),
  so that with ``num_features >= 2 n`` every valid row is used exactly once;
- draw only among *valid* rows wherever the padding is (the reference assumes
  right padding);
- take randomness only from the caller's ``generator``.

As the reference, S selects the rows with weight 1 (Definition 1's columns carry
sqrt(1/d)), so the ridge gamma is added to the unscaled landmark block
(``ops/skyformer/README.md``, "Landmarks").

Sampling keeps the rows of smallest *selection key*. Each row's key is its uniform
score (a counter-based draw indexed by the batch element and the row's rank among the
valid rows, ``rng.row_uniform``) with that rank as tie-break; padded rows' keys lie
beyond every valid one. So a sequence draws the same landmarks whatever its padding
(left, right, holes), its padded width and the other sequences of the batch; the keys
are distinct, so neither the set nor the order (increasing key) is left to how a sort
breaks ties; and the smallest keys of a sequence are the smallest among the smallest
keys of its pieces, which is how ``skyformer.distributed`` draws, across processes that
each hold a shard of the sequence, the landmarks one process would draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..linalg.functional_ops import exporting, known_while_exporting
from ..linalg.kernel_backend import KernelFallback
from ..linalg.tracing import may_read_values
from .rng import random_key, row_uniform, stream, valid_rank

DRAWS = ("auto", "torch", "triton")
DRAW_FALLBACK = KernelFallback(
    "landmark draw", "drawing with PyTorch operations (the same landmarks)")

QUERY_STREAM, KEY_STREAM = "landmarks/queries", "landmarks/keys"
_SCORE_SCALE = 2**24  # float32 row_uniform scores are multiples of 2^-24: exact integers
_RANK_BITS = 32  # the rank among valid rows below the score bits (N < 2^32)
PADDED_KEY = 1 << 62  # above every valid row's key (< 2^56)


def _padded_keys(positions: Tensor) -> Tensor:
    """``PADDED_KEY + positions`` (positions < 2^62), as a bitwise or: a compiled call's
    inductor folded the sum with an ``arange`` into one index expression, which Triton
    then typed int32 and refused (torch 2.11, on CUDA)."""
    return positions | PADDED_KEY


@dataclass(frozen=True)
class Landmarks:
    """Indices of the sampled rows of Q and K, with slots that hold no landmark.

    A side's ``*_live_mask`` is ``None`` where the call's form alone (no padding on
    that side) says that every slot holds a landmark, so that nothing computes it and
    the methods may leave out the operations that mask dead slots (on a GPU each is a
    launch the host issues); ``query_live`` and ``key_live`` give the masks either way.
    """

    query_index: Tensor  # [B, mq] long
    query_live_mask: Tensor | None  # [B, mq] bool, or None: every slot holds one
    key_index: Tensor  # [B, mk] long
    key_live_mask: Tensor | None  # [B, mk] bool, or None: every slot holds one

    @property
    def every_slot_live(self) -> bool:
        return self.query_live_mask is None and self.key_live_mask is None

    @property
    def query_live(self) -> Tensor:
        """``[B, mq]`` bool: the query slots that hold a landmark."""
        return _live(self.query_live_mask, self.query_index)

    @property
    def key_live(self) -> Tensor:
        """``[B, mk]`` bool: the key slots that hold a landmark."""
        return _live(self.key_live_mask, self.key_index)

    @property
    def live(self) -> Tensor:
        """``[B, mq + mk]`` bool, in the order [query landmarks, key landmarks]."""
        return torch.cat([self.query_live, self.key_live], dim=1)


def _live(mask: Tensor | None, index: Tensor) -> Tensor:
    return torch.ones_like(index, dtype=torch.bool) if mask is None else mask


def selection_keys(
    key: Tensor, valid: Tensor | None, batch: int, n: int, *,
    valid_before: Tensor | None = None, rows_before: int = 0,
) -> Tensor:
    """Distinct int64 keys ``[B, n]`` of the rows under the stream ``key``: (score, rank
    among the valid rows) for valid rows, ``PADDED_KEY`` + position for padded ones.

    ``valid_before: [B]`` and ``rows_before`` place these ``n`` rows in a longer
    sequence (the valid rows and the rows before them): a shard gets the keys that the
    whole sequence gives its rows.
    """
    scores = row_uniform(key, valid, batch, n, before=valid_before)  # [B, n]
    rank = valid_rank(valid, batch, n, key.device, valid_before)
    ordered = (scores * _SCORE_SCALE).long() << _RANK_BITS | rank
    if valid is None:
        return ordered
    position = rows_before + torch.arange(n, device=key.device)
    return torch.where(valid, ordered, _padded_keys(position))


def use_triton_draw(draw: str, key: Tensor, *tensors: Tensor | None) -> bool:
    """Whether ``stream_selection_keys`` takes the one-launch Triton kernel.

    ``"auto"``: for eager CUDA tensors when Triton imports. ``"triton"``: wherever the
    kernel can run (a CPU tensor needs ``TRITON_INTERPRET=1``). Under ``torch.compile``
    (Inductor fuses the PyTorch path itself), ``torch.export`` and ``torch.func``
    transforms both take the PyTorch path, which gives the same keys. ``"torch"``: never.
    """
    from ..linalg.kernel_backend import check_interpreter, interpreter_on, triton_available

    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {', '.join(map(repr, DRAWS))}, got {draw!r}.")
    if draw == "torch":
        return False
    # the kernels read one key [2]; a key per batch element ([B, 2]) takes PyTorch
    plain = may_read_values(key, *(t for t in tensors if t is not None)) \
        and not exporting() and tuple(key.shape) == (2,)
    if draw == "auto" or not plain:
        return (key.is_cuda and plain and triton_available()
                and not DRAW_FALLBACK.failed_on(key))
    if not triton_available():
        raise RuntimeError('kernel="triton" (the Triton landmark draw, draw="triton") needs '
                           'Triton: pip install triton (or use kernel="auto", which falls '
                           'back to PyTorch).')
    if not key.is_cuda and not interpreter_on():
        raise RuntimeError(
            f'kernel="triton" (the Triton landmark draw, draw="triton") runs on CUDA '
            f"tensors; these are on {key.device}. Set TRITON_INTERPRET=1 before Python "
            'starts to run it on the CPU (slow, for testing), or use kernel="auto".')
    if interpreter_on():  # it runs the kernels whatever the tensors' device
        check_interpreter()
    return True


def stream_selection_keys(
    key: Tensor, name: str, valid: Tensor | None, batch: int, n: int, *,
    valid_before: Tensor | None = None, rows_before: int = 0, draw: str = "auto",
) -> Tensor:
    """``selection_keys(stream(key, name), ...)``: by PyTorch operations or, on a GPU,
    in one Triton kernel with the same bits (``triton_draws``)."""
    def by_pytorch() -> Tensor:
        return selection_keys(stream(key, name), valid, batch, n, valid_before=valid_before,
                              rows_before=rows_before)

    if not use_triton_draw(draw, key, valid, valid_before):
        return by_pytorch()
    from . import triton_draws

    rank = None if valid is None else valid_rank(valid, batch, n, key.device, valid_before)

    def launch() -> Tensor:
        return triton_draws.selection_keys(
            key, name, None if valid is None else valid.bool(), batch, n, rank=rank,
            valid_before=valid_before, rows_before=rows_before, padded_key=PADDED_KEY)

    return launch_or_fall_back(draw, launch, by_pytorch, on=key)


def launch_or_fall_back(draw: str, launch: Callable[[], Tensor],
                        fallback: Callable[[], Tensor], *, on: Tensor) -> Tensor:
    """``launch()``; under ``"auto"`` a failure warns once and takes ``fallback()`` from
    then on for ``on``'s device (the same numbers; ``DRAW_FALLBACK``)."""
    return DRAW_FALLBACK.run(draw == "auto", launch, fallback, on=on)


def smallest_keys(keys: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``min(count, n)`` smallest of ``keys: [B, n]`` in increasing order:
    ``(index [B, c], keys [B, c])``."""
    picked, index = keys.topk(min(count, keys.shape[1]), dim=1, largest=False, sorted=True)
    return index, picked


def _count_slots(keys: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``smallest_keys`` for a length ``n`` that may fall below ``count``, as a
    symbolic one while exporting: torch.export cannot prove the bound of ``min(count,
    n)`` slots (topk's k <= n, a slice's end), so there are ``count``, the ones past
    ``n`` dead (a key above every row's, the index of row 0)."""
    batch, n = keys.shape
    extra = _padded_keys(n + torch.arange(count, device=keys.device))  # above padded rows'
    index, picked = smallest_keys(torch.cat([keys, extra.expand(batch, count)], 1), count)
    return torch.where(index < n, index, 0), picked


def uniform_landmarks(
    num_features: int,
    *,
    batch: int,
    query_len: int,
    key_len: int,
    query_valid: Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
    generator: torch.Generator | Tensor | None = None,
    draw: str = "auto",
) -> Landmarks:
    """Sample ``ceil(m/2)`` rows of Q and ``floor(m/2)`` rows of K without replacement.

    Each side is capped by its number of valid rows; unused slots are marked dead.
    ``generator``: a generator or a random key (``rng.random_key``). ``draw``: how the
    selection keys are computed (``use_triton_draw``); the landmarks are the same.
    """
    key = random_key(generator, device)
    counts = ((num_features + 1) // 2, num_features // 2)
    if query_valid is None and key_valid is None and query_len == key_len \
            and use_triton_draw(draw, key):
        return _unpadded_sides_in_one_draw(key, batch, query_len, counts, draw)
    sides = []
    for name, valid, n, count in ((QUERY_STREAM, query_valid, query_len, counts[0]),
                                  (KEY_STREAM, key_valid, key_len, counts[1])):
        keys = stream_selection_keys(key, name, valid, batch, n, draw=draw)
        short = exporting() and not known_while_exporting(count <= n)
        index, picked = (_count_slots if short else smallest_keys)(keys, count)
        # without padding a side's slots are capped by its length: every one is filled
        sides.append((index, None if valid is None and not short else picked < PADDED_KEY))
    (q_index, q_live), (k_index, k_live) = sides
    return Landmarks(q_index, q_live, k_index, k_live)


def _unpadded_sides_in_one_draw(key: Tensor, batch: int, n: int, counts: tuple[int, int],
                                draw: str) -> Landmarks:
    """The landmarks of both sides of an unpadded call with ``Nq == Nk`` from one Triton
    draw of the two streams' keys ``[2 B, n]`` and one top-k (two of each otherwise);
    the key side's ``counts[1] <= counts[0]`` smallest lead its sorted row."""
    from . import triton_draws

    def launch() -> Tensor:
        return triton_draws.paired_selection_keys(key, (QUERY_STREAM, KEY_STREAM), batch, n)

    def by_pytorch() -> Tensor:
        return torch.cat([selection_keys(stream(key, name), None, batch, n)
                          for name in (QUERY_STREAM, KEY_STREAM)])

    index, _ = smallest_keys(launch_or_fall_back(draw, launch, by_pytorch, on=key), counts[0])
    return Landmarks(index[:batch], None, index[batch:, :counts[1]], None)
