"""Per-query exact keys beyond the cluster's near keys: a local window or LSH buckets.

Both are pairs of blocks, queries ``q_index [B, H, nb, sq]`` against keys ``k_index
[B, H, nb, sk]`` (index N = empty slot): blocks for the window |i - j| <= w over ranks
i, j among the real queries and keys (holes and left padding give the truncated
sequence's windows),
and KDEformer's equal-sized angular-LSH buckets in Hamming order (Appendix A, through
``sketch.lsh_blocks``). For query i of cluster a and such a key j that is not already
one of the cluster's near keys, the exact term exp(l_ij) [v_j, 1] is added and the
key's first-order far-field model weight, relative to the far mass R_a,

    omega_ij = exp(z_a.k_j + b_j - log R_a) max(0, 1 + delta_i.(k_j - kbar_a)),

is removed from the far field (the expansion of ``sums.py`` is a sum of such
per-key terms), so no key is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...sketch.lsh_blocks import gather_block_rows, gather_block_values, hamming_blocks
from ..shared.real_first import RealFirst, real_first_pair

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class ExactBlocks:
    """Query blocks paired with key blocks."""

    q_index: Tensor  # [B, H, nb, sq] long, Nq = empty slot
    k_index: Tensor  # [B, H, nb, sk] long, Nk = empty slot
    q_slot: Tensor  # [B, H, Nq] flat slot of each query in [nb * sq]
    pairs: Tensor | None  # [nb, sq, sk] pairs kept (the window's |i - j| <= w), None = all


def window_blocks(b: int, h: int, n: int, w: int, device: torch.device,
                  query_valid: Tensor | None = None, key_valid: Tensor | None = None
                  ) -> ExactBlocks:
    """Blocks of w queries against the 3w keys around them (self-attention), by rank
    among the real tokens (``[B, N]`` masks; the real ones gathered to the front)."""
    nb = -(-n // w)
    t = torch.arange(nb, device=device)[:, None]
    queries = t * w + torch.arange(w, device=device)  # [nb, w] ranks
    keys = t * w - w + torch.arange(3 * w, device=device)  # [nb, 3w] ranks
    queries = torch.where(queries < n, queries, n)
    keys = torch.where((keys >= 0) & (keys < n), keys, n)
    pairs = (queries[:, :, None] - keys[:, None, :]).abs() <= w
    q_order, k_order = real_first_pair(query_valid, key_valid)
    q_slot = torch.arange(n, device=device).expand(b, n) if q_order is None else q_order.rank
    return ExactBlocks(
        _positions(queries, q_order, b, h), _positions(keys, k_order, b, h),
        q_slot[:, None, :].expand(b, h, n), pairs,
    )


def _positions(rank: Tensor, gathered: RealFirst | None, b: int, h: int) -> Tensor:
    """``[nb, s]`` ranks (N = empty) -> ``[B, H, nb, s]`` positions (N = empty)."""
    if gathered is None:
        return rank.expand(b, h, *rank.shape)
    order = gathered.order
    n = order.shape[1]
    order = torch.cat([order, order.new_full((order.shape[0], 1), n)], dim=1)  # [B, N + 1]
    return order[:, rank][:, None].expand(b, h, *rank.shape)


def lsh_blocks(q: Tensor, k: Tensor, hyperplanes: Tensor, block: int,
               query_valid: Tensor | None, key_valid: Tensor | None) -> ExactBlocks:
    """KDEformer's Hamming-ordered equal-sized LSH buckets of ``block`` keys."""
    blocks = hamming_blocks(q, k, hyperplanes, block, query_valid=query_valid, key_valid=key_valid)
    return ExactBlocks(blocks.q_index, blocks.k_index, blocks.q_slot, None)


def exact_blocks_part(
    q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, dots: Tensor, member: Tensor,
    assignment: Tensor, log_mass: Tensor, far_live: Tensor, delta_kbar: Tensor, blocks: ExactBlocks,
) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor]:
    """Exact terms of the blocks' keys (not already near) and their far-field model weights.

    Args:
        dots: ``[B, H, c, Nk]`` z_a.k_j; member: ``[B, H, c, Nk]`` near keys of each cluster.
        assignment: ``[B, H, Nq]``; log_mass: ``[B, H, c]`` log R_a; far_live: ``[B, H, Nq, 1]``;
        delta_kbar: ``[B, H, Nq, 1]`` delta_i.kbar_a.
    Returns:
        ((log scale, numerator, denominator) of the exact part, removed numerator and
        removed weight, relative to the far mass), each per query ``[B, H, Nq, .]``.
    """
    b, h = q.shape[:2]
    nk = k.shape[2]
    c = dots.shape[2]
    qi, kj = blocks.q_index, blocks.k_index  # [B, H, nb, sq], [B, H, nb, sk]
    qb = gather_block_rows(q, qi)  # [B, H, nb, sq, D]
    kb = gather_block_rows(k, kj)  # [B, H, nb, sk, D]
    vb = gather_block_rows(v, kj)
    bias = gather_block_values(key_bias, kj, _NEG_INF)[..., None, :]  # [B, H, nb, 1, sk]
    a = gather_block_values(assignment, qi, 0)[..., None]  # [B, H, nb, sq, 1]
    flat = a * nk + kj.clamp_max(nk - 1)[..., None, :]  # [B, H, nb, sq, sk]
    near = member.reshape(b, h, c * nk).gather(2, flat.view(b, h, -1)).view(flat.shape)
    mask = torch.isfinite(bias) & ~near
    if blocks.pairs is not None:
        mask = mask & blocks.pairs
    block_dots = qb @ kb.transpose(-1, -2)  # [B, H, nb, sq, sk]
    scores = (block_dots + bias).masked_fill_(~mask, _NEG_INF)
    top = scores.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = (scores - top).exp_()
    num = e @ vb
    den = e.sum(-1, keepdim=True)
    top = torch.where(den > 0, top, _NEG_INF)

    # First-order far-field model weight of key j for query i, relative to R_a.
    # z_a.k_j
    centre_dots = dots.reshape(b, h, c * nk).gather(2, flat.view(b, h, -1)).view(flat.shape)
    live = gather_block_values(far_live[..., 0], qi, False)[..., None]  # [B, H, nb, sq, 1]
    log_mass_q = torch.where(live, log_mass.gather(2, a.view(b, h, -1)).view(a.shape), 0.0)
    dk = gather_block_values(delta_kbar[..., 0], qi, 0.0)[..., None]
    linear = (1.0 + (block_dots - centre_dots) - dk).clamp_min(0.0)
    weight = (centre_dots + bias - log_mass_q).clamp_max(0.0).exp() * linear
    weight = torch.where(mask & live, weight, 0.0)
    removed_num = weight @ vb
    removed_den = weight.sum(-1, keepdim=True)

    def back(x: Tensor) -> Tensor:  # block layout -> query order
        x = x.reshape(b, h, -1, x.shape[-1])
        return gather_rows(x, blocks.q_slot)

    return (back(top), back(num), back(den)), back(removed_num), back(removed_den)
