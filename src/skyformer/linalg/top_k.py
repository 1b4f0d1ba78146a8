"""The k largest entries with ties broken by position, without a full sort.

``torch.topk`` leaves the order of equal values unspecified, and which of several equal
values it keeps at the k-th place depends on the length of the dimension: a sequence
padded by a few keys kept another of its tied keys (or queries) than the sequence
alone, and its output changed (Informer's active queries, the multipole methods' near
keys, the adaptive method's top keys: up to 0.5 on inputs with repeated rows or
integer values). Here ties go to the lowest index, which padding after the real
tokens does not move, as a stable sort would order them (Informer's reference does).
Two ``topk`` passes over the dimension and sorts of 2k entries: on the multipole's
``[1, 2, 64, N]`` logits with k = 65, one CPU thread, 1.7 and 2.6 times ``torch.topk``'s
time at N = 4096 and 16384, where a full stable sort took 6.7 and 26 times
(``python benchmarks/topk_ties.py``, ``benchmarks/results/topk_ties.json``).
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
        xd = x.detach()
        values, index = xd.topk(k, dim=-1)  # the right values; among ties, any entries
        threshold = values[..., -1:]  # the k-th largest
        nan_threshold = threshold.isnan()
        # the entries tied with it, lowest positions first (a larger key for a lower one)
        tied = (xd == threshold) | (xd.isnan() & nan_threshold)
        position = torch.arange(n, 0, -1, device=x.device, dtype=torch.int32)
        tied_first = torch.where(tied, position, 0).topk(k, dim=-1).indices
        # topk's entries above the k-th largest, then as many tied ones as fit: k a row
        above = (values > threshold) | (values.isnan() & ~nan_threshold)
        room = k - above.sum(-1, keepdim=True)
        keep = torch.cat([above, torch.arange(k, device=x.device) < room], -1)
        candidates = torch.where(keep, torch.cat([index, tied_first], -1), n)
        by_index = candidates.sort(dim=-1).values[..., :k]  # the k kept, by position
        order = xd.gather(-1, by_index).sort(dim=-1, descending=True, stable=True).indices
        indices = by_index.gather(-1, order)
    return x.gather(-1, indices), indices
