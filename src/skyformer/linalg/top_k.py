"""The k largest entries with ties broken by position, at ``torch.topk``'s cost.

``torch.topk`` leaves the order of equal values unspecified, and which of several equal
values it keeps at the k-th place depends on the length of the dimension: a sequence
padded by a few keys kept another of its tied keys (or queries) than the sequence
alone, and its output changed (Informer's active queries, the multipole methods' near
keys, the adaptive method's top keys: up to 0.5 on inputs with repeated rows or
integer values). Here ties go to the lowest index, which padding after the real
tokens does not move, as a stable sort would order them (Informer's reference does);
a full stable sort cost 28 times ``topk`` on the multipole's ``[c, N]`` logits at
N = 16384.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(values, indices)`` of the ``k`` largest entries of ``x`` along its last dim,
    ordered by value (largest first), equal values by index (lowest first): the first
    ``k`` of a stable descending sort. ``x: [..., n]``, ``k <= n``; no gradient through
    the choice (the values are gathered from ``x``). NaN counts as above every number,
    as in ``torch.topk`` and ``torch.sort``, and NaNs tie with each other."""
    n = x.shape[-1]
    if k == 0 or n == 0:
        return x[..., :0], torch.zeros(*x.shape[:-1], 0, dtype=torch.long, device=x.device)
    with torch.no_grad():
        threshold = x.detach().topk(k, dim=-1).values[..., -1:]  # the k-th largest
        above = (x > threshold) | x.isnan()
        tied = x == threshold
        room = k - above.sum(-1, keepdim=True)  # how many of the tied entries fit
        chosen = above | (tied & (tied.int().cumsum(-1, dtype=torch.int32) <= room))
        # the chosen entries by index (a larger key for a lower index), then by value
        position = torch.arange(n, 0, -1, device=x.device)
        by_index = torch.where(chosen, position, 0).topk(k, dim=-1).indices  # ascending
        order = x.detach().gather(-1, by_index).sort(dim=-1, descending=True,
                                                     stable=True).indices
        indices = by_index.gather(-1, order)
    return x.gather(-1, indices), indices
