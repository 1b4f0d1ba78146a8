"""Whole-row gathers by ``index_select`` on a flattened view.

``x.gather(dim, index[..., None].expand(..., D))`` reads and writes element by element
on CPU; copying whole rows of a flattened ``[M, D]`` view with offset indices
(``index_select``, whose backward is a row-wise ``index_add``) gives the same values and
gradients and is about 10x faster for rows of 32-64 floats.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x`` picked per leading batch entry.

    Args:
        x: ``[*L, R, C]``.
        index: ``[*L', *S]`` long with entries in ``[0, R)`` (not checked: an entry
            past R reads a row of the next leading entry), where ``L'`` has as many
            dims as ``L`` and ``L`` broadcasts to ``L'`` (e.g. ``x[:, None]`` reads the
            same rows for every entry of a new dim).
    Returns:
        ``[*L', *S, C]`` with ``out[l, s] = x[l, index[l, s]]``: the values (and, through
        ``index_select``'s backward, the gradients) of ``torch.gather`` along ``R`` with
        ``index`` expanded over ``C``.
    """
    lead = x.dim() - 2
    if lead < 0 or index.dim() < lead:
        raise ValueError(
            f"gather_rows needs x with at least 2 dims and index with at least {max(lead, 0)} "
            f"leading dims; got x {tuple(x.shape)} and index {tuple(index.shape)}."
        )
    r, c = x.shape[-2:]
    batch = index.shape[:lead]
    groups = math.prod(x.shape[:lead])
    # Offset of each leading entry's first row in the flattened [groups * R, C] table;
    # broadcast dims of x read the same rows.
    offset = torch.arange(0, groups * r, r, device=x.device).view(x.shape[:lead])
    flat = index.reshape(*batch, -1) + offset.expand(batch)[..., None]
    rows = x.reshape(groups * r, c).index_select(0, flat.reshape(-1))
    return rows.view(*index.shape, c)
