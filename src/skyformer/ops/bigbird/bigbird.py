"""BigBird block-sparse attention (Zaheer et al., NeurIPS 2020), ITC construction.

The sequence is cut into blocks of b tokens. Exact softmax attention is computed on a
block-sparse pattern (the paper's Section 2 graph, blockified as in its Appendix D):

- global blocks: the first and the last block attend to every key and every query
  attends to them (the internal-transformer construction, g = 2 blocks);
- sliding window: query block i attends to key blocks i-1, i, i+1 (w = 3 blocks);
- random: query block i attends to r = 3 further blocks drawn uniformly without
  replacement among the blocks that are neither global nor in its window, independently
  per head (as the reference code; per call, from ``generator``).

With the paper's base setting b = 64 and r = 3, a query outside the global blocks sees
(3 + 2 + 3) b = 512 keys. ``num_features`` is that per-query key budget: the block size
is b = num_features // (5 + r) (at least 1), so the default 512 gives b = 64, and the
Skyformer comparisons' 128 would give b = 16.

Computation without an n x n matrix: for each query block the 5 + r key blocks are
gathered (``[B, H, nb, (5 + r) b, D]``) and attended to by fused masked SDPA (the
``[b, (5 + r) b]`` logits are never stored); the two global query blocks attend to all
keys. Time O(N (5 + r) b D), memory O(N (5 + r) D) for the gathered blocks: linear in N.

Padding. Blocks are formed over the *real* tokens, gathered to the front in order
(``order``, ``shared/real_first.py``), so the last global block is the last block of
real tokens, a padded sequence has the layout of its truncation, and N need not be a
multiple of b (the last block is partial; its missing tokens are masked). Duplicate
blocks (a window block that is also global) are counted once. With a single block
(b >= n) attention is dense: exact softmax attention. Nq = Nk only: the window relates
query block i to key block i. A query mask of its own (cross-attention of equal lengths)
gathers the real queries by their own order: query block i, of the real queries, against
the key blocks of the real keys (the global query blocks are the first and last real
query blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...linalg import gather_rows
from ...linalg.scores import logit_scale
from ...registry import Capabilities, register
from ...sketch.rng import fold_in, random_key, uniform
from ..shared.inputs import (
    check_attention_inputs,
    compute_dtype,
    resolve_key,
    zero_padded_queries,
)
from ..shared.masked import masked_attention
from ..shared.options import (
    MAX_BUDGET,
    check_budget,
    check_finite_scale,
    check_nonnegative_int,
)
from ..shared.real_first import RealFirst, from_real_first, real_first_pair, to_real_first

WINDOW_BLOCKS = 3
GLOBAL_BLOCKS = 2
PAPER_RANDOM_BLOCKS = 3  # runs at any budget (blocks of one key below 8 keys)


@dataclass(frozen=True)
class BigBirdConfig:
    """Options of BigBird; defaults are the paper's (block 64, 3 random blocks).

    num_features: keys each non-global query attends to, (3 + 2 + r) * block size;
        block size = num_features // (5 + r) (default 512 -> 64).
    num_random_blocks: r, random key blocks per query block; at most num_features - 5
        (each of the 5 + r blocks holds at least one key), or 3 (the paper's).
    scale: softmax logit scale s, ``None`` = 1/sqrt(head dim).
    """

    # no float32 step whose derivative a compiled backward would cast (amp.py)
    FLOAT32_STEPS: ClassVar[bool] = False

    num_features: int = 512
    num_random_blocks: int = 3
    scale: float | None = None

    def __post_init__(self) -> None:
        check_budget("bigbird", "num_features", self.num_features)
        check_nonnegative_int("bigbird", "num_random_blocks", self.num_random_blocks)
        self._check_random_blocks_fit()
        check_finite_scale("bigbird", self.scale)

    def _check_random_blocks_fit(self) -> None:
        """r above num_features - 5 would gather 5 + r keys a query, over the budget
        (memory N (5 + r) D: a typo such as 10**9 asked for hundreds of GB)."""
        fixed = WINDOW_BLOCKS + GLOBAL_BLOCKS
        most = max(PAPER_RANDOM_BLOCKS, self.num_features - fixed)
        r = self.num_random_blocks
        if r > most:
            raise_budget = f", or num_features >= {fixed + r}" if fixed + r <= MAX_BUDGET else ""
            raise ValueError(
                f"bigbird: num_random_blocks={r} does not fit num_features="
                f"{self.num_features}, the keys each query attends to: its {fixed} + r "
                f"blocks hold at least one key each, so at most {most} random blocks fit "
                f"(the paper's {PAPER_RANDOM_BLOCKS} always runs). Pass num_random_blocks <= "
                f"{most}{raise_budget}.")

    @property
    def draws_nothing_because(self) -> str | None:
        """Why these options draw nothing (``skyformer check``): no random blocks."""
        return "num_random_blocks=0 leaves the window and global blocks alone" \
            if self.num_random_blocks == 0 else None

    @property
    def block_size(self) -> int:
        return max(1, self.num_features // (WINDOW_BLOCKS + GLOBAL_BLOCKS + self.num_random_blocks))


@dataclass(frozen=True)
class RealBlocks:
    """The real queries (or keys) of one call gathered to the front and cut into blocks."""

    order: RealFirst | None  # real positions first, in order (None: no padding)
    n_valid: Tensor  # [B] long
    last: Tensor  # [B] long: index of the last real block (-1 if none)


def real_blocks(valid: Tensor | None, gathered: RealFirst | None, batch: int, n: int,
                block_size: int, device: torch.device) -> RealBlocks:
    """The blocks of the real tokens of ``valid: [B, N]`` (None: all real), gathered by
    ``gathered`` (``real_first(valid)``)."""
    if valid is None:
        n_valid = torch.full((batch,), n, device=device, dtype=torch.long)
    else:
        n_valid = valid.sum(dim=1)
    last = torch.div(n_valid + block_size - 1, block_size, rounding_mode="floor") - 1
    return RealBlocks(gathered, n_valid, last)


@dataclass(frozen=True)
class BigBirdLayout:
    """The block pattern of one call, over the real tokens gathered to the front: query
    block i (of the real queries) against key blocks (of the real keys)."""

    block_size: int
    queries: RealBlocks
    keys: RealBlocks
    random: Tensor  # [B, H, nb, r] long: random key blocks of each query block
    random_live: Tensor  # [B, H, nb, r] bool

    @property
    def num_blocks(self) -> int:
        return self.random.shape[2]


def _choose_random_blocks(u: Tensor, last: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Random blocks from uniforms ``u: [B, H, nb, r]``: pick j maps floor(u (c - j)) to
    the (that)-th candidate not yet chosen, among the c middle blocks 1..L-1 outside the
    window i-1..i+1 (a uniform draw without replacement)."""
    b, h, nb, _ = u.shape
    device = u.device
    i = torch.arange(nb, device=device)[None, :]  # [1, nb]
    last = last[:, None]  # [B, 1]
    w_lo = torch.clamp(i - 1, min=1)
    w_hi = torch.minimum(i + 1, last - 1)
    in_window = (w_hi - w_lo + 1).clamp_min(0)  # [B, nb]
    candidates = ((last - 1).clamp_min(0) - in_window).clamp_min(0)  # [B, nb]
    c = candidates[:, None, :]  # [B, 1, nb]
    picks: list[Tensor] = []
    for j in range(r):
        t = (u[..., j] * (c - j).clamp_min(0)).long()  # [B, H, nb]
        t = torch.minimum(t, (c - j - 1).clamp_min(0))
        if picks:  # the t-th candidate left is t + #{earlier picks s_m (sorted) with
            # s_m - m <= t}: s_m - m candidates left lie below s_m
            below = torch.sort(torch.stack(picks, dim=-1), dim=-1).values \
                - torch.arange(j, device=device)
            t = t + (below <= t[..., None]).sum(dim=-1)
        picks.append(t)
    ranks = torch.stack(picks, dim=-1) if picks else u.new_zeros(b, h, nb, 0, dtype=torch.long)
    alive = (c[..., None] > torch.arange(r, device=device)).expand(b, h, nb, r)
    blocks = 1 + ranks
    blocks = blocks + torch.where(blocks >= w_lo[:, None, :, None], in_window[:, None, :, None], 0)
    return blocks.masked_fill(~alive, 0), alive


def bigbird_layout(
    query_valid: Tensor | None,
    key_valid: Tensor | None,
    batch: int,
    heads: int,
    n: int,
    block_size: int,
    num_random_blocks: int,
    device: torch.device,
    generator: torch.Generator | Tensor | None,
) -> BigBirdLayout:
    """Draw the random blocks of one call: block i of sequence b draws its ``[H, r]``
    uniforms from sequence b's counter-based stream (``sketch/rng.py``), so a sequence
    draws what its truncation draws, whatever the other sequences. ``query_valid``,
    ``key_valid``: ``[B, N]`` (None: all real); one tensor for self-attention."""
    q_order, k_order = real_first_pair(query_valid, key_valid)
    queries = real_blocks(query_valid, q_order, batch, n, block_size, device)
    keys = real_blocks(key_valid, k_order, batch, n, block_size, device)
    nb = math.ceil(n / block_size)
    r = num_random_blocks
    streams = fold_in(random_key(generator, device), torch.arange(batch, device=device))
    u = uniform(streams, (nb, heads, r))  # [B, nb, H, r]
    blocks, alive = _choose_random_blocks(u.permute(0, 2, 1, 3), keys.last, r)
    return BigBirdLayout(block_size, queries, keys, blocks, alive)


def _key_slots(layout: BigBirdLayout) -> tuple[Tensor, Tensor]:
    """Key blocks of every query block: ``[B, H, nb, 5 + r]`` indices and validity.

    Slots: first key block, last key block, window i-1, i, i+1, then the random blocks.
    Rows of the global query blocks and of query blocks past the last real one have no
    valid slot (the global rows are computed densely)."""
    b, h, nb, _ = layout.random.shape
    device = layout.random.device
    i = torch.arange(nb, device=device)[None, :]  # [1, nb]
    last = layout.keys.last[:, None]  # [B, 1]
    first_idx = torch.zeros_like(i).expand(b, nb)
    last_idx = last.clamp_min(0).expand(b, nb)
    window = [i - 1, i, i + 1]
    fixed = torch.stack([first_idx, last_idx] + [w.expand(b, nb) for w in window], dim=-1)
    middle_row = (i >= 1) & (i <= layout.queries.last[:, None] - 1)  # [B, nb]: sparse rows
    fixed_ok = torch.stack(
        [middle_row, middle_row & (last > 0)]
        + [middle_row & (w >= 1) & (w <= last - 1) for w in window],
        dim=-1,
    )  # [B, nb, 5]
    index = torch.cat([fixed[:, None].expand(b, h, nb, 5), layout.random], dim=-1)
    ok = torch.cat(
        [fixed_ok[:, None].expand(b, h, nb, 5), layout.random_live & middle_row[:, None, :, None]],
        dim=-1,
    )
    return index.clamp(0, nb - 1), ok


def _blocks(x: Tensor, nb: int, bs: int) -> Tensor:
    """``[B, H, N, D] -> [B, H, nb, bs, D]``, zero-padded to nb * bs."""
    pad = nb * bs - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, x.shape[3])], dim=2)
    return x.view(*x.shape[:2], nb, bs, x.shape[3])


def _gather_blocks(xb: Tensor, index: Tensor) -> Tensor:
    """Blocks ``index: [B, H, nb, S]`` of ``xb: [B, H, nb, bs, D]``: ``[B, H, nb, S * bs, D]``."""
    b, h, nb, bs, d = xb.shape
    s = index.shape[-1]
    offset = (torch.arange(b * h, device=xb.device) * nb).view(b, h, 1, 1)
    # whole-block row copies (index_select) are much faster than an expanded gather
    picked = xb.reshape(b * h * nb, bs * d).index_select(0, (offset + index).flatten())
    return picked.view(b, h, nb, s * bs, d)


def _sparse_rows(qb: Tensor, kb: Tensor, vb: Tensor, real: Tensor, layout: BigBirdLayout
                 ) -> Tensor:
    """Each query block against its window, global and random key blocks, by fused masked
    SDPA over (batch, head, query block): the ``[bs, S*bs]`` logits are never stored.
    ``qb, kb, vb: [B, H, nb, bs, D]``, ``real: [B, nb*bs]`` -> ``[B, H, nb, bs, Dv]``."""
    b, h, nb, bs, _ = qb.shape
    index, ok = _key_slots(layout)  # [B, H, nb, S]
    keys, values = _gather_blocks(kb, index), _gather_blocks(vb, index)  # [B, H, nb, S*bs, D]
    real_b = real.view(b, 1, nb, bs).expand(-1, h, -1, -1)
    key_ok = real_b.gather(2, index.reshape(b, h, -1, 1).expand(-1, -1, -1, bs))
    key_ok = (key_ok.view(*index.shape, bs) & ok[..., None]).flatten(-2)  # [B, H, nb, S*bs]
    bh = (b, h * nb)
    return masked_attention(
        qb.reshape(*bh, bs, -1),
        keys.reshape(*bh, keys.shape[-2], -1),
        values.reshape(*bh, keys.shape[-2], -1),
        key_ok.reshape(*bh, 1, -1),
    ).view(b, h, nb, bs, -1)


def _global_rows(qb: Tensor, kb: Tensor, vb: Tensor, real: Tensor, layout: BigBirdLayout
                 ) -> Tensor:
    """The global query blocks (first and last real block) against every real key:
    ``[B, H, 2, bs, Dv]``."""
    b, h, _, bs, _ = qb.shape
    last = layout.queries.last
    ends = torch.stack([torch.zeros_like(last), last.clamp_min(0)], dim=1)  # [B, 2]
    q_glob = gather_rows(qb.flatten(-2), ends[:, None, :].expand(-1, h, -1))
    q_glob = q_glob.view(b, h, 2 * bs, -1)  # [B, H, 2*bs, D]
    return masked_attention(
        q_glob, kb.flatten(2, 3), vb.flatten(2, 3), real[:, None, None, :]
    ).view(b, h, 2, bs, -1)


@register(
    "bigbird",
    BigBirdConfig,
    Capabilities(target="softmax", randomized=True, cross_attention=False, weights=True,
                 fixed_shapes_because="its number of blocks (num_features // (5 + r) "
                                      "tokens each) follows N"),
    summary="BigBird block-sparse attention: window + global + random blocks (block 64)",
)
def bigbird_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: BigBirdConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """BigBird block-sparse self-attention (module docstring), O(N num_features D) time.

    Args:
        q, k: ``[B, H, N, D]``; v: ``[B, H, N, Dv]`` (self-attention: Nq == Nk).
        key_padding_mask: ``[B, N]`` bool, True = real token.
        query_padding_mask: ``"auto"`` (the queries padded as the keys), ``None`` (every
            query real) or ``[B, N]`` bool of its own: query blocks are cut from the real
            queries gathered to the front, key blocks from the real keys.
        generator: draws the random blocks.
        config: the options (``BigBirdConfig``).
    Returns:
        ``[B, H, N, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="bigbird",
                                  query_padding_mask=query_padding_mask)
    if info.query_len != info.key_len:
        raise ValueError(
            f"bigbird cannot attend with a different number of queries and keys (got "
            f"Nq={info.query_len}, Nk={info.key_len}): its window relates query block i to "
            f"key block i."
        )
    key = resolve_key("bigbird", generator, q.device)
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = logit_scale(info.head_dim, config.scale)
    n, bs = info.key_len, config.block_size
    layout = bigbird_layout(info.query_valid, info.key_valid, info.batch, info.heads, n, bs,
                            config.num_random_blocks, q.device, key)
    qw = to_real_first(q.to(work) * s, layout.queries.order)
    kw, vw = (to_real_first(x.to(work), layout.keys.order) for x in (k, v))
    nb = layout.num_blocks
    real = torch.arange(nb * bs, device=q.device)[None, :] < layout.keys.n_valid[:, None]
    qb, kb, vb = _blocks(qw, nb, bs), _blocks(kw, nb, bs), _blocks(vw, nb, bs)
    out = _sparse_rows(qb, kb, vb, real, layout)  # [B, H, nb, bs, Dv]
    glob = _global_rows(qb, kb, vb, real, layout)  # [B, H, 2, bs, Dv]
    block = torch.arange(nb, device=q.device)[None, :]
    is_first = (block == 0)[:, None, :, None, None]
    is_last = (block == layout.queries.last[:, None])[:, None, :, None, None]
    out = torch.where(is_first, glob[:, :, :1], torch.where(is_last, glob[:, :, 1:], out))

    out = from_real_first(out.flatten(2, 3)[:, :, :n], layout.queries.order)  # [B, H, N, Dv]
    return zero_padded_queries(out, info.query_valid).to(dtype)
