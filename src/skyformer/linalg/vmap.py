"""``vmap`` rules for the library's custom ``autograd.Function``s.

Every such Function already works on a leading batch dim (heads, blocks), so mapping it
over one more dim is the same call with the mapped dim merged into that batch dim: move
each mapped dim to the batch dim, flatten the two (expanding arguments that are not
mapped), run once, and split the outputs back. This is exact, costs one call, and needs
no per-example Python loop (``torch.func`` docs, "Extending torch.func with
autograd.Function").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


def is_placeholder(t: Tensor) -> bool:
    """An empty 1-D tensor standing for an absent one (a Function's inputs and outputs
    must be tensors); it is never mapped."""
    return t.numel() == 0 and t.dim() == 1


def fold_into_batch(t: Tensor, in_dim: int | None, size: int, at: int = 0) -> Tensor:
    """``t`` with its mapped dim ``in_dim`` (of size ``size``; ``None``: not mapped, so
    expanded) merged into its batch dim ``at``, the mapped index running slowest."""
    t = t.expand(size, *t.shape) if in_dim is None else t.movedim(in_dim, 0)
    t = t.movedim(0, at)
    t = t.reshape(*t.shape[:at], size * t.shape[at + 1], *t.shape[at + 2:])
    # an expanded batch of one folds into a view repeating it (stride 0), which the
    # kernels, reading a batch as dense, would run past: copy it
    repeated = any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride(), strict=True))
    return t.contiguous() if repeated else t


def split_batch(t: Tensor, size: int, at: int = 0) -> Tensor:
    """Inverse of ``fold_into_batch``: ``t``'s batch dim ``at`` split into
    ``[size, rest]``, the mapped dim at ``at``."""
    return t.reshape(*t.shape[:at], size, t.shape[at] // size, *t.shape[at + 1:])


def vmap_into_batch(
    apply: Callable[..., Any], info: Any, in_dims: Sequence[int | None], args: Sequence[Any],
    *, tensors: Sequence[int], outputs: int,
) -> tuple[tuple[Tensor, ...], tuple[int | None, ...]]:
    """Run ``apply(*args)`` once for the whole vmapped batch.

    Args:
        apply: the Function's ``apply``.
        info: ``VmapInfo`` (``batch_size``).
        in_dims: the mapped dim of each argument (``None``: not mapped).
        args: the arguments.
        tensors: positions of the tensor arguments with a leading batch dim (each may be
            ``None``); the mapped dim is merged into that dim.
        outputs: number of outputs; an empty output (a placeholder) is returned unmapped.
    Returns:
        ``(outputs, out_dims)`` as a ``vmap`` staticmethod returns them.
    """
    size = info.batch_size
    new = list(args)
    for i in tensors:
        if args[i] is not None:
            new[i] = fold_into_batch(args[i], in_dims[i], size)
    result = apply(*new)
    results = result if isinstance(result, tuple) else (result,)
    assert len(results) == outputs
    out, dims = [], []
    for r in results:
        if is_placeholder(r):
            out.append(r)
            dims.append(None)
        else:
            out.append(split_batch(r, size))
            dims.append(0)
    return tuple(out), tuple(dims)
