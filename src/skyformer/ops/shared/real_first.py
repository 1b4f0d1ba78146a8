"""Real tokens gathered to the front, in order, and put back.

A pattern over positions (a local window, a convolution along the sequence) run on the
gathered rows acts on ranks among the real tokens: left padding and holes then give
what the real tokens give packed at the front, as every other part of the library does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.rows import permute_rows


def real_first_order(valid: Tensor | None) -> Tensor | None:
    """``[B, N]`` long: the positions of the real tokens in order, then the padded ones
    (``valid: [B, N]`` bool, True = real); None without padding."""
    if valid is None:
        return None
    return torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)


def to_real_first(x: Tensor, order: Tensor | None) -> Tensor:
    """``[B, H, N, F] -> [B, H, N, F]``, row r the token at ``order[:, r]`` (the real
    token of rank r); ``x`` itself when ``order`` is None. A permutation: its gradient
    is gathered back (``linalg.rows.permute_rows``)."""
    if order is None:
        return x
    return _permuted(x, order, real_first_rank(order))


def _permuted(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """Rows of ``x: [B, H, N, F]`` permuted by ``index: [B, N]`` (inverse ``inverse``)."""
    heads = x.shape[:3]
    return permute_rows(x, index[:, None, :].expand(*heads), inverse[:, None, :].expand(*heads))


def real_first_rank(order: Tensor) -> Tensor:
    """``[B, N]`` long, the inverse permutation of ``order``: the row of each position
    among the gathered ones (its rank among the real tokens, for a real one)."""
    rank = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.zeros_like(order).scatter(1, order, rank)  # not in place: vmap


def from_real_first(x: Tensor, order: Tensor | None) -> Tensor:
    """Inverse of ``to_real_first``: row ``order[:, r]`` of the result is row r of ``x``."""
    if order is None:
        return x
    return _permuted(x, real_first_rank(order), order)


def real_first_mask(valid: Tensor | None, order: Tensor | None) -> Tensor | None:
    """The mask of the gathered rows, ``[B, N]``: True for the first n_valid."""
    if valid is None or order is None:
        return valid
    return valid.gather(1, order)
