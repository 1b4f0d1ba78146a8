"""Products with a Gaussian kernel block that is never held whole.

The modified Nystrom methods need two products per call with [N, m] kernel blocks
(Skyformer eqs. (5)-(6)): C(K, X)^T V and C(Q, X) Z. Formed whole, each block costs
N m floats per head, kept alive for the backward pass, and every elementwise pass over
it streams it through main memory. Here the block

    C_is = exp(s y_i . x_s - a_i - b_s),   a_i = s^2 |y_i|^2 / 2  (or 0, ``row_norm=False``)

(y: [N, D] unscaled rows, x: [m, D], b: [m] column offsets) is built ``chunk`` rows at
a time, so that the chunk stays in cache, and multiplied at once. The backward pass
rebuilds each chunk instead of storing C, so memory is O(N (D + R)), not O(N m).
With b = |x|^2/2, C is the Gaussian kernel exp(-|s y_i - x_s|^2 / 2) of the scaled rows;
with ``row_norm=False`` it is that kernel times exp(|s y_i|^2 / 2) (the softmax kernel's
E factor, ``nystrom_softmax``). Invalid rows (``row_valid``) and columns with b = +inf
are exact zeros with zero gradient where they hold finite numbers (NaN or inf there
stays non-finite: the registry's guard zeroes padded inputs before any method). The row
scale s and the row norms are applied inside, so no scaled copy of y and no [N, D] norm
temporaries are made; exp is evaluated as exp2 of the exponent times log2(e), folded
into x and the offsets.
Single entries can be excluded (``exclude``, an [N, m] bool mask read chunk by chunk,
e.g. a transposed view of an [m, N] mask): they are exact zeros with zero gradient,
as for the multipole far field, which leaves out each cluster's near keys.

Backward, with E the exponent and dE = dC * C (chunked):

    dy = s dE x - s^2 (dE 1) * y,   dx = s dE^T y,   db = -dE^T 1,

and the two sums need no pass over the block (as the row terms of flash attention):
for ``out = C Z``, ``(dE 1)_i = g_i . out_i`` and ``(dE^T 1)_s = z_s . (C^T g)_s``;
for ``out = C^T V``, ``(dE 1)_i = v_i . (C g)_i`` and ``(dE^T 1)_s = g_s . out_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..checks import check_positive_int
from .eager_calls import apply
from .flush import flush_exponent_on_cpu_
from .functional_ops import first_order_backward, functional_ops_only, jit_tracing
from .kernel_backend import HALF_TYPES, use_triton
from .kernel_matmul_triton import PRODUCT_FALLBACK, TritonGaussianBlockProduct
from .kernel_offsets import log2e, offset_and_value_gradients, row_offsets
from .nonfinite import row_marks
from .ones_column import with_ones_column
from .vmap import vmap_into_batch

# Elements of one chunk of the block, all heads together. 2^18 float32 = 1 MiB fits the
# per-core L2 of current CPUs, so the elementwise passes (offsets, exp, dC * C) stay in
# cache; on CUDA nothing is gained by small chunks but launches, so they are large.
CPU_CHUNK_ELEMENTS = 2**18
CUDA_CHUNK_ELEMENTS = 2**26


def chunk_rows(rows: int, batch: int, m: int, device: torch.device) -> int:
    """Rows per chunk for ``batch`` blocks of width ``m`` (at least 64, at most ``rows``)."""
    budget = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS
    return max(1, min(rows, max(64, budget // max(1, batch * m))))


class _Workspace:
    """Chunk buffers reused by every chunk of one call: a fresh ~1 MiB tensor per chunk
    would be a fresh allocation each time (page faults, cold cache lines).

    Traced (``torch.compile``), it hands out no buffer (``None``: the product allocates
    its output, and the compiler plans the memory): torch 2.11's dynamo fixed the length
    in the graph at a product written into a view of a buffer (``out=``), so every new
    length compiled again."""

    def __init__(self, like: Tensor, chunk: int, widths: dict[str, int]) -> None:
        self.bh = like.shape[0]
        self.buffers = {} if torch.compiler.is_compiling() else {
            name: like.new_empty(self.bh * chunk * w) for name, w in widths.items()}

    def get(self, name: str, rows: int, width: int) -> Tensor | None:
        """A contiguous ``[BH, rows, width]`` view of buffer ``name`` (None when traced)."""
        if name not in self.buffers:
            return None
        return self.buffers[name][: self.bh * rows * width].view(self.bh, rows, width)


def _exponent(
    y: Tensor, xt: Tensor, a: Tensor | None, neg_b: Tensor | None, out: Tensor | None,
    exclude: Tensor | None = None,
) -> Tensor:
    """y xt - a - b for one chunk (in log2 units): ``[BH, c, D] x [BH, D, m] -> [BH, c, m]``,
    into ``out`` (a new tensor where None); -inf where ``exclude`` (``[BH, c, m]`` bool)
    is set."""
    out = (torch.bmm(y, xt, out=out) if neg_b is None
           else torch.baddbmm(neg_b, y, xt, out=out))
    if a is not None:
        out.sub_(a[:, :, None])
    if exclude is not None:
        out.masked_fill_(exclude, float("-inf"))
    return out


def chunk_starts(n: int, chunk: int) -> Sequence[int]:
    """The first rows of the chunks of ``chunk`` rows that cover ``n``: one chunk
    without a loop over ``n`` when it fits, so that a compiled call keeps a symbolic
    length (``torch.compile`` fixes the length of a ``range`` it iterates, which made
    every new length a recompilation)."""
    return (0,) if n <= chunk else range(0, n, chunk)


class _GaussianBlockProduct(torch.autograd.Function):
    """out = C @ rhs (``transpose=False``) or C^T @ rhs (``transpose=True``), chunked;
    with [rhs, 1] for ``ones_column`` (appended here, so that rhs itself is saved).

    Tensors have one batch dim: y ``[BH, N, D]``, x ``[BH, m, D]``, b ``[BH, m]``,
    rhs ``[BH, m or N, R]``, row_valid ``[BH, N]`` bool or float row offsets
    (``kernel_offsets.row_offsets``), exclude ``[BH, N, m]`` bool.
    ``forward`` also returns what the backward pass needs (the row offsets, and the
    block itself when it fits in one chunk), so that ``setup_context`` can save it: the
    form ``torch.func`` transforms require. ``vmap`` folds the mapped dim into BH.
    """

    @staticmethod
    def forward(y: Tensor, x: Tensor, b: Tensor | None, rhs: Tensor,  # type: ignore[override]
                row_valid: Tensor | None, scale: float, row_norm: bool, transpose: bool,
                shift_rows: bool, chunk: int, exclude: Tensor | None, ones_column: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
        n = y.shape[1]
        rhs = with_ones_column(rhs, ones_column)
        # the row scale (and log2 e), applied to the m landmark rows: [BH, D, m]
        xt = (x * (scale * log2e())).transpose(1, 2)
        neg_b = None if b is None else (b * -log2e())[:, None, :]  # [BH, 1, m]
        a = row_offsets(y, scale, row_norm, row_valid)  # [BH, N]
        shift = None
        if transpose:
            out = y.new_zeros(y.shape[0], x.shape[1], rhs.shape[-1])  # [BH, m, R]
        else:
            out = y.new_empty(y.shape[0], n, rhs.shape[-1])  # [BH, N, R]
            if shift_rows:
                shift = y.new_empty(y.shape[0], n)
        m, width = x.shape[1], rhs.shape[-1]
        ws = _Workspace(y, min(chunk, n), {"block": m, "out": width})
        for s in chunk_starts(n, chunk):
            rows = slice(s, s + chunk)
            size = min(chunk, n - s)
            e = _exponent(y[:, rows], xt, None if a is None else a[:, rows], neg_b,
                          ws.get("block", size, m), None if exclude is None else exclude[:, rows])
            if shift is not None:
                r = e.amax(dim=-1)
                # A row with every column masked has max -inf: leave it at exp(-inf) = 0.
                r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
                shift[:, rows] = r
                e.sub_(r[:, :, None])
            c = flush_exponent_on_cpu_(e, base2=True).exp2_()  # [BH, c, m] (flush.py)
            if transpose and torch.compiler.is_compiling():
                # traced, out of place: Dynamo 2.11 traced the in-place accumulation into
                # this output so that the output was right and every gradient wrong
                out = torch.baddbmm(out, c.transpose(1, 2), rhs[:, rows])
            elif transpose:  # eager, in place: no [BH, m, R] allocation per chunk
                out.baddbmm_(c.transpose(1, 2), rhs[:, rows])
            else:
                out[:, rows] = torch.bmm(c, rhs, out=ws.get("out", size, width))
        if shift is not None:
            a = shift if a is None else a + shift  # the backward pass rebuilds C with both
        # One chunk is the whole block and already in cache-sized memory: keep it rather
        # than rebuild it (longer inputs are rebuilt chunk by chunk, memory O(N)).
        block = c.clone() if n <= chunk else y.new_empty(0)
        return out, (y.new_empty(0) if a is None else a), block

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        y, x, b, rhs, _, scale, row_norm, transpose, _, chunk, exclude, ones_column = inputs
        out, a, block = output
        ctx.mark_non_differentiable(a, block)
        ctx.set_materialize_grads(False)  # no zero tensors of the offsets' and block's size
        ctx.save_for_backward(y, x, b, rhs, a, out, block, exclude)
        ctx.options = (scale, row_norm, transpose, chunk, ones_column)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple[tuple, tuple]:
        return vmap_into_batch(_GaussianBlockProduct.apply, info, in_dims, args,
                               tensors=(0, 1, 2, 3, 4, 10), outputs=3)

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        y, x, b, rhs, a, out, block, exclude = ctx.saved_tensors
        if grad is None:  # the output reached no loss (grads are not materialised)
            return (None,) * 12
        a = a if a.numel() else None
        block = block if block.numel() else None
        scale, row_norm, transpose, chunk, ones_column = ctx.options
        need_y, need_x, need_b, need_rhs = ctx.needs_input_grad[:4]
        rhs = with_ones_column(rhs, ones_column)
        n = y.shape[1]
        xs = x * scale
        xt = (x * (scale * log2e())).transpose(1, 2)
        neg_b = None if b is None else (b * -log2e())[:, None, :]
        grad = grad.contiguous()
        # (dE 1): for C Z it is g . out; for C^T V it is v . dV, computed per chunk below.
        row_sums = None
        if need_y and row_norm and not transpose:
            row_sums = torch.linalg.vecdot(grad, out)
        dy = torch.empty_like(y) if need_y else None
        dx = torch.zeros_like(x) if need_x else None
        if transpose:
            drhs = torch.empty_like(rhs) if (need_rhs or (need_y and row_norm)) else None
            gt = grad.transpose(1, 2)  # [BH, R, m]
        else:
            drhs = torch.zeros_like(rhs) if (need_rhs or need_b) else None  # dZ = C^T g
            zt = rhs.transpose(1, 2)  # [BH, R, m]
        need_de = need_y or need_x
        m, d, width = x.shape[1], x.shape[2], rhs.shape[-1]
        ws = _Workspace(y, min(chunk, n), {"block": m, "de": m, "dv": width, "dy": d})
        for s in chunk_starts(n, chunk):
            rows = slice(s, s + chunk)
            size = min(chunk, n - s)
            y_c = y[:, rows]
            c = block if block is not None else flush_exponent_on_cpu_(_exponent(
                y_c, xt, None if a is None else a[:, rows], neg_b, ws.get("block", size, m),
                None if exclude is None else exclude[:, rows],
            ), base2=True).exp2_()
            if transpose:
                if drhs is not None:
                    dv = torch.bmm(c, grad, out=ws.get("dv", size, width))  # [BH, c, R]
                    drhs[:, rows] = dv
                if need_de:
                    de = torch.bmm(rhs[:, rows], gt, out=ws.get("de", size, m)).mul_(c)
            else:
                if drhs is not None:
                    drhs.baddbmm_(c.transpose(1, 2), grad[:, rows])
                if need_de:
                    de = torch.bmm(grad[:, rows], zt, out=ws.get("de", size, m)).mul_(c)
            if need_y:
                dy_c = torch.bmm(de, xs, out=ws.get("dy", size, d))  # [BH, c, D]
                if row_norm:
                    sums = (torch.linalg.vecdot(rhs[:, rows], dv) if transpose
                            else row_sums[:, rows])
                    dy_c.addcmul_(y_c, sums[:, :, None], value=-scale * scale)
                dy[:, rows] = dy_c
            if need_x:
                dx.baddbmm_(de.transpose(1, 2), y_c)
        if dx is not None:
            dx.mul_(scale)
        db, drhs = offset_and_value_gradients(grad, out, rhs, drhs, transpose=transpose,
                                              need_b=need_b, need_rhs=need_rhs,
                                              ones_column=ones_column)
        return dy, dx, db, drhs, None, None, None, None, None, None, None, None


def _check_devices(y: Tensor, **others: Tensor | None) -> None:
    """Every tensor on y's device, or a sentence naming the first that is not: the
    Triton kernels would fail on a tensor of another device, and under "auto" that
    failure would be taken for the kernel's own (``PRODUCT_FALLBACK``: PyTorch for every
    later call on that device)."""
    from ..ops.shared.inputs import check_device  # the ops package imports linalg

    for name, t in others.items():
        if t is not None:
            check_device("gaussian_kernel_matmul", name, t, y.device)


def gaussian_kernel_matmul(
    y: Tensor,
    x: Tensor,
    rhs: Tensor,
    col_offset: Tensor | None,
    *,
    scale: float = 1.0,
    row_norm: bool = True,
    row_valid: Tensor | None = None,
    row_offset: Tensor | None = None,
    transpose: bool = False,
    shift_rows: bool = False,
    chunk: int | None = None,
    exclude: Tensor | None = None,
    kernel: str = "auto",
    x_bf16: Tensor | None = None,
    x_factor: float = 1.0,
    ones_column: bool = False,
    show_nonfinite: bool = False,
) -> Tensor:
    """C @ rhs or C^T @ rhs for C = exp(s y x^T - s^2|y|^2/2 - col_offset), never whole.

    Args:
        y: ``[..., N, D]`` rows, unscaled; x: ``[..., m, D]`` (already in the scaled space),
            in the compute dtype (float32 or float64).
        rhs: ``[..., m, R]`` (``transpose=False``) or ``[..., N, R]`` (``transpose=True``).
            y and an N-row rhs may be bfloat16 / float16: the Triton kernels read them
            as they are (no float32 copy) and return N-row results in y's dtype; the
            PyTorch path converts them to x's dtype first.
        col_offset: ``[..., m]`` b_s (e.g. ``half_sq_norm(x)``), +inf for columns that
            must be zero; ``None`` = 0.
        scale: s, the factor applied to y (e.g. p^-1/4).
        row_norm: subtract s^2 |y_i|^2 / 2 from row i (the Gaussian kernel); ``False``
            leaves it out (rows scaled by exp(s^2 |y_i|^2 / 2)).
        row_valid: ``[..., N]`` bool (broadcastable over the batch dims), False rows are 0.
        row_offset: ``[..., N]`` (broadcastable) constants r_i subtracted from row i's
            exponent (C_is scaled by exp(-r_i); not differentiated; +inf: a zero row),
            e.g. a shift that keeps a row's entries at most 1.
        transpose: compute C^T @ rhs instead of C @ rhs.
        shift_rows: divide each row of C by its largest entry (computed in log space,
            without gradient), as ``gaussian_kernel_block(shift_rows=True)``; only with
            ``transpose=False``.
        chunk: rows per chunk; default from ``chunk_rows``.
        exclude: ``[..., N, m]`` bool (any strides, e.g. a transposed ``[..., m, N]``
            mask), True entries of C are 0 (no gradient through them).
        kernel: ``"auto"`` (Triton for float32 CUDA tensors, else PyTorch; PyTorch
            where the kernels failed, ``PRODUCT_FALLBACK``), ``"torch"`` or ``"triton"``
            (``kernel_backend``).
        x_bf16: x / ``x_factor`` in x's dtype when its values are bfloat16 numbers (the
            landmark rows of bfloat16 inputs before their scale), or None: the Triton
            kernels then read it and leave out the bf16x3 products with its zero lo
            part (y x^T of bfloat16 y: one tensor-core product instead of two, exact),
            with ``x_factor`` in the exponent's factor; gradients are x's. Ignored by
            the PyTorch path.
        ones_column: multiply [rhs, 1] (rhs with a column of ones appended: the row or
            column sums of C in the last column of the result, e.g. a normaliser),
            appended inside, so that rhs itself is saved for the backward pass (where
            rhs is an input, no copy is held from the forward to the backward pass).
        show_nonfinite: mark non-finite inputs as ``registry/guard.py`` does, where the
            rows are read (``linalg/nonfinite.py``; in the Triton kernels' tiles, no pass
            of its own): ``C @ rhs``: row i of the result is NaN where y_i holds a NaN
            or inf; ``C^T @ rhs``: the whole result is NaN where a row of y or rhs that
            ``row_valid`` keeps holds one. Not differentiated (finite inputs: the same
            gradients); a marked ``C^T @ rhs`` is what its backward pass reads.
    Returns:
        ``[..., N, R]`` (``C @ rhs``) or ``[..., m, R]`` (``C^T @ rhs``), R + 1 columns
        with ``ones_column``; differentiable in
        ``y``, ``x``, ``col_offset`` and ``rhs`` (the backward pass rebuilds C by chunks).
    """
    if shift_rows and transpose:
        raise ValueError("shift_rows scales the rows of C; it is not defined with transpose=True.")
    batch_shape = y.shape[:-2]
    n, d = y.shape[-2:]
    m = x.shape[-2]
    if x.shape[:-2] != batch_shape or x.shape[-1] != d or rhs.shape[:-2] != batch_shape \
            or rhs.shape[-2] != (n if transpose else m):
        raise ValueError(
            f"gaussian_kernel_matmul: shapes do not fit: y {tuple(y.shape)}, x {tuple(x.shape)}, "
            f"rhs {tuple(rhs.shape)} (transpose={transpose})."
        )
    _check_devices(y, x=x, rhs=rhs, col_offset=col_offset, row_offset=row_offset,
                   row_valid=row_valid, exclude=exclude, x_bf16=x_bf16)
    if n == 0:
        raise ValueError(
            f"gaussian_kernel_matmul: empty input, y {tuple(y.shape)} has no rows; "
            f"give it at least one (C would be 0 x {m}).")
    if row_offset is not None and (not row_offset.is_floating_point() or _broadcast(
            row_offset.shape, (*batch_shape, n)) != (*batch_shape, n)):
        raise ValueError(
            f"gaussian_kernel_matmul: row_offset must be a float tensor of one offset a "
            f"row of y, broadcastable to {(*batch_shape, n)}; got {row_offset.dtype} "
            f"{tuple(row_offset.shape)}.")
    bh = 1
    for size in batch_shape:
        bh *= size
    if chunk is None:
        chunk = chunk_rows(n, bh, m, y.device)
    else:
        check_positive_int("gaussian_kernel_matmul: chunk", chunk)
    if row_offset is not None:  # with row_valid, in one float tensor (row_offsets)
        offset = row_offset.detach().to(x.dtype)
        row_valid = offset if row_valid is None else torch.where(
            row_valid, offset, torch.full((), float("inf"), dtype=x.dtype, device=x.device))
    auto = kernel == "auto"
    triton = use_triton(kernel, x)
    if not (triton and y.dtype in (x.dtype, *HALF_TYPES)):
        y = y.to(x.dtype)
    # the kernels' failures are per device and dtype of the rows they read (y: half
    # types compile other kernels); the PyTorch path converts y itself
    triton = triton and not (auto and PRODUCT_FALLBACK.failed_on(y))
    if not (triton and transpose and rhs.dtype in (x.dtype, *HALF_TYPES)):
        rhs = rhs.to(x.dtype)
    if functional_ops_only() or jit_tracing():  # row_valid as given, broadcast: a
        # reshape of its expanded batch dims made torch 2.11's export guard on N
        rhs = with_ones_column(rhs, ones_column)
        out = _product_by_autograd(y, x, col_offset, rhs, row_valid, scale, row_norm,
                                   transpose, shift_rows, exclude)
        out = out.reshape(*batch_shape, *out.shape[-2:])
        return _with_marks(out, y, rhs, row_valid, transpose, batch_shape) \
            if show_nonfinite else out
    if row_valid is not None:
        row_valid = row_valid.expand(*batch_shape, n).reshape(bh, n)
    if exclude is not None:
        if exclude.shape != (*batch_shape, n, m) or exclude.dtype != torch.bool:
            raise ValueError(
                f"gaussian_kernel_matmul: exclude must be a bool tensor of shape "
                f"{(*batch_shape, n, m)}, got {exclude.dtype} {tuple(exclude.shape)}."
            )
        exclude = exclude.reshape(bh, n, m)
    if x_bf16 is not None and (x_bf16.shape != x.shape or x_bf16.dtype != x.dtype):
        raise ValueError(
            f"gaussian_kernel_matmul: x_bf16 must have x's shape and dtype "
            f"{tuple(x.shape)} {x.dtype}, got {tuple(x_bf16.shape)} {x_bf16.dtype}.")
    y, x = y.reshape(bh, n, d), x.reshape(bh, m, d)
    b = None if col_offset is None else col_offset.reshape(bh, m)
    rhs = rhs.reshape(bh, *rhs.shape[-2:])

    def by_pytorch() -> Tensor:
        out = apply(_GaussianBlockProduct, y.to(x.dtype), x, b, rhs.to(x.dtype), row_valid,
                    float(scale), row_norm, transpose, shift_rows, chunk, exclude,
                    ones_column)[0]
        return _with_marks(out, y, rhs, row_valid, transpose, (bh,)) if show_nonfinite \
            else out

    def by_triton() -> Tensor:
        return apply(TritonGaussianBlockProduct, y, x, b, rhs, row_valid, float(scale),
                     row_norm, transpose, shift_rows, exclude,
                     None if x_bf16 is None else x_bf16.reshape(bh, m, d), float(x_factor),
                     ones_column, auto, show_nonfinite)[0]

    # a kernel that fails inside is the operators' to catch (in compiled graphs too);
    # this one catches what fails around them in eager code (importing Triton)
    out = PRODUCT_FALLBACK.run(auto, by_triton, by_pytorch, on=y) if triton else by_pytorch()
    return out.reshape(*batch_shape, *out.shape[1:])


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shapes broadcast together, or None where they do not."""
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


def _with_marks(out: Tensor, y: Tensor, rhs: Tensor, row_valid: Tensor | None,
                transpose: bool, batch_shape: torch.Size | tuple[int, ...]) -> Tensor:
    """``out`` with ``show_nonfinite``'s marks added (the PyTorch paths); ``row_valid``
    ``[BH, N]``, the other tensors with the batch dims ``batch_shape``."""
    valid = None if row_valid is None else row_valid.expand(*batch_shape,
                                                             row_valid.shape[-1])
    if valid is not None and valid.dtype != torch.bool:  # row offsets: +inf drops a row
        valid = torch.isfinite(valid)
    if transpose:  # every entry: the sum of the valid rows' marks
        marks = row_marks(y, rhs, valid).sum(-1)[..., None, None]
    else:
        marks = row_marks(y, valid=valid)[..., None]
    return out + marks.to(out.dtype)


def _product_by_autograd(
    y: Tensor, x: Tensor, col_offset: Tensor | None, rhs: Tensor, row_valid: Tensor | None,
    scale: float, row_norm: bool, transpose: bool, shift_rows: bool, exclude: Tensor | None,
) -> Tensor:
    """The same product with the block formed whole and differentiated by autograd,
    in both modes: for ``torch.export`` and forward-mode AD (``functional_ops``).
    ``row_valid`` is ``[..., N]`` broadcast over the batch dims (bool, or float row
    offsets); the rest as the caller's.
    """
    e = scale * (y @ x.transpose(-1, -2))  # [..., N, m]
    if row_norm:
        e = e - (0.5 * scale * scale) * (y * y).sum(-1, keepdim=True)
    if col_offset is not None:
        e = e - col_offset[..., None, :]
    if row_valid is not None and row_valid.dtype != torch.bool:  # row offsets
        e = e - row_valid[..., None]
    elif row_valid is not None:
        e = e.masked_fill(~row_valid[..., None], float("-inf"))
    if exclude is not None:
        e = e.masked_fill(exclude, float("-inf"))
    if shift_rows:
        top = e.detach().amax(-1, keepdim=True)
        e = e - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    c = e.exp()
    return c.transpose(-1, -2) @ rhs if transpose else c @ rhs
