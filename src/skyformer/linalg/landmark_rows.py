"""The gradient of Skyformer's landmark rows added into dq and dk, for a backward pass
chained by hand (``ops/skyformer/two_nodes.py``).

The rows X = s [Q_S; K_S] reach the query product, the Lemma 3 core and the key
product, each with their half squared norms n = |x|^2 / 2; the three give X and n a
gradient each. Their sum, with n's term (dn x, added as autograd adds the two factors of
x * x), times s, is the gradient of the rows of q and k:

    dq[i_j] += s (((dX_query + dX_core) + dX_keys) + dn x + dn x),
    dn = ((dn_query + dn_core) + dn_keys) / 2, 0 on dead slots,

in the order autograd sums them in the composed call. On the Triton path one kernel
computes it and adds it in place (``triton_landmark_rows``; under ``"auto"`` it warns
once and gives way to PyTorch operations where it cannot compile or launch,
``ROWS_GRADIENT_FALLBACK``); ``add_rows_gradient_by_pytorch`` is the same arithmetic by
PyTorch operations, the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_backend import KernelFallback
from .rows import add_rows

ROWS_GRADIENT_FALLBACK = KernelFallback(
    "landmark rows' gradient kernel", "adding the rows' gradient by PyTorch operations "
    "(the same numbers)")


def add_rows_gradient(
    dq: Tensor | None, dk: Tensor | None, flat_q: Tensor, flat_k: Tensor, x: Tensor,
    dx: tuple[Tensor, Tensor, Tensor], dnorm: tuple[Tensor, Tensor, Tensor],
    live: Tensor | None, scale: float, *, auto: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """(dq, dk) with the rows' gradient added, in place (module docstring): ``dq``
    ``[B, H, Nq, D]`` and ``dk`` ``[BH, Nk, D]`` (None: that side needs none), the rows
    ``x: [BH, m, D]`` (scaled), ``dx`` their three gradients ``[BH, m, D]`` and
    ``dnorm`` their norms' ``[BH, m]`` (query product, core, key product), ``live:
    [B, m]`` or None, ``flat_q: [B, H, mq]`` and ``flat_k: [B, H, m - mq]`` the slots'
    rows in q and k viewed as ``[rows, D]`` (``rows.rows_untracked``), s = ``scale``.
    By the Triton kernel where dq and dk are contiguous (``auto``: with its fallback),
    by PyTorch operations otherwise."""
    if dq is None and dk is None:
        return None, None

    def by_pytorch() -> tuple[Tensor | None, Tensor | None]:
        return add_rows_gradient_by_pytorch(dq, dk, flat_q, flat_k, x, dx, dnorm, live, scale)

    if not all(t is None or t.is_contiguous() for t in (dq, dk)):
        return by_pytorch()

    def launch() -> tuple[Tensor | None, Tensor | None]:
        from .triton_landmark_rows import add_landmark_rows_gradient

        add_landmark_rows_gradient(
            dq, dk, flat_q.reshape(x.shape[0], flat_q.shape[-1]),
            flat_k.reshape(x.shape[0], flat_k.shape[-1]), x.contiguous(),
            tuple(t.contiguous() for t in dx), tuple(t.contiguous() for t in dnorm), live,
            scale)
        return dq, dk

    return ROWS_GRADIENT_FALLBACK.run(auto, launch, by_pytorch, on=x)


def add_rows_gradient_by_pytorch(
    dq: Tensor | None, dk: Tensor | None, flat_q: Tensor, flat_k: Tensor, x: Tensor,
    dx: tuple[Tensor, Tensor, Tensor], dnorm: tuple[Tensor, Tensor, Tensor],
    live: Tensor | None, scale: float,
) -> tuple[Tensor | None, Tensor | None]:
    """``add_rows_gradient`` by PyTorch operations (into dq and dk in place where they
    are contiguous, ``rows.add_rows``)."""
    total = (dx[0] + dx[1]) + dx[2]
    norm = (dnorm[0] + dnorm[1]) + dnorm[2]
    if live is not None:  # the dead slots' +inf norms take no gradient
        norm = torch.where(live[:, None, :], norm.view(live.shape[0], -1, norm.shape[-1]),
                           0.0).view(norm.shape)
    half = norm.mul_(0.5)[..., None] * x
    total = total.add_(half).add_(half).mul_(scale)
    rows = total.view(*flat_q.shape[:2], -1, total.shape[-1]).to(
        (dq if dq is not None else dk).dtype)  # [B, H, m, D]
    mq = flat_q.shape[-1]
    if dq is not None:
        dq = add_rows(dq, rows[..., :mq, :], flat_q, in_place=True)
    if dk is not None:
        dk = add_rows(dk, rows[..., mq:, :], flat_k, in_place=True)
    return dq, dk
