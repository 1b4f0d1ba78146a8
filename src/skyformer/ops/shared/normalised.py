"""A normalised numerator, with a fallback on rows whose denominator is not usable.

Linear-time softmax approximations (Performer, ``nystrom_softmax``, Scatterbrain,
KDEformer, the decoding states) estimate A V and the row sums A 1 separately and divide;
where the estimated denominator is too small to trust they return mean(V) instead.
Written as ``where(ok, where(ok, num, 0) / where(ok, den, 1), fallback)``, autograd
saves a masked copy of the numerator and its backward forms six tensors of the
numerator's size (the masked gradient, the quotient's two partial derivatives and
their products): at B = 4, H = 16, N = 16384, D = 64 that was the peak of a
``nystrom_softmax`` call. ``_NormalisedOr`` saves the output instead (which the caller
holds anyway) and forms three, one at a time, of which it keeps one: the fallback's
gradient is a row selection summed, the denominator's -(g . out) / den row by row, the
numerator's g / den. As with SDPA, whose backward reads its output too, an in-place
write into the output before the backward pass is refused by autograd.

``numerator_and_denominator`` splits the output of a product with a column of ones
appended to V (``linalg.with_ones_column``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...amp import outside_autocast
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import functional_ops_only
from ...linalg.kernels import overwrite_in_eager


def numerator_and_denominator(o: Tensor) -> tuple[Tensor, Tensor]:
    """``(o[..., :-1], o[..., -1:])`` for ``o: [..., Dv + 1]`` (A [V, 1]), as one split:
    its backward pass writes one tensor of o's size, where each slice's backward wrote
    a zero tensor of that size and autograd added them."""
    numerator, denominator = o.split([o.shape[-1] - 1, 1], dim=-1)
    return numerator, denominator


def normalised_or(numerator: Tensor, denominator: Tensor, fallback: Tensor,
                  usable: Tensor | None = None) -> Tensor:
    """numerator / denominator on rows whose denominator is usable, ``fallback`` (e.g.
    mean(V)) on the others: ``[..., N, Dv] / [..., N, 1]``, ``fallback`` broadcasting to
    the output.

    Usable means not at or below sqrt(tiny) (and ``usable`` where given): the quotient's
    gradient divides by the squared denominator, which underflows to 0 below that. A NaN
    denominator (a non-finite input reached the sums) is usable: its row is NaN, as the
    input's, where the fallback would hide it (docs/reliability.md). Both sides are
    masked, so an overflowed numerator on a fallback row cannot turn its zero gradient
    into NaN (0 * inf). Differentiable twice; under forward-mode AD and ``torch.export``
    as plain operators (``functional_ops``).
    """
    ok = ~(denominator <= torch.finfo(denominator.dtype).tiny ** 0.5)
    if usable is not None:
        ok = ok & usable
    if functional_ops_only():
        return torch.where(ok, torch.where(ok, numerator, 0.0)
                           / torch.where(ok, denominator, 1.0), fallback)
    # saved for the backward pass, a column sliced from a product [..., Dv + 1] would
    # keep the whole product alive until then (as large as the output): a copy of the
    # column instead, made before the Function so that the gradient reaches the slice
    return apply(_NormalisedOr, numerator, denominator.contiguous(), fallback, ok)


class _NormalisedOr(torch.autograd.Function):
    """where(ok, num / den, fallback) (``normalised_or``); ``ok`` ``[..., N, 1]`` bool.
    The backward pass is written in differentiable operators (a differentiated
    backward pass, ``create_graph``, works) and batches under ``vmap``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(numerator: Tensor, denominator: Tensor,  # type: ignore[override]
                fallback: Tensor, ok: Tensor) -> Tensor:
        quotient = numerator / torch.where(ok, denominator, 1.0)
        # the selection written into the quotient: one tensor of the output's size (not
        # under a dispatch mode: selective checkpointing keeps the quotient)
        if overwrite_in_eager() \
                and torch.broadcast_shapes(quotient.shape, fallback.shape, ok.shape) \
                == quotient.shape and torch.result_type(quotient, fallback) == quotient.dtype:
            return torch.where(ok, quotient, fallback, out=quotient)
        return torch.where(ok, quotient, fallback)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        numerator, denominator, fallback, ok = inputs
        ctx.save_for_backward(denominator, ok, output)
        ctx.shapes = (numerator.shape, fallback.shape)
        ctx.dtypes = (numerator.dtype, fallback.dtype)

    @staticmethod
    @outside_autocast  # in the inputs' dtypes, also where backward runs under autocast
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _NormalisedOr._gradients(ctx, grad)

    @staticmethod
    def _gradients(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        denominator, ok, out = ctx.saved_tensors
        need_num, need_den, need_fallback = ctx.needs_input_grad[:3]
        safe = torch.where(ok, denominator, 1.0)
        d_num = d_den = d_fallback = None
        # the small gradients first: each forms (and frees) one tensor of grad's size
        # before the numerator's, of that size, is made
        if need_fallback:
            d_fallback = _fallback_rows_sum(grad, ~ok, ctx.shapes[1]).to(ctx.dtypes[1])
        if need_den:  # -(g . num / den) / den = -(g . out) / den on the usable rows
            dot = torch.linalg.vecdot(grad, out.to(grad.dtype)).unsqueeze(-1)
            d_den = torch.where(ok, -dot / safe, 0.0).to(denominator.dtype)
        if need_num:  # masked in place: the quotient's backward does not save it
            d_num = (grad / safe).masked_fill_(~ok, 0.0).to(ctx.dtypes[0]) \
                .sum_to_size(ctx.shapes[0])
        return d_num, d_den, d_fallback, None


def _fallback_rows_sum(grad: Tensor, fell_back: Tensor, shape: torch.Size) -> Tensor:
    """The gradient of a fallback of ``shape`` (broadcast to ``grad: [..., N, Dv]``): the
    sum of ``grad`` over the rows that took it (``fell_back: [..., N, 1]``), selected
    (not multiplied by a 0/1 mask, which would carry a NaN of another row's gradient)."""
    return torch.where(fell_back, grad, 0.0).sum_to_size(shape)
