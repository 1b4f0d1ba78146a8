"""k-means clusters of the rows of a ``[B, H, N, D]`` tensor, per batch element and head.

Lloyd's algorithm (Lloyd 1982) run on a uniform sub-sample of the valid rows, then one
assignment of every row to its nearest centre. Costs: ``iterations * s * c * D`` for the
sub-sample of ``s`` rows and ``N * c * D`` for the final assignment, i.e. O(N c D).

Randomness: one selection key per row (``landmarks.selection_keys``: a uniform score
indexed by the batch element and the row's rank among the valid rows, that rank as
tie-break). The valid rows with the smallest keys form the sub-sample (in key order)
and its first ``c`` rows are the initial centres. The keys are distinct, so neither
the sub-sample nor its order is left to how a sort breaks ties, and padding anywhere
draws the clusters that truncation draws. Heads share the draw, batch elements never
interact.

Gradients: the assignments are piecewise constant and carry no gradient; the returned
centres are the means of their members' rows *with* gradient (as Nystromformer's
segment means), so ``d centre / d row = 1 / |cluster|`` for members.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .landmarks import PADDED_KEY, selection_keys, smallest_keys
from .rng import random_key, stream


@dataclass(frozen=True)
class Clusters:
    """k-means clusters of N rows, per batch element and head."""

    centres: Tensor  # [B, H, c, D]  mean of the members (0 for empty clusters)
    assignment: Tensor  # [B, H, N] long in [0, c); padded rows go to their nearest live centre
    live: Tensor  # [B, H, c] bool, False for empty clusters
    sizes: Tensor  # [B, H, c] number of valid members


def _nearest(x: Tensor, z: Tensor, live: Tensor) -> Tensor:
    """Index of the nearest live centre ``[B, H, n]``: argmin of |z|^2 - 2 x.z (|x|^2
    is the same for every centre), dead centres at +inf."""
    b, h, n, d = x.shape
    c = z.shape[2]
    norms = (z * z).sum(-1).masked_fill(~live, float("inf"))  # [B, H, c]
    dist = torch.baddbmm(
        norms.reshape(b * h, 1, c), x.reshape(b * h, n, d), z.reshape(b * h, c, d).transpose(1, 2),
        alpha=-2.0,
    )
    return dist.argmin(-1).view(b, h, n)


def _means(
    x: Tensor, assignment: Tensor, weight: Tensor | None, count: int
) -> tuple[Tensor, Tensor]:
    """Weighted member means ``[B, H, c, D]`` and member weights ``[B, H, c]``
    (``weight`` ``[B, H, N]``; ``None``: every row weighs 1).

    On CUDA as one product with the weighted one-hot matrix (a scatter-add serialises on
    collisions); on CPU, where an index-add is a plain loop, by index-add, which skips
    the [N, c] one-hot matrix (and its copy kept for the backward pass).
    """
    if x.device.type == "cpu":
        return _means_index_add(x, assignment, weight, count)
    return _means_one_hot(x, assignment, weight, count)


def _means_index_add(
    x: Tensor, assignment: Tensor, weight: Tensor | None, count: int
) -> tuple[Tensor, Tensor]:
    """``_means`` by index-add over the flattened (batch, head, cluster) slots."""
    b, h, _, d = x.shape
    slots = torch.arange(b * h, device=x.device).view(b, h, 1) * count
    flat = (assignment + slots).reshape(-1)
    # out of place: under vmap over random keys the assignment is batched and the zeros
    # are not, and an in-place add cannot write a batch into an unbatched tensor
    if weight is None:  # every row counts once: skip the product by ones (and its backward)
        sizes = x.new_zeros(b * h * count).index_add(0, flat, x.new_ones(flat.shape))
        rows = x.reshape(-1, d)
    else:
        sizes = x.new_zeros(b * h * count).index_add(0, flat, weight.reshape(-1))
        rows = (x * weight[..., None]).reshape(-1, d)
    sums = x.new_zeros(b * h * count, d).index_add(0, flat, rows)
    sizes = sizes.view(b, h, count)
    return sums.view(b, h, count, d) / sizes.clamp_min(1.0)[..., None], sizes


def _means_one_hot(
    x: Tensor, assignment: Tensor, weight: Tensor | None, count: int
) -> tuple[Tensor, Tensor]:
    """``_means`` as one product with the weighted one-hot matrix."""
    # a comparison, not one_hot: one_hot writes with scatter_, which vmap cannot batch
    # when the assignment is batched and its zeros are not (per-sample gradients on CUDA)
    classes = torch.arange(count, device=assignment.device)
    onehot = (assignment[..., None] == classes).to(x.dtype)
    if weight is not None:
        onehot.mul_(weight[..., None])
    sizes = onehot.sum(-2)  # [B, H, c]
    sums = onehot.transpose(-1, -2) @ x  # [B, H, c, D]
    return sums / sizes.clamp_min(1.0)[..., None], sizes


def kmeans_clusters(
    x: Tensor,
    num_clusters: int,
    *,
    valid: Tensor | None = None,
    generator: torch.Generator | Tensor | None = None,
    iterations: int = 10,
    sample: int | None = None,
    live_clusters: Tensor | None = None,
    keys: Tensor | None = None,
) -> Clusters:
    """Cluster the rows of ``x`` with k-means.

    Args:
        x: ``[B, H, N, D]``.
        num_clusters: c >= 1, the number of centres (slots); capped by the valid rows.
        valid: ``[B, N]`` bool, True = real row; padded rows take no part.
        generator: draws the sub-sample and the initial centres (a generator or a random
            key; the draws are indexed by each row's rank among the valid rows).
        iterations: Lloyd iterations on the sub-sample.
        sample: sub-sample size (``None`` = every valid row).
        live_clusters: ``[B, H]`` long, optional per-head number of centres <= c
            (slots beyond it stay empty), used to give heads different budgets.
        keys: ``[B, N]`` int64 selection keys drawn by the caller
            (``landmarks.selection_keys``; then ``generator`` is unused), for callers
            that draw all their randomness at once.
    Returns:
        ``Clusters``; ``centres`` are differentiable member means.
    """
    if num_clusters < 1:  # a comparison, not an int check: a compiled size may be symbolic
        raise ValueError(f"kmeans_clusters: num_clusters must be a positive integer, got "
                         f"{num_clusters!r}.")
    b, h, n, d = x.shape
    if keys is None:
        keys = selection_keys(stream(random_key(generator, x.device), "kmeans"), valid, b, n)
    s = n if sample is None else max(min(sample, n), min(num_clusters, n))
    index, picked = smallest_keys(keys, s)  # [B, s]
    sample_live = picked < PADDED_KEY  # [B, s]
    c = num_clusters
    with torch.no_grad():
        xs = x.detach().gather(2, index[:, None, :, None].expand(b, h, s, d))  # [B, H, s, D]
        init = xs[:, :, :c]
        live = sample_live[:, None, :c].expand(b, h, -1)
        if c > s:  # more slots than rows: the extra slots stay empty
            init = torch.cat([init, init.new_zeros(b, h, c - s, d)], dim=2)
            live = torch.cat([live, live.new_zeros(b, h, c - s)], dim=2)
        if live_clusters is not None:
            slot = torch.arange(c, device=x.device)
            live = live & (slot < live_clusters[..., None])
        weight = sample_live[:, None, :].to(x.dtype).expand(b, h, s)
        centres = init
        for _ in range(iterations):
            assign = _nearest(xs, centres, live)  # [B, H, s]
            means, sizes = _means(xs, assign, weight, c)
            # An emptied cluster keeps its previous centre (it may win rows back).
            centres = torch.where((sizes > 0)[..., None], means, centres)
        assignment = _nearest(x.detach(), centres, live)  # [B, H, N]
    row_weight = None if valid is None else valid[:, None, :].to(x.dtype).expand(b, h, n)
    means, sizes = _means(x, assignment, row_weight, c)
    live = sizes > 0
    if live.shape[-1]:
        # Fully padded sequences: keep one live (zero) centre so that every row has one.
        first = torch.zeros_like(live)
        first[..., 0] = True
        live = live | (first & ~live.any(-1, keepdim=True))
    return Clusters(means, assignment, live, sizes)
