"""The exact part on angular-LSH blocks shared by KDEformer and Scatterbrain: its options
and its logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...sketch import (
    LshBlocks,
    gather_block_rows,
    gather_block_values,
    hamming_blocks,
    scatter_block_rows,
)
from .options import check_budget, check_nonnegative_int, check_positive_int

MAX_HYPERPLANES = 30  # 2^r buckets must index in a long


@dataclass(frozen=True)
class LshBlockOptions:
    """Options common to KDEformer and Scatterbrain (defaults of the comparison code).

    num_features: m, the budget of the approximate (sampled or random-feature) part (128).
    block_size: keys per LSH block of the exact sparse part; None = num_features // 2;
        0 = no sparse part.
    num_hyperplanes: rank r of the angular LSH (Definition A.1 of KDEformer), 2^r
        buckets before balancing (7).
    """

    num_features: int = 128
    block_size: int | None = None
    num_hyperplanes: int = 7

    def validate(self, method: str) -> None:
        check_budget(method, "num_features", self.num_features)
        if self.block_size is not None:
            check_nonnegative_int(method, "block_size", self.block_size)
        check_positive_int(method, "num_hyperplanes", self.num_hyperplanes)
        if self.num_hyperplanes > MAX_HYPERPLANES:
            raise ValueError(
                f"{method}: num_hyperplanes must be at most {MAX_HYPERPLANES} (2^r buckets), "
                f"got {self.num_hyperplanes}."
            )

    def refuse_unused_hyperplanes(self, method: str, without_lsh: str | None) -> None:
        """A ``num_hyperplanes`` other than the default where no LSH runs (``without_lsh``:
        why none does, ``None`` where one does) is refused: it would change nothing."""
        default = type(self).__dataclass_fields__["num_hyperplanes"].default
        if without_lsh is not None and self.num_hyperplanes != default:
            raise ValueError(
                f"{method}: num_hyperplanes={self.num_hyperplanes!r} shapes the LSH buckets "
                f"of the sparse part, and {without_lsh}, where it changes nothing: leave "
                f"it out.")

    def budget_caps(self, nq: int, nk: int) -> dict[str, int]:
        """Options to change for Nq, Nk tokens: blocks of at most the sequence. The
        sampled or random-feature budget is bounded at construction
        (``options.MAX_BUDGET``)."""
        n = max(nq, nk, 1)
        return {"block_size": n} if self.blocks > n else {}

    @property
    def blocks(self) -> int:
        """Keys per block of the sparse part (0: none)."""
        return self.num_features // 2 if self.block_size is None else self.block_size


@dataclass(frozen=True)
class LshBlockLogits:
    """The exact part of one call: Hamming-ordered LSH blocks and their logits."""

    blocks: LshBlocks
    logits: Tensor  # [B, H, nb, sq, sk], -inf at padded keys
    row_max: Tensor  # [B, H, Nq] largest block logit of each query (-inf if none)


def lsh_block_logits(q: Tensor, k: Tensor, hyperplanes: Tensor, block_size: int,
                     query_valid: Tensor | None, key_valid: Tensor | None) -> LshBlockLogits:
    """Logits q.k of every query with the keys of its LSH block (KDEformer Definition A.3,
    Figure 6; Scatterbrain's sparse support). ``q: [B, H, Nq, D]`` (already scaled),
    ``k: [B, H, Nk, D]``, ``hyperplanes: [B, H, D, r]``."""
    blocks = hamming_blocks(q, k, hyperplanes, block_size,
                            query_valid=query_valid, key_valid=key_valid)
    key_ok = key_valid if key_valid is not None else torch.ones(
        k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    kb_ok = gather_block_values(key_ok[:, None, :], blocks.k_index, False)  # [B, H, nb, sk]
    logits = gather_block_rows(q, blocks.q_index) @ gather_block_rows(
        k, blocks.k_index).transpose(-1, -2)
    logits = logits.masked_fill(~kb_ok[..., None, :], float("-inf"))  # [B, H, nb, sq, sk]
    row_max = scatter_block_rows(logits.detach().amax(-1, keepdim=True), blocks)[..., 0]
    return LshBlockLogits(blocks, logits, row_max)
