"""Real tokens gathered to the front, in order, and put back.

A pattern over positions (a local window, a convolution along the sequence) run on the
gathered rows acts on ranks among the real tokens: left padding and holes then give
what the real tokens give packed at the front, as every other part of the library does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg.rows import permute_rows


@dataclass(frozen=True)
class RealFirst:
    """The real tokens gathered to the front: ``order`` ``[B, N]`` long, the positions of
    the real tokens in order, then the padded ones; ``rank`` its inverse, the row of
    each position among the gathered ones (its rank among the real tokens, for a real
    one). Both are made once a mask and serve every gather and its way back."""

    order: Tensor
    rank: Tensor


def real_first(valid: Tensor | None) -> RealFirst | None:
    """The real-first order of ``valid: [B, N]`` bool (True = real); None without
    padding."""
    if valid is None:
        return None
    order = real_positions_first(valid)
    return RealFirst(order, real_first_rank(order))


def real_positions_first(valid: Tensor) -> Tensor:
    """``[B, N]`` long: the positions of the real tokens of ``valid: [B, N]`` in order,
    then the padded ones (a stable sort)."""
    return torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)


def real_first_pair(query_valid: Tensor | None, key_valid: Tensor | None
                    ) -> tuple[RealFirst | None, RealFirst | None]:
    """``real_first`` of the query and key masks, made once where they are one mask."""
    queries = real_first(query_valid)
    return queries, (queries if key_valid is query_valid else real_first(key_valid))


def real_first_rank(order: Tensor) -> Tensor:
    """``[B, N]`` long, the inverse permutation of ``order``."""
    rank = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.zeros_like(order).scatter(1, order, rank)  # not in place: vmap


def to_real_first(x: Tensor, gathered: RealFirst | None) -> Tensor:
    """``[B, H, N, F] -> [B, H, N, F]``, row r the token at ``order[:, r]`` (the real
    token of rank r); ``x`` itself without padding. A permutation: its gradient is
    gathered back (``linalg.rows.permute_rows``)."""
    if gathered is None:
        return x
    return _permuted(x, gathered.order, gathered.rank)


def from_real_first(x: Tensor, gathered: RealFirst | None) -> Tensor:
    """Inverse of ``to_real_first``: row ``order[:, r]`` of the result is row r of ``x``."""
    if gathered is None:
        return x
    return _permuted(x, gathered.rank, gathered.order)


def _permuted(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """Rows of ``x: [B, H, N, F]`` permuted by ``index: [B, N]`` (inverse ``inverse``)."""
    heads = x.shape[:3]
    return permute_rows(x, index[:, None, :].expand(*heads), inverse[:, None, :].expand(*heads))


def real_first_mask(valid: Tensor | None, gathered: RealFirst | None) -> Tensor | None:
    """The mask of the gathered rows, ``[B, N]``: True for the first n_valid."""
    if valid is None or gathered is None:
        return valid
    return valid.gather(1, gathered.order)
