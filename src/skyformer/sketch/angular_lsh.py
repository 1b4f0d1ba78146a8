"""Angular LSH with equal-sized buckets in Hamming order (KDEformer Appendix A).

Definition A.1: a rank-r angular LSH draws r Gaussian hyperplane normals w_1..w_r and
labels x by the r-bit number h(x) = (1{w_1.x > 0}, ..., 1{w_r.x > 0}); two points
collide with probability (1 - theta/pi)^r.

Lemma A.2: the 2^r labels can be listed b_1, ..., b_{2^r} so that consecutive labels
differ in one bit (the reflected binary Gray code, built by the lemma's recursion).
Neighbouring labels are neighbouring cells of the hyperplane arrangement, so sorting
points by the position of their label in that list keeps close points close.

Definition A.3: sort the points by that position and cut the sorted sequence into
equal-sized chunks: these are the buckets. Hashing queries and keys with the same
hyperplanes and pairing query chunk c with key chunk c gives the block-diagonal
"heavy" part of the attention matrix (KDEformer Figure 6).

Bits are encoded as label = sum_i 2^i h_i(x). Rows marked invalid (padding) sort
after every valid row, and ties keep sequence order, so for a single sequence right
padding yields the same order of the real rows as truncation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rng import normal, random_key, stream


def gray_code_order(bits: int) -> Tensor:
    """The labels b_1, ..., b_{2^bits} of Lemma A.2, consecutive ones at Hamming distance 1.

    Built by the lemma's induction: the (r-1)-bit sequence with a 0 in the new bit,
    followed by the same sequence reversed with a 1 in the new bit. ``[2^bits]`` long.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < 0:
        raise ValueError(f"bits must be an integer >= 0, got {bits!r}.")
    order = torch.zeros(1, dtype=torch.long)
    for r in range(bits):
        order = torch.cat([order, order.flip(0) + (1 << r)])
    return order


def gray_code_rank(bits: int) -> Tensor:
    """Position of each label in ``gray_code_order(bits)``: ``rank[label]``, ``[2^bits]``
    (the table, built by the lemma's induction; ``gray_rank_of`` computes it)."""
    order = gray_code_order(bits)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank


def gray_rank_of(labels: Tensor, bits: int) -> Tensor:
    """``gray_code_rank(bits)[labels]`` without the table, on the labels' device: the
    lemma's sequence is the reflected binary Gray code (t-th label t ^ (t >> 1)), whose
    inverse is the prefix XOR of the label's bits, t = g ^ (g >> 1) ^ (g >> 2) ^ ...
    (log2(bits) shifts). A table built on the host would be copied to a GPU on every
    call, a copy that waits for the GPU's queue to drain."""
    rank = labels
    shift = 1
    while shift < bits:
        rank = rank ^ (rank >> shift)
        shift *= 2
    return rank


def draw_hyperplanes(
    prefix: tuple[int, ...], dim: int, bits: int, *, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Gaussian hyperplane normals ``[*prefix, dim, bits]`` (Definition A.1).

    Drawn in float32 and cast, so inputs of every dtype hash with the same numbers.
    ``generator``: a generator or a random key (``rng.random_key``).
    """
    key = stream(random_key(generator, device), "hyperplanes")
    return normal(key, (*prefix, dim, bits)).to(dtype)


def angular_hash(x: Tensor, hyperplanes: Tensor) -> Tensor:
    """Labels h(x) of Definition A.1: ``x [..., N, D]``, ``hyperplanes [..., D, r]`` ->
    ``[..., N]`` long in ``[0, 2^r)`` (bit i set iff w_i.x > 0)."""
    bits = hyperplanes.shape[-1]
    signs = (x @ hyperplanes.to(x.dtype)) > 0  # [..., N, r]
    weights = 1 << torch.arange(bits, device=x.device)
    return (signs.long() * weights).sum(-1)


def hamming_order(x: Tensor, hyperplanes: Tensor, valid: Tensor | None = None) -> Tensor:
    """Permutation P of Definition A.3 (steps 1-3): positions sorted by the Gray-code
    rank of their label, ties in sequence order, invalid rows last.

    Args:
        x: ``[B, H, N, D]``; hyperplanes: ``[B, H, D, r]`` (or broadcastable).
        valid: ``[B, N]`` bool, True = real row; None = all real.
    Returns:
        ``[B, H, N]`` long: ``order[..., t]`` is the position placed t-th.
    """
    bits = hyperplanes.shape[-1]
    rank = gray_rank_of(angular_hash(x, hyperplanes), bits)  # [B, H, N]
    if valid is not None:
        rank = rank.masked_fill(~valid[:, None, :], 1 << bits)
    return torch.sort(rank, dim=-1, stable=True).indices


def equal_size_buckets(order: Tensor, bucket_size: int, num_buckets: int) -> Tensor:
    """Definition A.3 step 4: cut the sorted positions into ``num_buckets`` chunks of
    ``bucket_size``.

    Args:
        order: ``[..., N]`` from ``hamming_order``.
    Returns:
        ``[..., num_buckets, bucket_size]`` positions; slots past the end hold ``N``
        (a sentinel: index one past the last row, for a caller-provided padding row).
    """
    n = order.shape[-1]
    total = num_buckets * bucket_size
    if total < n:
        raise ValueError(
            f"{num_buckets} buckets of {bucket_size} hold {total} rows, fewer than N = {n}."
        )
    pad = order.new_full((*order.shape[:-1], total - n), n)
    return torch.cat([order, pad], dim=-1).view(*order.shape[:-1], num_buckets, bucket_size)
