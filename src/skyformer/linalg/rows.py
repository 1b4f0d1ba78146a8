"""Whole-row gathers by ``index_select`` on a flattened view.

``x.gather(dim, index[..., None].expand(..., D))`` reads and writes element by element
on CPU; copying whole rows of a flattened ``[M, D]`` view with offset indices
(``index_select``, whose backward is a row-wise ``index_add``) gives the same values and
gradients and is about 10x faster for rows of 32-64 floats.

``gather_rows_through`` is the gather for a tensor that is also read whole elsewhere
(the landmark rows of Q and K, whose products read every row): autograd would give
the gather's gradient as a zero tensor of x's size with the rows added, then add it
to the gradient of the whole reads, three passes over an x-sized tensor and three
launches; passing x through the same node adds the rows' gradient to the other one
in a single out-of-place ``index_add``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .functional_ops import functional_ops_only


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
    _check(x, index)
    flat = _flat_index(x, index)
    rows = x.reshape(-1, x.shape[-1]).index_select(0, flat.reshape(-1))
    return rows.view(*index.shape, x.shape[-1])


def gather_rows_through(x: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """``(x, gather_rows(x, index))`` as one autograd node (module docstring): read x
    whole only through the first output, so that the gradient of the rows is added to
    the gradient of x in one ``index_add``. Values and gradients equal those of
    ``x`` and ``gather_rows(x, index)`` (double backward and ``vmap`` included); under
    forward-mode AD and ``torch.export`` they are x and ``gather_rows`` (a custom
    ``jvp`` rule would stop ``torch.compile``, which cannot trace one;
    ``functional_ops``)."""
    if functional_ops_only():
        return x, gather_rows(x, index)
    _check(x, index)
    through, rows = _RowsThrough.apply(x, _flat_index(x, index).reshape(-1))
    return through, rows.view(*index.shape, x.shape[-1])


class _RowsThrough(torch.autograd.Function):
    """(x, rows ``flat`` of x viewed as ``[M, C]``); the backward pass adds the rows'
    gradient into x's with ``index_add`` (differentiable, so double backward works)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return x, x.reshape(-1, x.shape[-1]).index_select(0, flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, flat = inputs
        ctx.save_for_backward(flat)
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor | None, grad_rows: Tensor | None
                 ) -> tuple[Tensor | None, None]:
        (flat,) = ctx.saved_tensors
        if grad_rows is None:
            return grad_x, None
        if grad_x is None:
            grad_x = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        width = ctx.shape[-1]
        summed = grad_x.reshape(-1, width).index_add(0, flat, grad_rows.reshape(-1, width))
        return summed.view(ctx.shape), None


def _check(x: Tensor, index: Tensor) -> None:
    lead = x.dim() - 2
    if lead < 0 or index.dim() < lead:
        raise ValueError(
            f"gather_rows needs x with at least 2 dims and index with at least {max(lead, 0)} "
            f"leading dims; got x {tuple(x.shape)} and index {tuple(index.shape)}."
        )


def _flat_index(x: Tensor, index: Tensor) -> Tensor:
    """``[*L', S']``: ``index`` as row numbers of x viewed as ``[prod(L) * R, C]``."""
    lead = x.dim() - 2
    r = x.shape[-2]
    batch = index.shape[:lead]
    groups = math.prod(x.shape[:lead])
    # Offset of each leading entry's first row in the flattened [groups * R, C] table;
    # broadcast dims of x read the same rows.
    offset = torch.arange(0, groups * r, r, device=x.device).view(x.shape[:lead])
    return index.reshape(*batch, -1) + offset.expand(batch)[..., None]
