"""Whole-row gathers by ``index_select`` on a flattened view.

``x.gather(dim, index[..., None].expand(..., D))`` reads and writes element by element
on CPU; copying whole rows of a flattened ``[M, D]`` view with offset indices
(``index_select``, whose backward is a row-wise ``index_add``) gives the same values and
gradients and is about 10x faster for rows of 32-64 floats.

``gather_rows_through`` is the gather for tensors that are also read whole elsewhere
(the landmark rows of Q and K, whose products read every row): autograd would give
the gather's gradient as a zero tensor of x's size with the rows added, then add it
to the gradient of the whole reads, three passes over an x-sized tensor and three
launches; passing x through the same node adds the rows' gradient to the other one
in a single ``index_add``: out of place (a copy of x's size), or in place where the
caller says that the gradient reaching x through the node is a tensor no other node
holds (``in_place``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .eager_calls import apply, plain_eager, plain_tensors, untraced_eager
from .functional_ops import functional_ops_only
from .vmap import vmap_into_batch


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
    return _rows(x, _flat_index(x, index)).view(*index.shape, x.shape[-1])


class PermuteRows(torch.autograd.Function):
    """``out[:, :, j] = x_pad[:, :, index[j]]`` for a bijection between the rows of x and
    the entries of ``index`` below the row count R (R = an empty slot, a zero row), with
    ``inverse`` its inverse (R = empty). Autograd's gather backward is a scatter-add into
    zeros; for a bijection it is a gather by the inverse, several times cheaper on CPU.
    Call it through ``permute_rows``."""

    @staticmethod
    def forward(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:  # type: ignore[override]
        return gather_padded(x, index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[Tensor, int | None]:
        (out,), (dim,) = vmap_into_batch(PermuteRows.apply, info, in_dims, args,
                                         tensors=(0, 1, 2), outputs=1)
        return out, dim

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # linear: a gather
        (inverse,) = ctx.saved_tensors
        return gather_padded(grad, inverse), None, None


def permute_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """``PermuteRows`` (the multipole methods' cluster order, the real tokens gathered
    to the front); under forward-mode AD and ``torch.export`` autograd's gather (a
    custom ``jvp`` rule would stop ``torch.compile``, which cannot trace one)."""
    if functional_ops_only():
        return gather_padded(x, index)
    return apply(PermuteRows, x, index, inverse)


def gather_padded(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x: [B, H, R, D]`` at ``index: [B, H, S]`` (R = a zero row) -> ``[B, H, S, D]``."""
    b, h, r, d = x.shape
    if index.shape[-1] > r:  # a bijection's index reaches R only if it has more entries
        x = torch.cat([x, x.new_zeros(b, h, 1, d)], dim=2)
    return gather_rows(x, index)


def gather_rows_through(xs: Sequence[Tensor], indices: Sequence[Tensor], *,
                        in_place: bool = False) -> tuple[tuple[Tensor, ...], Tensor]:
    """``(xs, cat([gather_rows(x, index) ...], dim=-2))`` as one autograd node (module
    docstring): read each x whole only through the first output, so that the gradient
    of its rows is added to the gradient of x in one ``index_add``.

    Args:
        xs: one or two tensors ``[*L_i, R_i, C]`` (``L_i`` broadcasting to ``L'``, as
            ``gather_rows``), e.g. Q and K.
        indices: one ``[*L', *S_i]`` long tensor per x (its selection dims
            ``S_i`` flattened in the rows).
        in_place: add the rows' gradient into the gradient that reaches each returned x
            in place (in a plain eager backward pass without ``create_graph``):
            no copy of x's size, whose allocation was the peak of a Skyformer backward
            pass. Only for callers whose every use of the returned xs gives back a
            gradient that no other node holds (the Gaussian products, whose backward
            writes a new tensor, and views of them; an addition gives its gradient to
            both operands, so a single addition in between would let this change the
            other operand's gradient too).
    Returns:
        ``(xs, rows)``, rows ``[*L', |S_1| + |S_2| + ..., C]``: the values and gradients of
        the xs and of ``gather_rows`` joined by ``torch.cat`` (double backward and
        ``vmap`` included). Under forward-mode AD and ``torch.export`` they are
        computed so (a custom ``jvp`` rule would stop ``torch.compile``, which cannot
        trace one; ``functional_ops``). One node for all the xs: each application of a
        Function costs the host about 30 us (PyTorch binds its arguments by
        ``inspect.signature``).
    """
    if len(xs) != len(indices) or len(xs) not in (1, 2):
        raise ValueError(f"gather_rows_through needs one index per tensor, one or two "
                         f"tensors; got {len(xs)} tensors and {len(indices)} indices.")
    if functional_ops_only():
        return tuple(xs), torch.cat(
            [gather_rows(x, index).flatten(x.dim() - 2, -2)
             for x, index in zip(xs, indices, strict=True)], dim=-2)
    flats = _flat_indices(xs, indices)
    if len(xs) == 1:
        x, _, rows = apply(_RowsThrough, xs[0], flats[0], None, None, in_place)
        return (x,), rows
    if xs[0] is xs[1] and torch.compiler.is_compiling():  # attention(x, x, x) compiled:
        # dynamo traces no Function given one tensor twice; the rows of both indices
        # from the one tensor are the same rows, one node
        x, _, rows = apply(_RowsThrough, xs[0], torch.cat(flats, dim=-1), None, None,
                           in_place)
        return (x, x), rows
    x, y, rows = apply(_RowsThrough, xs[0], flats[0], xs[1], flats[1], in_place)
    return (x, y), rows


def rows_untracked(xs: Sequence[Tensor], indices: Sequence[Tensor]
                   ) -> tuple[list[Tensor], Tensor]:
    """(the row numbers of each x, the rows) of ``gather_rows_through`` without its
    autograd node, for a caller that adds the rows' gradient itself (``add_rows``):
    each number a row of x viewed as ``[M, C]``."""
    flats = _flat_indices(xs, indices)
    rows = [_rows(x, flat) for x, flat in zip(xs, flats, strict=True)]
    return flats, rows[0] if len(rows) == 1 else torch.cat(rows, dim=-2)


def add_rows(grad: Tensor, rows_grad: Tensor, flat: Tensor, *, in_place: bool) -> Tensor:
    """``grad`` with the gradient ``rows_grad`` of the rows at ``flat``
    (``rows_untracked``'s numbers) added, as ``gather_rows_through``'s backward adds it
    (``in_place``: into ``grad`` itself where it is contiguous)."""
    return _add_rows(grad, rows_grad, flat, grad.shape, grad.dtype, grad.device, in_place)


def _flat_indices(xs: Sequence[Tensor], indices: Sequence[Tensor]) -> list[Tensor]:
    """``_flat_index`` of each x and its index, checked; tensors of one layout (Q and K
    of a self-attention call) share their row offsets: one launch less, two in eager."""
    for x, index in zip(xs, indices, strict=True):
        _check(x, index)
    offsets = _row_offsets(xs[0], indices[0])
    if len(xs) == 2 and xs[1].shape[:-1] == xs[0].shape[:-1] \
            and indices[1].shape[:-1] == indices[0].shape[:-1]:
        return [_offset(index, offsets) for index in indices]
    return [_offset(indices[0], offsets),
            *(_flat_index(x, index) for x, index in zip(xs[1:], indices[1:], strict=True))]


class _RowsThrough(torch.autograd.Function):
    """(x, y, the rows ``flat_x: [*L', S_x]`` of x viewed as ``[M_x, C]`` joined along
    the row dim with the rows ``flat_y`` of y); y and ``flat_y`` may be None. The
    backward pass adds each tensor's rows' gradient into its gradient with ``index_add``
    (differentiable, so double backward works; ``in_place``: ``gather_rows_through``).
    Fixed arguments: dynamo does not trace a Function whose forward takes ``*args``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, flat_x: Tensor, y: Tensor | None,  # type: ignore[override]
                flat_y: Tensor | None, in_place: bool) -> tuple[Tensor, Tensor | None, Tensor]:
        rows = _rows(x, flat_x)
        if y is None:
            return x, None, rows
        return x, y, torch.cat([rows, _rows(y, flat_y)], dim=-2)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, flat_x, y, flat_y, in_place = inputs
        ctx.save_for_backward(flat_x, flat_y)
        ctx.in_place = in_place
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (x, y) if t is not None]

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor | None, grad_y: Tensor | None,
                 grad_rows: Tensor | None
                 ) -> tuple[Tensor | None, None, Tensor | None, None, None]:
        flats = [f for f in ctx.saved_tensors if f is not None]
        if grad_rows is None:
            return grad_x, None, grad_y, None, None
        # in place only in a plain backward pass: not while it is differentiated
        # (create_graph), traced (torch.compile) or transformed (torch.func, batched
        # gradients); nor into one tensor given for both (an addition of the two
        # outputs gives its gradient to each), which the caller's promise rules out but
        # costs nothing to check
        in_place = ctx.in_place and not torch.is_grad_enabled() and plain_eager() \
            and plain_tensors(grad_rows, grad_x, grad_y) and not _shared(grad_x, grad_y)
        parts = grad_rows.split([flat.shape[-1] for flat in flats], dim=-2)
        needed = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        summed = [_add_rows(grad, part, flat, *spec, in_place) if need else None
                  for grad, part, flat, spec, need
                  in zip((grad_x, grad_y)[:len(flats)], parts, flats, ctx.inputs,
                         needed[:len(flats)], strict=True)]
        return summed[0], None, (summed[1] if len(summed) > 1 else None), None, None


def _shared(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two gradients share memory."""
    return a is not None and b is not None \
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _rows(x: Tensor, flat: Tensor) -> Tensor:
    """Rows ``flat: [*L', S]`` of x viewed as ``[M, C]``: ``[*L', S, C]``."""
    return x.reshape(-1, x.shape[-1]).index_select(0, flat.reshape(-1)).view(
        *flat.shape, x.shape[-1])


def _add_rows(grad: Tensor | None, part: Tensor, flat: Tensor, shape: torch.Size,
              dtype: torch.dtype, device: torch.device, in_place: bool) -> Tensor:
    """``grad`` (zeros if None) with the rows' gradient ``part`` added at ``flat``
    (``in_place``: into ``grad`` itself where it is contiguous)."""
    if grad is None:
        grad, in_place = torch.zeros(shape, dtype=dtype, device=device), True
    width = shape[-1]
    rows = part.reshape(-1, width).to(grad.dtype)
    if in_place and grad.is_contiguous():
        return grad.view(-1, width).index_add_(0, flat.reshape(-1), rows).view(shape)
    if torch.compiler.is_compiling():
        # a traced gradient may say it is contiguous where the real one is not (k's in
        # causal Skyformer, a transposed layout, compiled by aot_eager once the length
        # turned dynamic): a reshape of it was recorded as a view, which then failed at
        # run time. The addition goes into a copy in the contiguous layout instead, the
        # one copy the out-of-place addition makes.
        copy = grad.clone(memory_format=torch.contiguous_format)
        return copy.view(-1, width).index_add_(0, flat.reshape(-1), rows).view(shape)
    return grad.reshape(-1, width).index_add(0, flat.reshape(-1), rows).view(shape)


def _check(x: Tensor, index: Tensor) -> None:
    lead = x.dim() - 2
    if lead < 0 or index.dim() < lead:
        raise ValueError(
            f"gather_rows needs x with at least 2 dims and index with at least {max(lead, 0)} "
            f"leading dims; got x {tuple(x.shape)} and index {tuple(index.shape)}."
        )


def _flat_index(x: Tensor, index: Tensor) -> Tensor:
    """``[*L', S']``: ``index`` as row numbers of x viewed as ``[prod(L) * R, C]``."""
    return _offset(index, _row_offsets(x, index))


def _row_offsets(x: Tensor, index: Tensor) -> Tensor:
    """``[*L', 1]``: the number of each leading entry's first row in x viewed as
    ``[prod(L) * R, C]`` (``index: [*L', ...]``); broadcast dims of x read the same
    rows."""
    lead = x.dim() - 2
    r = x.shape[-2]
    groups = math.prod(x.shape[:lead])
    if untraced_eager() and r > 0:  # one launch (arange takes no zero step)
        offset = torch.arange(0, groups * r, r, device=x.device)
    else:  # a multiple of arange(groups): a symbolic R (torch.export) cannot prove the
        # length of arange(0, groups * R, R)
        offset = torch.arange(groups, device=x.device) * r
    return offset.view(x.shape[:lead]).expand(index.shape[:lead])[..., None]


def _offset(index: Tensor, offsets: Tensor) -> Tensor:
    """``index`` flattened after its leading dims, plus the row offsets ``[*L', 1]``."""
    return index.reshape(*offsets.shape[:-1], -1) + offsets
